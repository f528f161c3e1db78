"""What a config means on one device, decided in one place: ``resolve(cfg, device)``.

Six settings have an ``auto`` (or unset) value whose meaning depends on the device, the tier and each other:

    train.precision      auto -> bf16 autocast on CUDA, fp32 elsewhere
    train.compile        auto -> on for CUDA with Triton, off elsewhere (loop/compile.py, ``resolve_compile``)
    train.cuda_graphs    auto -> on when compiled on CUDA with an engine that keeps its parameters and gradients
                         in place on this many ranks (loop/compile.py, ``resolve_cuda_graphs``)
    train.overlap_steps  auto -> on for CUDA (``resolve_overlap_steps``)
    det.batch_invariant  unset -> on at tier 4 on CUDA when eager (determinism.py, ``resolve_batch_invariant``:
                         it follows the resolved train.compile)
    det.attention        auto -> dettrain's kernel at tier >= 2 on CUDA or with batch-invariant kernels on
                         (models/attention.py, ``resolve``: it follows the resolved det.batch_invariant)

``build_run`` (loop/build.py) calls it for the trainer and for the tools that build a run (memory, verify, trace),
and the settings audit (tools/audit.py) calls it, so that each sees the same choices a training run makes.  It
decides and nothing else: ``build_run`` makes the switches (batch-invariant kernels, the attention route) and
``Run.close()`` undoes them, since the run knows when it ends.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from dettrain.determinism import resolve_batch_invariant
from dettrain.errors import UserError
from dettrain.loop.compile import resolve_compile, resolve_cuda_graphs
from dettrain.models import attention
from dettrain.sync.engines import engine_class
from dettrain.tiers import policy

__all__ = ["Resolved", "resolve", "resolve_overlap_steps", "resolve_precision"]


def resolve_precision(setting: str, device: torch.device) -> str:
    """``train.precision`` on ``device``: bf16 or fp32 (auto: bf16 on CUDA, fp32 elsewhere)."""
    return setting if setting != "auto" else ("bf16" if device.type == "cuda" else "fp32")


@dataclass(frozen=True)
class Resolved:
    """The config's device-dependent choices for one run on one device."""

    precision: str
    """bf16 (autocast over fp32 parameters and optimizer state) or fp32."""
    compile: bool
    """Whether train.compile compiles (the per-module outcome is loop/compile.py's CompileReport)."""
    batch_invariant: bool
    """Whether dettrain's batch-invariant kernels run (kernels/batch_invariant.py)."""
    attention: attention.AttentionChoice
    """det.attention's choice (recorded in the ledger header as ``attention``)."""
    cuda_graphs: bool = False
    """Whether the compiled modules replay as CUDA graphs (train.cuda_graphs; loop/compile.py)."""
    overlap_steps: bool = False
    """Whether the next step's first micro-batch is queued before a step's line is read (train.overlap_steps)."""

    @property
    def mixed_precision(self) -> bool:
        """bf16 compute with fp32 master weights (and fp32 gradient reduction)."""
        return self.precision == "bf16"


def resolve(cfg, device: torch.device, world: int | None = None) -> Resolved:
    """The choices of ``cfg`` (a dettrain.config.Config) on ``device`` in a run of ``world`` ranks (None: the
    launcher's ``WORLD_SIZE``, else 1).  Raises UserError for a combination that cannot run (e.g.
    det.attention=torch with det.batch_invariant=true); no side effects."""
    if world is None:
        world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    compiled = resolve_compile(cfg.train.compile, device)
    # batch-invariant kernels by default only when eager: compiled, Inductor cannot fuse across them (slower)
    batch_invariant = resolve_batch_invariant(cfg.det, device, compiled)
    choice = attention.resolve(cfg.det.attention, device, deterministic_ops=policy(cfg.det.tier).deterministic_ops,
                               batch_invariant=batch_invariant, batch_invariant_asked=cfg.det.batch_invariant)
    precision = resolve_precision(cfg.train.precision, device)
    graphs = resolve_cuda_graphs(getattr(cfg.train, "cuda_graphs", "auto"), device, compiled, engine_class(cfg), cfg,
                                 world, precision == "bf16")
    return Resolved(precision=precision, compile=compiled,
                    batch_invariant=batch_invariant, attention=choice, cuda_graphs=graphs,
                    overlap_steps=resolve_overlap_steps(getattr(cfg.train, "overlap_steps", "auto"), device))


def resolve_overlap_steps(setting: bool | str, device: torch.device) -> bool:
    """``train.overlap_steps``: auto is on for CUDA (where kernels run asynchronously, so a queued micro-batch
    keeps the device busy while the host reads a step's line); true and false as given."""
    s = str(setting).lower()
    if s not in ("auto", "true", "false"):
        raise UserError(f"train.overlap_steps={setting!r} must be auto, true or false")
    return s == "true" or (s == "auto" and device.type == "cuda")
