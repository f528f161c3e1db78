"""The engine interface and registry: ``Engine``, its fingerprint ``Partials``, ``register`` and ``engine_class``.

An engine owns gradient sync, the optimizer and their state; the trainer (loop/trainer.py), the checkpoint
package (checkpoint/state.py), export (tools/export.py) and the memory planner (tools/memory.py) talk to it only
through this interface and never ask which engine they hold.  The step:

    begin_step(M) -> for each micro-batch k: with micro(k): forward_module(x) ... backward(loss, k)
                  -> reduce(1/M) (the gradient norm) -> clip_(max_norm, norm) -> step(lr)

The checkpoint, in DCP's ``Stateful`` sense (torch.distributed.checkpoint.stateful): ``state_dict()`` is what is
saved (tensors by name, plus the JSON-able optimizer scalars under ``OPTIM``); a load is ``load_plan`` on rank 0
(the checkpoint's DCP metadata checked against this engine), ``load_target`` on every rank (what DCP reads into, in
place), DCP's read, then ``load_state_dict`` (step counts, copies).  ``saved_params`` is export's read of the
parameters without building an engine.

The registry maps ``dist.engine`` names to classes, each built by one ``from_config(cfg, model, info, *,
mixed_precision)``; ``@register`` adds one.  ``dist.engine`` may also name a class by import path
(``package.module:Class``), which is imported and registered at start-up: a new engine is one class in one file
(docs/engines.md).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dettrain import dist as D
from dettrain.errors import UserError
from dettrain.record.fingerprint import Deferred, combine, fingerprint_many_deferred, resolve_all
from dettrain.sync.collectives import FlatLayout
from dettrain.sync.optim import OptimConfig, decays, unmatched_no_decay
from dettrain.tiers import TierPolicy, policy

log = logging.getLogger("dettrain")
OPTIM = "optim"
"""The key of ``Engine.state_dict()`` that holds the optimizer scalars (dettrain.json's ``optim``), not tensors."""


@dataclass
class Partials:
    """This rank's integer fingerprint partials: ``totals[key]`` and, if asked, ``tensors[key][name]``.

    ``pending`` holds values still being computed on the device, each with the (key, tensor name) it adds to;
    ``resolve`` folds them in (one device-to-host copy for all), and ``combine_over_ranks`` calls it."""

    totals: dict[str, int]
    tensors: dict[str, dict[str, int]]
    pending: list[tuple[Deferred, list[tuple[str, str | None]]]] = field(default_factory=list)

    def merged(self, other: Partials) -> Partials:
        """Both sets of partials (disjoint keys) in one, still unresolved."""
        return Partials({**self.totals, **other.totals}, {**self.tensors, **other.tensors},
                        self.pending + other.pending)

    def resolve(self) -> Partials:
        if self.pending:
            for (_, labels), vals in zip(self.pending, resolve_all([d for d, _ in self.pending])):
                for (key, name), v in zip(labels, vals):
                    self.totals[key] = combine([self.totals.get(key, 0), v])
                    if name is not None:  # a per-tensor value too
                        self.tensors[key][name] = combine([self.tensors[key].get(name, 0), v])
            self.pending = []
        return self


class Engine:
    """Gradient sync + optimizer behind one interface (see the module docstring).

    A subclass sets ``name`` (the ``dist.engine`` value), registers itself with ``@register`` and implements the
    step (``backward``, ``reduce``, ``grad_parts``, ``step``), the fingerprint ``partials`` and its checkpoint
    (``state_dict`` / ``load_plan`` / ``load_target`` / ``load_state_dict``); ``from_config`` builds it."""

    name = "base"
    state_kind = "base"
    """``optim.kind`` in a checkpoint's dettrain.json: the layout of the saved state (one kind, one loader)."""
    assignment = "block"  # how the sampler deals a step's micro-batches to ranks: "block" or "round_robin"
    canonical_bits = False
    """At a world-invariant tier this engine computes the canonical bits (one tree over global micro-batch
    indices, ``exact_sumsq``, ``adamw_``), so its ledger equals every other such engine's."""
    shards_optimizer = False
    """Whether ``dist.shard_optimizer`` applies: the engine shards its optimizer state on request (ZeRO-1)."""
    offloads_partials = False
    """Whether ``dist.offload_partials`` applies (at tier 4): the engine can keep its tree's partial sums in host
    memory."""
    cuda_graphs = False
    """Whether ``train.cuda_graphs`` may replay the compiled modules: the parameters keep their addresses between
    calls and every backward accumulates into gradients that exist before it (autograd never hands a graph's output
    memory to ``.grad``, which the next replay would overwrite)."""

    @classmethod
    def graphs_blocker(cls, cfg, world: int, mixed_precision: bool) -> str | None:
        """Why ``train.cuda_graphs`` cannot replay the compiled modules under this engine in a run of ``cfg`` on
        ``world`` ranks (``mixed_precision``: train.precision resolves to bf16), or None where it can: the class's
        ``cuda_graphs`` flag unless an engine knows better per run (the FSDP2 engine: on one rank only)."""
        if cls.cuda_graphs:
            return None
        return f"dist.engine resolves to {cls.name}, whose parameters or gradients move between calls"

    def __init__(self, model: nn.Module, info: D.DistInfo, tier: int, optim: OptimConfig, *,
                 mixed_precision: bool = False) -> None:
        self.model, self.info, self.tier, self.optim_cfg = model, info, tier, optim
        self.mixed_precision = mixed_precision
        self.policy = policy(tier)
        self.layout = FlatLayout(model, 1, 25.0)  # world-independent offsets: the fingerprints' index space
        self.offsets = {n: o for n, _, o, _ in self.layout.entries}
        self.step_count = 0
        # optim.no_decay: the parameters updated with weight decay 0 (the same names in every engine)
        self.no_decay = {n for n, _, _, _ in self.layout.entries if not decays(n, optim)}
        missing = unmatched_no_decay([n for n, _, _, _ in self.layout.entries], optim)
        if missing and info.is_main:
            log.warning(f"optim.no_decay: {missing} match no parameter of this model (names look like "
                        f"{self.layout.entries[-1][0]!r}); they change nothing")
        if self.no_decay and info.is_main:
            log.info(f"optim.no_decay: {len(self.no_decay)} of {len(self.layout.entries)} parameters without "
                     "weight decay")

    # model.allow_unused: trainable parameters that received no gradient at the first step, left out of the update
    frozen: frozenset[str] = frozenset()

    def probe_grads(self) -> GradProbe:
        """Watch which trainable parameters receive a gradient until ``GradProbe.unused`` (one step's backward)."""
        return GradProbe([(n, p) for n, p in self.model.named_parameters() if p.requires_grad], self.info)

    def freeze(self, names: list[str]) -> None:
        """model.allow_unused: leave these parameters out of the update from now on (no step, no weight decay);
        their moments stay zero and their values as initialised (or as the checkpoint holds them)."""
        self.frozen = frozenset(names)

    def weight_decay(self, name: str) -> float:
        """The weight decay of parameter ``name``: optim.weight_decay, or 0 when optim.no_decay names it."""
        return 0.0 if name in self.no_decay else self.optim_cfg.weight_decay

    # forward runs on this module (the DDP wrapper, or the model itself)
    @property
    def forward_module(self) -> nn.Module:
        return self.model

    def begin_step(self, n_micro: int) -> None:
        self.n_micro = n_micro

    def micro(self, k: int) -> contextlib.AbstractContextManager:
        """Context around micro-batch k's forward and backward."""
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor, k: int) -> None:
        raise NotImplementedError

    def reduce(self, scale: float) -> float | torch.Tensor:
        """Finish the gradient sync (the step gradient is the sum times ``scale`` = 1/M); returns its L2 norm: a
        float, or a 0-dim tensor on the device (the built-in canonical engines), which keeps the step free of host
        syncs until its ledger line reads it (``float(norm)``)."""
        raise NotImplementedError

    def clip_(self, max_norm: float, norm: float | torch.Tensor) -> None:
        """Scale the reduced gradient by max_norm / (norm + 1e-6) when that is below 1 (max_norm 0: no clipping).

        A float norm decides on the host; a tensor norm on the device, without a sync: the coefficient (fp64, as
        the host computes it) or 1 where it is not below 1, cast to fp32, multiplies every part.  Multiplying by
        1 changes no bit, and an fp32 tensor times a Python float multiplies by the float's fp32 value, so both
        give the same bits."""
        if max_norm <= 0:
            return
        if isinstance(norm, torch.Tensor):
            coef = max_norm / (norm.double() + 1e-6)
            factor = torch.where(coef < 1.0, coef, 1.0).float()
            parts = self.grad_parts()
            fp32 = [g for g in parts if g.dtype == torch.float32]
            if fp32:
                torch._foreach_mul_(fp32, factor)
            for g in parts:
                if g.dtype != torch.float32:  # as torch multiplies a 16-bit tensor by a float: in fp32, rounded once
                    g.copy_(g.float() * factor)
            return
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            for g in self.grad_parts():
                g.mul_(coef)

    def step(self, lr: float) -> None:
        raise NotImplementedError

    def grad_parts(self) -> list[torch.Tensor]:
        """The reduced-gradient tensors this rank holds (what clipping scales)."""
        raise NotImplementedError

    def partials(self, keys: tuple[str, ...], per_tensor: bool) -> Partials:
        """Integer fingerprint partials of ``keys`` (grad, param, opt) over what this rank hashes."""
        raise NotImplementedError

    # ---- building and checking, from the config ----------------------------------------------------------------
    @classmethod
    def from_config(cls, cfg, model: nn.Module, info: D.DistInfo, *, mixed_precision: bool) -> Engine:
        """This engine around ``model`` for the run ``cfg`` (already checked by ``check``); ``mixed_precision``:
        bf16 compute with fp32 master weights (train.precision resolved for this device)."""
        raise NotImplementedError

    @classmethod
    def cannot_keep(cls, pol: TierPolicy) -> str | None:
        """Why this engine cannot keep tier ``pol`` (None: it can); the refusal names dist.engine and det.tier."""
        return None

    @classmethod
    def check(cls, cfg) -> None:
        """Start-up validation of the ``dist.*`` keys this engine reads (UserError naming the key and the fix)."""
        if cfg.dist.shard_optimizer and not cls.shards_optimizer:
            raise UserError(f"dist.shard_optimizer=true shards the flat engine's optimizer (ZeRO-1); dist.engine "
                            f"resolves to {cls.name} here: use dist.engine=flat (tier >= 3), or dist.engine=fsdp2, "
                            "which shards parameters, gradients and optimizer state anyway")
        if getattr(cfg.dist, "offload_partials", False):
            if not cls.offloads_partials:
                raise UserError(f"dist.offload_partials=true keeps tier 4's partial sums in host memory (the flat and "
                                f"fsdp2 engines); dist.engine resolves to {cls.name} here: use dist.engine=flat or "
                                "dist.engine=fsdp2 with det.tier=4, or dist.offload_partials=false")
            if not policy(cfg.det.tier).world_invariant:
                raise UserError(f"dist.offload_partials=true: det.tier={cfg.det.tier} sums micro-batches in one "
                                "buffer and holds no partial sums to offload; it applies at det.tier=4 only. Set "
                                "dist.offload_partials=false")

    @classmethod
    def autocast(cls, device: torch.device, mixed_precision: bool) -> contextlib.AbstractContextManager:
        """The context the forward runs in: torch.autocast to bf16 when mixed (the engine keeps fp32 master
        weights and reduces in fp32), else nothing.  A classmethod: the trainer compiles the model under it
        before the engine wraps (or shards) it."""
        if mixed_precision:
            return torch.autocast(device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    # ---- checkpoints: DCP's Stateful protocol, plus the two steps a resharding load needs ------------------------
    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint saves: DCP tensors by name (``model/<name>``, ``optim/<name>/<moment>``; ``Chunks``
        for boxes of a flat buffer, checkpoint/chunks.py) and, under ``OPTIM``, the JSON-able optimizer scalars
        (dettrain.json's ``optim``: ``{"kind": state_kind, ...}``)."""
        raise NotImplementedError

    def load_plan(self, md, path: Path) -> Any:
        """Rank 0, before a load: check the checkpoint's DCP metadata ``md`` against this engine (CheckpointError
        naming ``path`` and what differs) and return what ``load_target`` needs (picklable: broadcast to every
        rank).  Default: nothing; DCP's load checks the shapes of the tensors ``load_target`` asks for."""
        return None

    def load_target(self, plan: Any) -> tuple[dict[str, Any], Any]:
        """Every rank: (the state dict DCP loads into, in place; a DCP load planner or None).  Default: this
        engine's own tensors (``state_dict()`` without ``OPTIM``), as DCP's Stateful load does."""
        sd = self.state_dict()
        sd.pop(OPTIM)
        return sd, None

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """After DCP has read ``load_target``'s tensors: ``state_dict`` is them plus ``OPTIM`` (the saved
        optimizer scalars); finish the load (step counts, copies, gathers).  CorruptCheckpoint for state that does
        not fit (the caller prefixes the checkpoint's path)."""
        raise NotImplementedError

    def refuse_checkpoint_of(self, kind: str) -> str | None:
        """None when this engine loads checkpoints of ``state_kind`` ``kind``; else why not, as the rest of the
        sentence "checkpoint PATH ..." (it names the engine that saved it and how to resume)."""
        if kind == self.state_kind:
            return None
        saved_cls = next((c for c in _REGISTRY.values() if c.state_kind == kind), None)
        saved = saved_cls.name if saved_cls is not None else kind
        same_bits = (saved_cls is not None and saved_cls.canonical_bits and self.canonical_bits
                     and self.policy.world_invariant)
        pair = " and ".join(sorted({saved, self.name}))
        why = (f" (at tier {self.tier} the {pair} engines compute the same bits, so the ledger continues unchanged)"
               if same_bits else "")
        return (f"was saved by the {saved} engine and this run uses dist.engine={self.name}; their checkpoints "
                "have different layouts and ckpt.allow_config_change cannot convert one into the other. Resume "
                f"with dist.engine={saved}{why}, or start afresh in another run_dir=... (or here with "
                "ckpt.resume=none ckpt.overwrite=true)")

    @classmethod
    def saved_params(cls, md, path: Path, entries) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """What export reads of a checkpoint this engine saved, without building the engine: (the DCP state dict
        to load, {parameter name: tensor filled by that load}), for ``entries`` (name, parameter, offset, numel)
        of the canonical layout of the checkpoint's model (built on "meta").  Default: ``model/<name>``, one fp32
        tensor of the parameter's shape per name, as every built-in engine saves."""
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        from dettrain.checkpoint.errors import CheckpointError

        sd, params = {}, {}
        for name, p, _, _ in entries:
            key = f"model/{name}"
            tmd = md.state_dict_metadata.get(key)
            if not isinstance(tmd, TensorStorageMetadata) or tuple(tmd.size) != tuple(p.shape):
                raise CheckpointError(f"checkpoint {path}: parameter {name} is missing or has another shape "
                                      "than in the model of its own config")
            sd[key] = params[name] = torch.empty(p.shape, dtype=torch.float32)
        return sd, params

    def close(self) -> None:
        pass


class GradProbe:
    """Which trainable parameters receive a gradient during one step's backward, agreed over ranks.

    A post-accumulate-grad hook on each parameter the engine updates: the model's own parameters under DDP and the
    flat engine (whose hooks move gradients into the flat buffer from the same tensors), the sharded DTensors under
    FSDP2, which calls these hooks itself when it assigns a reduced shard.  Cheap: one flag per parameter and
    backward, for the one step it is installed; ``unused`` removes the hooks."""

    def __init__(self, named: list[tuple[str, torch.Tensor]], info: D.DistInfo) -> None:
        self.names = [n for n, _ in named]
        self.info = info
        self.seen = [False] * len(named)
        self.handles = [p.register_post_accumulate_grad_hook(self._hook(i)) for i, (_, p) in enumerate(named)]

    def _hook(self, i: int):
        def hook(p: torch.Tensor) -> None:  # noqa: ARG001 - hook signature
            self.seen[i] = True
        return hook

    def unused(self) -> list[str]:
        """The parameters no rank saw a gradient for (a collective: every rank calls it after the same backward)."""
        for h in self.handles:
            h.remove()
        self.handles = []
        seen = self.seen
        if self.info.world > 1:  # used on any rank is used: one all_reduce MAX of a flag per parameter
            t = torch.tensor(seen, dtype=torch.int32, device=self.info.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            seen = [bool(v) for v in t.tolist()]
        return [n for n, s in zip(self.names, seen) if not s]


def _hash(parts: list[tuple[str, str, torch.Tensor, int]], keys: tuple[str, ...], per_tensor: bool) -> Partials:
    """(key, name, flat tensor, global offset) -> Partials, hashed in one batched call (read at resolve)."""
    totals: dict[str, int] = dict.fromkeys(keys, 0)
    tensors: dict[str, dict[str, int]] = {k: {} for k in keys if per_tensor and k != "opt"}
    launched = fingerprint_many_deferred([(t, off) for _, _, t, off in parts])  # no host sync here
    return Partials(totals, tensors, [(launched, [(key, name if key in tensors else None)
                                                  for key, name, _, _ in parts])])


# ---- the registry --------------------------------------------------------------------------------------------
_REGISTRY: dict[str, type[Engine]] = {}


def register(cls: type[Engine]) -> type[Engine]:
    """Class decorator: ``dist.engine=<cls.name>`` builds ``cls``.  A name taken by another class is an error."""
    if not (isinstance(cls, type) and issubclass(cls, Engine)) or cls is Engine:
        raise TypeError(f"register takes a subclass of dettrain.sync.engines.Engine, got {cls!r}")
    have = _REGISTRY.get(cls.name)
    if have is not None and have is not cls:
        raise ValueError(f"engine name {cls.name!r} is taken by {have.__module__}.{have.__qualname__}")
    _REGISTRY[cls.name] = cls
    return cls


def registered() -> dict[str, type[Engine]]:
    """The registered engines, name -> class, in registration order (the built-ins first)."""
    return dict(_REGISTRY)


def _import_engine(path: str) -> type[Engine]:
    """The Engine subclass an import path names (``package.module:Class`` or ``package.module.Class``),
    registered under its ``name``; UserError when it cannot be imported or is not an engine."""
    mod_name, sep, attr = path.partition(":")
    if not sep:
        mod_name, _, attr = path.rpartition(".")
    try:
        obj = getattr(importlib.import_module(mod_name), attr)
    except (ImportError, AttributeError, ValueError) as e:
        raise UserError(f"dist.engine={path!r} is not one of {', '.join(('auto', *_REGISTRY))} and cannot be "
                        f"imported as package.module:Class ({type(e).__name__}: {e}); check the name, or put its "
                        "module on PYTHONPATH") from None
    if not (isinstance(obj, type) and issubclass(obj, Engine)) or obj is Engine:
        raise UserError(f"dist.engine={path!r} names {obj!r}, not a subclass of dettrain.sync.engines.Engine")
    return register(obj)


def lookup(name: str) -> type[Engine]:
    """The class of a registered engine name or of an import path (``_import_engine``)."""
    if name in _REGISTRY:
        return _REGISTRY[name]
    if "." in name or ":" in name:
        return _import_engine(name)
    raise UserError(f"dist.engine={name!r} is not one of {', '.join(('auto', *_REGISTRY))}")
