"""torch.compile for training (``train.compile``): every transformer block, and the loss, compiled one by one.

    report = compile_model(model, cfg, device)     # once, right after build_model (build_run, loop/build.py)

Units.  The blocks ``fsdp.transformer_blocks`` finds (dettrain's LLaMA ``layers``, a Hugging Face decoder's
``model.layers``, ``hf.model.layers`` of dettrain.models.hf.HFCausalLM, any ``nn.ModuleList`` of identical blocks), the
whole model when it has none.  What is outside the blocks (embeddings, final norm, head) runs eagerly.

Why per block.  FSDP2 shards per block (fsdp.py) and all-gathers a block's parameters in hooks around its forward
and casts its inputs, in module hooks; DDP and the canonical reducer act on parameters (post-accumulate-grad hooks),
which run in autograd's engine after the compiled backward produced the gradient; activation checkpointing happens
inside ``Block.forward`` (models/llama.py), which Dynamo traces as a region the partitioner recomputes.  What is
compiled is each block's ``forward`` (``block.forward = torch.compile(block.forward)``), not its ``__call__``: module
hooks (FSDP2's, verify's fingerprint hooks, a user's) run eagerly around the graph, and with ``fullgraph=True`` none of
them can break it.  The module tree, parameter names and state dicts do not change (no ``_orig_mod.`` prefix, as
``torch.compile(module)`` would add), so checkpoints, fingerprints, per-tensor names and the reducer's flat layout
are the same with compile on or off.  The blocks are identical in code, so Dynamo traces
one and Inductor's cache serves the rest.

Determinism.  The promise of each tier holds compiled, with these choices:
  * ``fullgraph=True``: a graph break is found before the first step (the probe below): an error with
    ``train.compile=true``, a fallback with one warning line with ``auto``; never a silent slow path.
  * ``dynamic=False``: one static-shape graph per input shape.  A new shape recompiles a static graph instead of
    switching to a dynamic-shape kernel, whose reduction split may depend on the first shapes seen; so the same
    micro-batch shape gets the same kernels on every rank and any world size (tier 4).
  * the default mode: no ``max-autotune``, no coordinate-descent tuning (both pick kernels by timing them).
  * tiers >= 2: Inductor's deterministic mode (``determinism.apply_inductor``, called by ``apply_tier``): no
    benchmarking that changes numerics, only reduction configurations that give the same bits whichever is picked.
  * dettrain's Triton kernels (dettrain/kernels/) are torch custom ops: Dynamo records them as single nodes and
    Inductor calls them as they are, so a compiled step runs exactly the eager kernels for them.
Compiled and eager runs are *not* bitwise equal to each other: Inductor fuses elementwise chains (one rounding
instead of several, FMA contraction) and reduces in its own order.  The ledger header records the resolved setting
(``compile.enabled``) and ``dettrain.diff`` says so when two runs differ in it.

What Dynamo cannot trace (``probe_units``).  Dynamo compiles lazily, at a unit's first call, which is after the
ledger header is written; so before compiling, each distinct unit (one of each group of identical blocks) is traced
by Dynamo alone on the inputs it gets from one eager forward of a (micro_batch, seq_len) batch of zeros (under the
forward's autocast), captured by a forward pre-hook (the forward stops as soon as every unit has its inputs; the
RNG is forked, so no draw of the run moves).  The fullgraph trace runs on fake tensors and stops at the backend
(no Inductor work, no kernel runs): it costs one Dynamo trace per distinct unit, against the Dynamo trace plus
Inductor compile of every real compile.
``train.compile=true`` refuses a unit that does not trace as one graph (UserError: the module, Dynamo's reason,
the fix ``train.compile=auto|false``).  ``auto`` falls back for that group: a non-fullgraph compile where the
graph-breaking trace (run for real, on the probe inputs) still yields graphs, else eager, with one warning line
naming the modules and the reason.  The choice per unit (``fullgraph`` / ``graph breaks`` / ``eager``) is in the
ledger header (``compile.modules``, reasons in ``compile.fallback``).  It is a function of the code, the config
and torch's version, so every rank and every rerun makes the same one.  Failures past Dynamo (Inductor's code
generation) are not probed: they would be torch bugs, and surface at the first step.

``train.compile=auto`` is on for CUDA (with Triton) and off for CPU: on a CPU Inductor's C++ backend compiles for
tens of seconds (about 45 s cold for the tiny default model on 2 cores, a few seconds from its cache) and gains
little at these sizes (BENCHMARKS.md).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from dettrain.errors import UserError
from dettrain.kernels import HAVE_TRITON
from dettrain.kernels import batch_invariant as bi

log = logging.getLogger("dettrain")

COMPILE_OPTIONS = {"fullgraph": True, "dynamic": False}
"""Keyword arguments of every torch.compile call here but auto's fallback (see the module docstring for why)."""
FALLBACK_OPTIONS = {"fullgraph": False, "dynamic": False}
CUDA_GRAPHS = {"mode": "reduce-overhead"}
"""Added to both with train.cuda_graphs: Inductor records each compiled forward and backward as a CUDA graph (its
CUDA graph trees) and replays it; the same kernels on the same inputs, so the same bits, with one launch."""
"""train.compile=auto, for a unit with graph breaks: the traceable pieces compiled, the breaks run eagerly."""

