"""One assembly of a run: ``build_run(cfg, info) -> Run``, for the trainer and for every tool that measures, replays
or checks a run (tools/memory.py, tools/trace.py, tools/verify.py), so that what a tool sees is what training runs.

In order: the choices (``resolve``: precision, compile, batch-invariant kernels, attention; the engine by
``dist.engine``; each decided once), the process-wide switches they need (batch-invariant kernels on or off, the
attention route), the model (``build_model``), ``torch.compile`` of its blocks and loss (``compile_model``, probed
under the forward's autocast), then the gradient-sync engine around it.  ``Run.close()`` closes the engine and puts
every switch back as it was before ``build_run`` (a ``with`` block does the same), so a second run, a test or a
notebook in the same process starts from its own settings.

Not here: the tier's torch settings and seeds (``determinism.apply_tier``, ``seed_process``: the caller's, once per
process), the process group, the data and the sampler (the Trainer's).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from dettrain import dist as D
from dettrain.kernels import batch_invariant as bi
from dettrain.loop.compile import CompileReport, compile_model
from dettrain.loop.resolve import Resolved, resolve
from dettrain.models import attention as attention_route
from dettrain.models.attention import AttentionChoice
from dettrain.models.llama import build_model, num_params
from dettrain.sync.engines import Engine, engine_class, lookup

__all__ = ["Run", "build_run", "kernel_switches"]


@dataclass
class Run:
    """A built run: the resolved choices, the model (compiled as configured), its engine and the forward's autocast.
    ``close()`` (or leaving a ``with`` block) closes the engine and undoes the process-wide switches."""

    resolved: Resolved
    """train.precision, train.compile, det.batch_invariant and det.attention on this device (loop/resolve.py)."""
    engine_cls: type[Engine]
    """The engine class dist.engine resolves to (or the one the caller named)."""
    model: nn.Module
    """The model, compiled in place when ``compiled.enabled`` (names and state dicts unchanged)."""
    compiled: CompileReport
    """What torch.compile did, per unit (the ledger header's ``compile``)."""
    engine: Engine | None
    """The gradient-sync engine around ``model``; None when built without one (``with_engine=False``)."""
    autocast: contextlib.AbstractContextManager
    """The context the forward runs in (torch.autocast to bf16, or nothing: the engine says)."""
    n_params: int
    """Parameters of the model, counted before any sharding."""
    _undo: list[Callable[[], None]] = field(default_factory=list, repr=False)

    @property
    def attention(self) -> AttentionChoice:
        """det.attention's choice for this run (recorded in the ledger header)."""
        return self.resolved.attention

    @property
    def engine_name(self) -> str:
        return self.engine_cls.name

    def close(self) -> None:
        """Close the engine (before the process group goes), then put back, last switched first, every
        process-wide setting ``build_run`` changed.  Idempotent."""
        engine, self.engine = self.engine, None
        try:
            if engine is not None:
                engine.close()
        finally:
            while self._undo:
                self._undo.pop()()

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def kernel_switches(resolved: Resolved) -> list[Callable[[], None]]:
    """Switch the batch-invariant kernels and the attention route to ``resolved``'s choice; returns the undo
    actions, last first to run.  The attention route is in place before the model is built (its check forward and
    compile's probe run through it)."""
    was, loss_fn = bi.enabled(), bi._LOSS_FN  # compile_model sets the compiled loss: the caller's comes back
    undo: list[Callable[[], None]] = [lambda: bi.set_loss_fn(loss_fn), lambda: bi.set_enabled(was)]
    try:
        bi.set_enabled(resolved.batch_invariant)
        undo.append(attention_route.route(resolved.attention))
    except BaseException:
        while undo:
            undo.pop()()
        raise
    return undo


def build_run(cfg, info: D.DistInfo, *, engine: str | None = None, with_engine: bool = True,
              compile: bool | None = None) -> Run:
    """The run ``cfg`` (a dettrain.config.Config, validated) on ``info.device``, as the trainer builds it.

    ``engine``: a registered engine name to build instead of the one dist.engine resolves to (the memory planner
    plans FSDP2 whatever dist.engine says).  ``with_engine=False``: the model alone, no engine around it (no process
    group needed: verify's module-by-module checks); the forward's autocast is then torch's for
    train.precision.  ``compile``: override whether the model is compiled (None: train.compile as resolved; the
    other choices stay as a run of ``cfg`` resolves them).  A failure part-way closes what was built and switched."""
    device = info.device
    resolved = resolve(cfg, device, info.world)  # every device-dependent choice, once (loop/resolve.py)
    if engine is not None:
        engine_cls = lookup(engine)
        engine_cls.check(cfg)
    else:
        engine_cls = engine_class(cfg)  # dist.engine, checked against the tier and this torch (sync/engines)
    mixed = resolved.mixed_precision
    # the engine says how the forward runs mixed: torch.autocast, or (FSDP2) its own MixedPrecisionPolicy
    autocast = (engine_cls if with_engine else Engine).autocast(device, mixed)
    undo = kernel_switches(resolved)
    try:
        check_fits(cfg.model, device)  # a model that cannot be allocated: one line, not an allocator traceback
        model = build_model(cfg.model, cfg.seed, device)
        # train.compile: blocks + loss, in place; probed under the forward's autocast (compile.py)
        enabled = resolved.compile if compile is None else compile
        # train.cuda_graphs: resolved for dist.engine's class; the engine built here must allow them too
        graphs = (resolved.cuda_graphs and enabled and with_engine
                  and engine_cls.graphs_blocker(cfg, info.world, mixed) is None)
        compiled = compile_model(model, cfg, device, autocast=autocast, enabled=enabled, cuda_graphs=graphs)
        n_params = num_params(model)  # before sharding: FSDP2 parameters hold only this rank's rows
        # the one gradient-sync seam (sync/engines): DDP, the flat canonical reducer, FSDP2 or a registered one
        eng = engine_cls.from_config(cfg, model, info, mixed_precision=mixed) if with_engine else None
    except BaseException:
        while undo:
            undo.pop()()
        raise
    return Run(resolved=resolved, engine_cls=engine_cls, model=model, compiled=compiled, engine=eng,
               autocast=autocast, n_params=n_params, _undo=undo)


def device_bytes(device: torch.device) -> int | None:
    """Total memory of ``device`` (CPU: physical RAM), None if unknown."""
    import os

    try:
        if device.type == "cuda":
            return int(torch.cuda.get_device_properties(device).total_memory)
        if device.type == "cpu":
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (OSError, ValueError, RuntimeError):
        pass
    return None


def check_fits(mcfg, device: torch.device) -> None:
    """dettrain's LLaMA is built whole on the device before any sharding: refuse one whose fp32 parameters alone
    exceed the device's memory (e.g. model.vocab_size=2**31), counted on the meta device (no memory)."""
    from dettrain.errors import UserError
    from dettrain.models.custom import CustomModelConfig

    if isinstance(mcfg, CustomModelConfig):  # its factory is the user's: not run twice to count
        return
    total = device_bytes(device)
    if total is None:
        return
    n = num_params(build_model(mcfg, 0, "meta"))
    if 4 * n > total:
        raise UserError(f"the model has {n:,} parameters ({4 * n / 2**30:,.1f} GiB in fp32), more than the "
                        f"{total / 2**30:,.1f} GiB of {device}; it is built whole before sharding: reduce "
                        f"model.vocab_size={mcfg.vocab_size}, model.dim={mcfg.dim}, model.n_layers={mcfg.n_layers} or "
                        f"model.ffn_dim={mcfg.ffn_dim}")
