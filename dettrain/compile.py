"""torch.compile for training (``train.compile``): every transformer block, and the loss, compiled one by one.

    report = compile_model(model, cfg, device)     # once, right after build_model (Trainer.__init__)

Why per block.  FSDP2 shards per block (fsdp.py) and all-gathers a block's parameters in hooks around its forward
and casts its inputs, in module hooks; DDP and the canonical reducer act on parameters (post-accumulate-grad hooks),
which run in autograd's engine after the compiled backward produced the gradient; activation checkpointing happens
inside ``Block.forward`` (model.py), which Dynamo traces as a region the partitioner recomputes.  What is compiled
is each block's ``forward`` (``block.forward = torch.compile(block.forward)``), not its ``__call__``: module hooks
(FSDP2's, verify's fingerprint hooks, a user's) run eagerly around the graph, and with ``fullgraph=True`` none of
them can break it.  The module tree, parameter names and state dicts do not change (no ``_orig_mod.`` prefix, as
``torch.compile(module)`` would add), so checkpoints, fingerprints, per-tensor names and the reducer's flat layout
are the same with compile on or off.  The blocks are identical in code, so Dynamo traces
one and Inductor's cache serves the rest.

Determinism.  The promise of each tier holds compiled, with these choices:
  * ``fullgraph=True``: a graph break is an error at the first step, never a silent slow path with eager pieces.
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

``train.compile=auto`` is on for CUDA (with Triton) and off for CPU: on a CPU Inductor's C++ backend compiles for
tens of seconds (about 45 s cold for the tiny default model on 2 cores, a few seconds from its cache) and gains
little at these sizes (BENCHMARKS.md).
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass, field

import torch
from torch import nn

from dettrain.errors import UserError
from dettrain.kernels import HAVE_TRITON
from dettrain.kernels import batch_invariant as bi

log = logging.getLogger("dettrain")

COMPILE_OPTIONS = {"fullgraph": True, "dynamic": False}
"""Keyword arguments of every torch.compile call here (see the module docstring for why)."""


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
    """The resolved value: whether anything was compiled."""
    units: list[str] = field(default_factory=list)
    """Names of the compiled modules (``layers.0`` ...; ``<model>`` when the model has no block list)."""
    loss: bool = False
    """Whether the loss (cross-entropy) is compiled."""

    def header(self) -> dict:
        from dettrain.determinism import inductor_flags

        return {"setting": self.setting, "enabled": self.enabled, "units": len(self.units), "loss": self.loss,
                "options": dict(COMPILE_OPTIONS), "inductor": inductor_flags() if self.enabled else {}}


def compile_module(module: nn.Module) -> None:
    """Compile ``module.forward`` in place (an instance attribute; hooks and ``__call__`` stay eager)."""
    if getattr(module, "_dettrain_compiled", False):
        return
    module.forward = torch.compile(module.forward, **COMPILE_OPTIONS)
    module._dettrain_compiled = True


def compile_model(model: nn.Module, cfg, device: torch.device) -> CompileReport:
    """Compile ``model``'s transformer blocks (and the loss) in place as ``cfg.train.compile`` says.

    Call once, after the model is built and before it is wrapped (DDP) or sharded (``fully_shard`` keeps the
    compiled forward: it adds hooks around it).  With compile off it still resets the loss to eager, so several
    trainers built in one process (benchmarks) do not inherit each other's setting."""
    from dettrain.fsdp import transformer_blocks

    setting = cfg.train.compile
    enabled = resolve_compile(setting, device)
    report = CompileReport(setting=str(setting).lower(), enabled=enabled)
    bi.set_loss_fn(None)
    if not enabled:
        return report
    check_supported(device)
    blocks = transformer_blocks(model)
    names = {id(m): n for n, m in model.named_modules()}
    for block in blocks or [model]:  # a model without a block list (model=custom) is compiled whole
        compile_module(block)
        report.units.append(names.get(id(block)) or "<model>")
    # the loss: fuses the fp32 upcast of the logits into log-softmax (eager materialises an fp32 copy of them)
    bi.set_loss_fn(torch.compile(bi.eager_cross_entropy, **COMPILE_OPTIONS))
    report.loss = True
    log.info(f"train.compile: {len(report.units)} module(s) compiled one by one ({', '.join(report.units[:3])}"
             f"{' ...' if len(report.units) > 3 else ''}) and the loss; options {COMPILE_OPTIONS}")
    return report