FULLGRAPH, GRAPH_BREAKS, EAGER = "fullgraph", "graph breaks", "eager"
"""The choice per unit, as the ledger header records it."""


def resolve_compile(setting: bool | str, device: torch.device) -> bool:
    """Whether ``train.compile`` compiles on ``device``: true, false, or auto (CUDA with Triton: on; CPU: off)."""
    if isinstance(setting, bool):
        return setting
    s = str(setting).lower()
    if s in ("true", "false"):
        return s == "true"
    if s != "auto":
        raise UserError(f"train.compile={setting!r} must be auto, true or false")
    return device.type == "cuda" and HAVE_TRITON


def resolve_cuda_graphs(setting: bool | str, device: torch.device, compiled: bool, engine_cls, cfg=None,
                        world: int = 1, mixed_precision: bool = True) -> bool:
    """Whether ``train.cuda_graphs`` replays the compiled modules as CUDA graphs: auto is on when ``compiled`` on
    CUDA with an engine that keeps its parameters and gradients in place for this run (``Engine.graphs_blocker``
    of ``cfg`` on ``world`` ranks); true refuses (UserError) where that does not hold; false is off."""
    s = str(setting).lower()
    if s not in ("auto", "true", "false"):
        raise UserError(f"train.cuda_graphs={setting!r} must be auto, true or false")
    blocker = engine_cls.graphs_blocker(cfg, world, mixed_precision)
    possible = compiled and device.type == "cuda" and blocker is None
    if s == "true" and not possible:
        why = ("train.compile resolves to false (CUDA graphs replay compiled modules)" if not compiled else
               f"the device is {device.type}" if device.type != "cuda" else blocker)
        raise UserError(f"train.cuda_graphs=true: {why}; set train.cuda_graphs=auto or false")
    return possible and s != "false"


def check_supported(device: torch.device) -> None:
    """Refuse ``train.compile=true`` where torch.compile cannot run, with the reason and the fix."""
    if not torch._dynamo.is_dynamo_supported():
        raise UserError("train.compile=true: torch.compile is not supported on this Python/platform "
                        f"(torch {torch.__version__}); set train.compile=false")
    if device.type == "cuda" and not HAVE_TRITON:
        raise UserError("train.compile=true on CUDA needs Triton (Inductor generates Triton kernels); install "
                        "triton or set train.compile=false")
    if device.type == "cpu":
        cxx = _cpp_compiler()
        if cxx is None or shutil.which(cxx) is None:
            raise UserError(f"train.compile=true on CPU needs a C++ compiler for Inductor's CPU backend; "
                            f"{cxx or 'none'!r} was not found (install g++ or set CXX), or set train.compile=false")


def _cpp_compiler() -> str | None:
    """The C++ compiler Inductor will call: ``torch._inductor.config.cpp.cxx`` (its entries are tried in order;
    the last is ``$CXX`` or g++)."""
    import torch._inductor.config as inductor

    names = [c for c in getattr(inductor.cpp, "cxx", (None, os.environ.get("CXX", "g++"))) if c]
    for c in names:
        if shutil.which(c):
            return c
    return names[-1] if names else None


