"""Gradient-sync engines: one interface (base.py), a registry of implementations (``dist.engine``), one per file.

The training step (loop/trainer.py) reads ``begin_step -> backward per micro-batch -> reduce -> clip_ -> step``
and never asks which engine it drives; checkpoints, export and the memory planner ask the engine too (base.py):

    ddp    ddp.py    torch DistributedDataParallel + torch AdamW (tiers 0-2: the baseline users know)
    flat   flat.py   dettrain's canonical reducer over one flat fp32 buffer (collectives.py) + FlatAdamW; optional
                     ZeRO-1
    fsdp2  fsdp2.py  torch FSDP2 (``fully_shard`` per block, ZeRO-3); at tiers 3-4 its reduce-scatter is replaced
                     by ``CanonicalReduceScatter`` (all_to_all, then a fixed-order sum written here), so NCCL/Gloo
                     never sum

``auto`` is the tier policy's ``default_engine``: ddp below tier 3 and flat from tier 3 on.  ``dist.engine`` may
also name an Engine subclass by import path (``package.module:Class``); docs/engines.md shows one.

Everything that feeds the update is canonical from tier 3 on and defined the same way in the flat and FSDP2
engines, so at tier 4 both give the same bits on any power-of-two world size:

- the step gradient is one balanced binary tree over the global micro-batch indices 0..M-1 (flat: each rank an
  aligned block, a binary counter inside it, ``tree_sum_rows`` over ranks; FSDP2: micro-batches dealt round-robin,
  round k = global indices kW..kW+W-1 summed over ranks by the reduce-scatter, a binary counter over rounds);
- the gradient norm (``exact_sumsq``): every square rounded once to a fixed point set by the global max, summed as
  integers, which is exact and so independent of sharding, bucketing, engine and world size;
- the optimizer: ``kernels.optim.adamw_``, elementwise, the same bits whichever slice an element is updated in;
  ``optim.no_decay`` picks whole parameters (by name) that are updated with weight decay 0, in every engine.

Fingerprints of parameters, gradients and optimizer state use the global element indices of the canonical flat
layout (collectives.FlatLayout at world 1) in every engine, so ``param``/``grad``/``opt`` agree across engines.
"""

from __future__ import annotations

from torch import nn

from dettrain import dist as D
from dettrain.errors import UserError
from dettrain.sync.collectives import exact_sumsq
from dettrain.sync.engines.base import OPTIM, Engine, GradProbe, Partials, lookup, register, registered

# the built-in engines register themselves on import, in this order (the order error messages list them in)
from dettrain.sync.engines.ddp import DDPEngine
from dettrain.sync.engines.flat import FlatEngine
from dettrain.sync.engines.fsdp2 import CanonicalReduceScatter, FSDP2Engine, use_canonical_reduce_scatter
from dettrain.tiers import policy

ENGINES = ("auto", *registered())
"""The ``dist.engine`` names built in (an import path may name another engine)."""

__all__ = ["ENGINES", "OPTIM", "CanonicalReduceScatter", "DDPEngine", "Engine", "FSDP2Engine", "FlatEngine",
           "GradProbe", "Partials", "check_engine", "engine_class", "engine_from_config", "exact_sumsq", "lookup",
           "register", "registered", "resolve_engine", "saved_by", "use_canonical_reduce_scatter"]


def resolve_engine(name: str, tier: int) -> str:
    """The registered name of the engine ``dist.engine`` names at ``tier``; UserError for a name that is neither
    registered nor importable, or a combination that cannot keep the tier."""
    pol = policy(tier)
    cls = lookup(pol.default_engine if name == "auto" else name)
    why = cls.cannot_keep(pol)
    if why:
        raise UserError(f"dist.engine={cls.name} cannot keep det.tier={tier}: {why}")
    return cls.name


def check_engine(cfg) -> str:
    """Start-up validation of ``dist.*`` engine keys against the tier and this torch; returns the engine's name."""
    name = resolve_engine(cfg.dist.engine, cfg.det.tier)
    lookup(name).check(cfg)
    return name


def engine_class(cfg) -> type[Engine]:
    """The class of the engine ``cfg`` runs, checked (``check_engine``)."""
    return lookup(check_engine(cfg))


def saved_by(kind: str) -> type[Engine]:
    """The registered engine whose checkpoints have ``optim.kind`` ``kind``; ``Engine`` itself (the reading every
    built-in engine shares: one tensor per name) when none in this process has it."""
    return next((c for c in registered().values() if c.state_kind == kind), Engine)


def engine_from_config(cfg, model: nn.Module, info: D.DistInfo, *, mixed_precision: bool) -> Engine:
    """The engine of ``cfg`` around ``model`` (checked first)."""
    return engine_class(cfg).from_config(cfg, model, info, mixed_precision=mixed_precision)