@dataclass
class CompileReport:
    """What ``compile_model`` did; ``header()`` goes into the ledger header (``compile``)."""

    setting: str
    """train.compile as configured (auto, true, false)."""
    enabled: bool
    """The resolved value: whether compiling was on (each unit's outcome is in ``modules``)."""
    units: list[str] = field(default_factory=list)
    """Names of the compiled modules (``layers.0`` ...; ``<model>`` when the model has no block list)."""
    loss: bool = False
    """Whether the loss (cross-entropy) is compiled."""
    modules: dict[str, str] = field(default_factory=dict)
    """Every unit's choice: ``fullgraph``, ``graph breaks`` (auto's non-fullgraph fallback) or ``eager``."""
    fallback: dict[str, str] = field(default_factory=dict)
    """Why a unit is not compiled as one graph (Dynamo's reason), for the units that fell back."""
    cuda_graphs: bool = False
    """Whether the compiled modules and the loss replay as CUDA graphs (train.cuda_graphs resolved)."""

    def header(self) -> dict:
        from dettrain.determinism import inductor_flags

        return {"setting": self.setting, "enabled": self.enabled, "units": len(self.units), "loss": self.loss,
                "modules": dict(self.modules), "fallback": dict(self.fallback),
                "options": dict(COMPILE_OPTIONS), "cuda_graphs": self.cuda_graphs,
                "inductor": inductor_flags() if self.enabled else {}}


def compile_module(module: nn.Module, options: dict | None = None) -> None:
    """Compile ``module.forward`` in place (an instance attribute; hooks and ``__call__`` stay eager)."""
    if getattr(module, "_dettrain_compiled", False):
        return
    module.forward = torch.compile(module.forward, **(options or COMPILE_OPTIONS))
    module._dettrain_compiled = True


# ---- probing what Dynamo can trace -----------------------------------------------------------------------------
@dataclass
class Probe:
    """The outcome of tracing one unit: ``choice`` and, unless it traced as one graph, Dynamo's ``reason``."""

    choice: str
    reason: str = ""


class _Traced(Exception):
    """Raised by the probe's backend once Dynamo handed it the whole graph: the trace succeeded, nothing runs."""


class _Captured(Exception):
    """Raised by the capture hooks once every unit has its inputs: the rest of the probe forward is not needed."""


def _stop_at_backend(gm, example_inputs):  # noqa: ARG001 - a torch.compile backend's signature
    raise _Traced


def _fresh_caller(fn: Callable) -> Callable:
    """``fn`` behind a function with a code object of its own: Dynamo caches per code object, so a probe neither
    leaves an entry on the unit's own ``forward`` nor shares (and exhausts) a recompile limit with other probes."""

    def call(*args, **kwargs):
        return fn(*args, **kwargs)

    call.__code__ = call.__code__.replace()
    return call


def dynamo_reason(e: BaseException) -> str:
    """One line from a Dynamo exception: its first line, and the user's file:line it points at when it says."""
    if isinstance(e, torch._dynamo.exc.BackendCompilerFailed) and e.inner_exception is not None:
        e = e.inner_exception
    text = str(e).strip()
    first = text.splitlines()[0].strip() if text else ""
    where = re.findall(r'File "([^"]+)", line (\d+)', text.split("from user code:", 1)[-1]) \
        if "from user code:" in text else []
    at = f" at {os.path.basename(where[-1][0])}:{where[-1][1]}" if where else ""
    return f"{type(e).__name__}: {first}{at}"


def trace_unit(fn: Callable, args: tuple, kwargs: dict, *, fallback: bool) -> Probe:
    """Trace ``fn(*args, **kwargs)`` with Dynamo: one graph (``fullgraph``); else, with ``fallback``, with graph
    breaks (run for real: the pieces between breaks execute), ``graph breaks`` when any graph came out."""
    try:
        torch.compile(_fresh_caller(fn), backend=_stop_at_backend, **COMPILE_OPTIONS)(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - Dynamo raises many types: each is a reason not to compile this way
        inner = getattr(e, "inner_exception", None)
        if isinstance(e, _Traced) or isinstance(inner, _Traced):
            return Probe(FULLGRAPH)
        reason = dynamo_reason(e)
    else:  # the backend was never called: nothing to compile (a forward without tensor ops)
        reason = "Dynamo produced no graph"
    if not fallback:
        return Probe(EAGER, reason)
    graphs = []

    def count(gm, example_inputs):  # noqa: ARG001
        graphs.append(gm)
        return gm.forward

    try:
        torch.compile(_fresh_caller(fn), backend=count, **FALLBACK_OPTIONS)(*args, **kwargs)
    except Exception as e:  # noqa: BLE001
        return Probe(EAGER, f"{reason}; with graph breaks: {dynamo_reason(e)}")
    return Probe(GRAPH_BREAKS if graphs else EAGER, reason)


def _detached(x: Any) -> Any:
    """A captured input without its autograd history (its requires_grad kept), so the probe holds no graph."""
    if torch.is_tensor(x):
        return x.detach().requires_grad_(x.requires_grad) if x.is_floating_point() or x.is_complex() else x.detach()
    if isinstance(x, (list, tuple)):
        return type(x)(_detached(v) for v in x) if not hasattr(x, "_fields") else type(x)(*map(_detached, x))
    if isinstance(x, dict):
        return {k: _detached(v) for k, v in x.items()}
    return x


def capture_inputs(model: nn.Module, units: list[nn.Module], tokens: torch.Tensor) -> dict[int, tuple]:
    """The (args, kwargs) each of ``units`` is called with in one eager forward of ``tokens``, keyed by id."""
    got: dict[int, tuple] = {}
    if units == [model]:
        return {id(model): ((tokens,), {})}

    def hook(mod, args, kwargs):
        got.setdefault(id(mod), (_detached(args), _detached(kwargs)))
        if len(got) == len(units):
            raise _Captured

    handles = [u.register_forward_pre_hook(hook, with_kwargs=True) for u in units]
    devices = [tokens.device.index or 0] if tokens.device.type == "cuda" else []
    try:  # forked RNG: a dropout before the first block draws nothing from the run's streams
        with torch.random.fork_rng(devices=devices), contextlib.suppress(_Captured):
            model(tokens)
    finally:
        for h in handles:
            h.remove()
    return got


def probe_units(model: nn.Module, units: list[nn.Module], tokens: torch.Tensor, *, fallback: bool) -> list[Probe]:
    """Trace one unit of each group of identical ones (``fsdp.block_signature``) and give its outcome to all."""
    from dettrain.sync.fsdp import block_signature

    groups: dict[tuple, list[int]] = {}
    for i, u in enumerate(units):
        groups.setdefault(block_signature(u) if u is not model else ("<model>",), []).append(i)
    firsts = [units[ix[0]] for ix in groups.values()]
    inputs = capture_inputs(model, firsts, tokens)
    out: list[Probe] = [Probe(EAGER)] * len(units)
    for ix in groups.values():
        first = units[ix[0]]
        if id(first) in inputs:
            args, kwargs = inputs[id(first)]
            probe = trace_unit(first.forward, args, kwargs, fallback=fallback)
        else:
            probe = Probe(EAGER, "not called by the model's forward on the probe batch")
        for i in ix:
            out[i] = probe
    return out


def _span(names: list[str]) -> str:
    names = ["the model" if n == "<model>" else n for n in names]
    return ", ".join(names) if len(names) <= 3 else f"{', '.join(names[:2])} ... {names[-1]} ({len(names)} modules)"


def compile_units(model: nn.Module, tokens: torch.Tensor, *, strict: bool, cuda_graphs: bool = False,
                  autocast: contextlib.AbstractContextManager | None = None) -> CompileReport:
    """Probe, then compile, the units of ``model`` in place; ``strict`` (train.compile=true) refuses a unit that
    does not trace as one graph, otherwise (auto) it falls back with one warning line per group of units.
    ``autocast``: the context the training forward runs in (bf16 autocast), so the probe traces what will run."""
    from dettrain.sync.fsdp import transformer_blocks

    units = transformer_blocks(model) or [model]  # a model without a block list (model=custom) is compiled whole
    names = {id(m): n for n, m in model.named_modules()}
    label = [names.get(id(u)) or "<model>" for u in units]
    with autocast if autocast is not None else contextlib.nullcontext():
        probes = probe_units(model, units, tokens, fallback=not strict)
    report = CompileReport(setting="true" if strict else "auto", enabled=True)
    warned: dict[str, list[str]] = {}
    for unit, name, probe in zip(units, label, probes):
        if probe.choice != FULLGRAPH and strict:
            raise UserError(f"train.compile=true: Dynamo cannot trace {_span([name])} ({type(unit).__name__}) as "
                            f"one graph ({probe.reason}); set train.compile=auto (compiles what traces, runs the rest "
                            "eagerly) or train.compile=false")
        report.modules[name] = probe.choice
        if probe.choice != FULLGRAPH:
            report.fallback[name] = probe.reason
            warned.setdefault(f"{probe.choice}|{type(unit).__name__}|{probe.reason}", []).append(name)
        if probe.choice == EAGER:
            continue
        options = COMPILE_OPTIONS if probe.choice == FULLGRAPH else FALLBACK_OPTIONS
        compile_module(unit, {**options, **CUDA_GRAPHS} if cuda_graphs else options)
        report.units.append(name)
    for key, group in warned.items():
        choice, cls, reason = key.split("|", 2)
        how = "runs eagerly" if choice == EAGER else "is compiled with graph breaks (the breaks run eagerly)"
        log.warning(f"train.compile=auto: {_span(group)} ({cls}) {how}: Dynamo cannot trace it as one graph "
                    f"({reason})")
    return report


def compile_model(model: nn.Module, cfg, device: torch.device, *, enabled: bool | None = None,
                  autocast: contextlib.AbstractContextManager | None = None,
                  cuda_graphs: bool = False) -> CompileReport:
    """Compile ``model``'s transformer blocks (and the loss) in place as ``cfg.train.compile`` says.

    ``enabled`` overrides where the setting resolves to (None: ``resolve_compile``): True runs ``auto``'s fallback
    on a CPU too, which is how the tests exercise it (auto is off there).  ``autocast``: the context of the
    training forward (Trainer.autocast), under which the units are probed.

    Call once, after the model is built and before it is wrapped (DDP) or sharded (``fully_shard`` keeps the
    compiled forward: it adds hooks around it).  With compile off it still resets the loss to eager, so several
    trainers built in one process (benchmarks) do not inherit each other's setting.  The units are probed first
    (``probe_units``) on a batch of zeros of the training shape (micro_batch, seq_len).  ``cuda_graphs``
    (train.cuda_graphs resolved, ``resolve_cuda_graphs``): the units and the loss replay as CUDA graphs; the caller
    marks each micro-batch's start (``torch.compiler.cudagraph_mark_step_begin``) and copies out what it keeps."""
    setting = cfg.train.compile
    enabled = resolve_compile(setting, device) if enabled is None else enabled
    bi.set_loss_fn(None)
    if not enabled:
        return CompileReport(setting=str(setting).lower(), enabled=False)
    check_supported(device)
    strict = str(setting).lower() == "true"
    tokens = torch.zeros(cfg.train.micro_batch, cfg.model.seq_len, dtype=torch.long, device=device)
    report = compile_units(model, tokens, strict=strict, autocast=autocast, cuda_graphs=cuda_graphs)
    report.setting = str(setting).lower()
    report.cuda_graphs = cuda_graphs
    # the loss: fuses the fp32 upcast of the logits into log-softmax (eager materialises an fp32 copy of them)
    bi.set_loss_fn(torch.compile(bi.eager_cross_entropy,
                                 **({**COMPILE_OPTIONS, **CUDA_GRAPHS} if cuda_graphs else COMPILE_OPTIONS)))
    report.loss = True
    log.info(f"train.compile: {len(report.units)} module(s) compiled one by one ({', '.join(report.units[:3])}"
             f"{' ...' if len(report.units) > 3 else ''}) and the loss; options {COMPILE_OPTIONS}"
             + (", replayed as CUDA graphs (train.cuda_graphs)" if cuda_graphs else ""))
    return report
