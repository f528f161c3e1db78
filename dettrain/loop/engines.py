"""Gradient-sync engines: one interface, three implementations (``dist.engine``).

The training step (loop/trainer.py) reads ``begin_step -> backward per micro-batch -> reduce -> clip_ -> step``
and never asks which engine it drives:

    ddp    torch DistributedDataParallel + torch AdamW (tiers 0-2: the baseline users know)
    flat   dettrain's canonical reducer over one flat fp32 buffer (collectives.py) + FlatAdamW; optional ZeRO-1
    fsdp2  torch FSDP2 (``fully_shard`` per block, ZeRO-3); at tiers 3-4 its reduce-scatter is replaced by
           ``CanonicalReduceScatter`` (all_to_all, then a fixed-order sum written here), so NCCL/Gloo never sum

``auto`` is ddp below tier 3 and flat from tier 3 on.

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

import contextlib
import logging
import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from dettrain import dist as D
from dettrain.errors import UserError
from dettrain.kernels.optim import adamw_
from dettrain.loop.collectives import BinaryCounter, CanonicalReducer, FlatLayout, exact_sumsq, tree_sum_rows_into
from dettrain.loop.optim import FlatAdamW, OptimConfig, decays, unmatched_no_decay
from dettrain.record.fingerprint import Deferred, combine, fingerprint_many_deferred, resolve_all, segment_fingerprints
from dettrain.tiers import policy

ENGINES = ("auto", "ddp", "flat", "fsdp2")
log = logging.getLogger("dettrain")


def resolve_engine(name: str, tier: int) -> str:
    """The engine ``dist.engine`` names at ``tier``; UserError for a combination that cannot keep the tier."""
    if name not in ENGINES:
        raise UserError(f"dist.engine={name!r} is not one of {', '.join(ENGINES)}")
    pol = policy(tier)
    if name == "auto":
        return pol.default_engine
    if name == "ddp" and pol.canonical_sum:
        raise UserError(f"dist.engine=ddp cannot keep det.tier={tier}: DDP sums gradients inside NCCL/Gloo, whose "
                        "order changes with the algorithm and bucket layout; use dist.engine=flat or fsdp2 (or auto)")
    return name


def check_engine(cfg) -> str:
    """Start-up validation of ``dist.*`` engine keys against the tier and this torch; returns the engine."""
    name = resolve_engine(cfg.dist.engine, cfg.det.tier)
    if cfg.dist.shard_optimizer and name != "flat":
        raise UserError(f"dist.shard_optimizer=true shards the flat engine's optimizer (ZeRO-1); dist.engine "
                        f"resolves to {name} here: use dist.engine=flat (tier >= 3), or dist.engine=fsdp2, which "
                        "shards parameters, gradients and optimizer state anyway")
    if name == "fsdp2":
        try:
            from torch.distributed.fsdp import FSDPModule
        except ImportError:
            FSDPModule = None
        if FSDPModule is None or not hasattr(FSDPModule, "set_custom_reduce_scatter"):
            raise UserError(f"dist.engine=fsdp2 needs torch >= 2.9 (FSDPModule.set_custom_reduce_scatter); this is "
                            f"torch {torch.__version__}: upgrade torch or use dist.engine=flat")
    return name


# ---- the interface ---------------------------------------------------------------------------------------
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
    """Gradient sync + optimizer behind one interface (see the module docstring)."""

    name = "base"
    assignment = "block"  # how the sampler deals a step's micro-batches to ranks: "block" or "round_robin"

    def __init__(self, model: nn.Module, info: D.DistInfo, tier: int, optim: OptimConfig) -> None:
        self.model, self.info, self.tier, self.optim_cfg = model, info, tier, optim
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

    def reduce(self, scale: float) -> float:
        """Finish the gradient sync (the step gradient is the sum times ``scale`` = 1/M); returns its L2 norm."""
        raise NotImplementedError

    def clip_(self, max_norm: float, norm: float) -> None:
        """Scale the reduced gradient by max_norm / (norm + 1e-6) when that is below 1 (max_norm 0: no clipping)."""
        if max_norm > 0:
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

    # checkpoints: a DCP state dict of tensors to save, and how to load into this engine's state
    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict]:
        raise NotImplementedError

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


# ---- DDP -------------------------------------------------------------------------------------------------
class DDPEngine(Engine):
    """torch DDP (bucketed all-reduce inside the backend) and torch AdamW: tiers 0-2."""

    name = "ddp"

    def __init__(self, model, info, tier, optim, lr: float, bucket_mb: float, allow_unused: bool = False) -> None:
        super().__init__(model, info, tier, optim)
        # model.allow_unused: DDP must then look for parameters without a gradient every step (a graph traversal),
        # or it waits for them forever and fails at the next forward
        self.ddp = (torch.nn.parallel.DistributedDataParallel(
            model, bucket_cap_mb=bucket_mb, device_ids=[info.local_rank] if info.device.type == "cuda" else None,
            find_unused_parameters=allow_unused) if info.world > 1 else None)
        # fused on CUDA: one elementwise kernel, no reductions, deterministic
        # optim.no_decay: a second param group with weight decay 0 (after the decayed one; both in model order)
        named = list(model.named_parameters())
        groups = [{"params": [p for n, p in named if n not in self.no_decay]},
                  {"params": [p for n, p in named if n in self.no_decay], "weight_decay": 0.0}]
        self.opt = torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=(optim.beta1, optim.beta2),
                                     eps=optim.eps, weight_decay=optim.weight_decay, foreach=False,
                                     fused=info.device.type == "cuda")

    @property
    def forward_module(self) -> nn.Module:
        return self.ddp or self.model

    def micro(self, k: int):
        last = k == self.n_micro - 1
        return contextlib.nullcontext() if (self.ddp is None or last) else self.ddp.no_sync()

    def backward(self, loss, k):
        (loss / self.n_micro).backward()  # DDP averages over ranks: together the mean over M

    def reduce(self, scale):
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        return float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0

    def clip_(self, max_norm, norm):
        # torch's clip_grads_with_norm_, whose fp32 coefficient is clamped to 1; when it clamps, scaling by 1.0
        # changes no bit, so the pass over the gradients (and its host->device copy of the coefficient) is skipped
        if max_norm > 0:
            total = torch.tensor(norm)
            if float(torch.clamp(max_norm / (total + 1e-6), max=1.0)) < 1.0:
                torch.nn.utils.clip_grads_with_norm_(self.model.parameters(), max_norm, total)

    def grad_parts(self):
        return [p.grad for p in self.model.parameters() if p.grad is not None]

    def step(self, lr):
        for g in self.opt.param_groups:
            g["lr"] = lr
        if self.frozen:  # torch AdamW skips a parameter without a gradient: no update, no weight decay
            for n, p in self.model.named_parameters():
                if n in self.frozen:
                    p.grad = None
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def close(self):
        # DDP's C++ reducer holds the process group: drop it while the group is still registered, so that the
        # group is destroyed by dist.shutdown, not by whoever drops this wrapper last (dist.shutdown says why)
        self.ddp = None

    def partials(self, keys, per_tensor):
        # every rank holds everything: rank r hashes the tensors i with i % world == r
        N = self.layout.numel
        named = self.layout.entries[self.info.rank :: self.info.world]
        parts = []
        for key in keys:
            for name, p, off, _ in named:
                if key == "param":
                    parts.append((key, name, p.detach().reshape(-1), off))
                elif key == "grad":
                    g = p.grad if p.grad is not None else torch.zeros_like(p)
                    parts.append((key, name, g.reshape(-1), off))
                else:
                    st = self.opt.state.get(p, {})
                    for k, base in (("exp_avg", 0), ("exp_avg_sq", N)):
                        v = st.get(k)
                        parts.append((key, name, (v if v is not None else torch.zeros_like(p)).reshape(-1),
                                      base + off))
        return _hash(parts, keys, per_tensor)

    def state_dict(self):
        sd = {}
        for name, p in self.model.named_parameters():
            sd[f"model/{name}"] = p.detach()
            for k, v in self.opt.state.get(p, {}).items():
                if not torch.is_tensor(v):
                    raise TypeError(f"optimizer state {name}.{k} is a {type(v).__name__}; only tensors are saved")
                sd[f"optim/{name}/{k}"] = v
        # AdamW's per-parameter step counts are not in the opt fingerprint: record them to check after a load
        steps = sorted({float(st["step"]) for st in self.opt.state.values() if "step" in st})
        return sd, {"kind": "torch", "steps": steps}


# ---- flat canonical reducer ------------------------------------------------------------------------------
class FlatEngine(Engine):
    """dettrain's canonical reducer over one flat fp32 buffer and FlatAdamW (optionally sharded: ZeRO-1)."""

    name = "flat"

    def __init__(self, model, info, tier, optim, bucket_mb: float, shard: bool) -> None:
        super().__init__(model, info, tier, optim)
        self.reducer = CanonicalReducer(model, info.rank, info.world, bucket_mb, max(tier, 3), shard, info.device)
        # no-decay parameters as global flat ranges: offsets of the canonical layout, the same for every world size
        no_decay = [(o, o + k) for n, _, o, k in self.layout.entries if n in self.no_decay]
        self.opt = FlatAdamW(self.reducer.param, self.reducer.grad, self.reducer.owned(), optim, no_decay)

    def begin_step(self, n_micro):
        super().begin_step(n_micro)
        self.reducer.begin_step(n_micro)

    def backward(self, loss, k):
        self.reducer.begin_micro(k)
        loss.backward()  # buckets launch from the hooks during the last micro-batch's backward
        self.reducer.end_micro(k)

    def reduce(self, scale):
        self.reducer.finish(scale=scale)
        return self.reducer.grad_norm()

    def grad_parts(self):
        return [self.reducer.grad[a:b] for a, b in self.reducer.owned()]

    def freeze(self, names):
        super().freeze(names)
        self.opt.freeze([(o, o + k) for n, _, o, k in self.layout.entries if n in self.frozen])

    def step(self, lr):
        self.opt.step(lr)
        self.reducer.gather_params()

    def partials(self, keys, per_tensor):
        r, N = self.reducer, self.layout.numel
        # each rank hashes its bucket shards (its own when sharded; any split works when every rank holds all):
        # the work is spread over the ranks and the integer partials add up exactly
        regions = [(a, min(b, N)) for a, b in r.layout.own_shards(self.info.rank) if a < N]
        views = {"grad": lambda a, b: [(r.grad[a:b], a)], "param": lambda a, b: [(r.param[a:b], a)],
                 "opt": lambda a, b: [(self.opt.view("exp_avg", a, b), a),
                                      (self.opt.view("exp_avg_sq", a, b), N + a)]}
        parts = [(key, "", t, off) for key in keys for a, b in regions for t, off in views[key](a, b)]
        out = _hash(parts, keys, False)
        if per_tensor:
            segs = self.layout.segments()
            for key in keys:
                if key == "opt":
                    continue
                local: dict[str, int] = {}
                for a, b in regions:
                    for name, v in segment_fingerprints(views[key](a, b)[0][0], a, segs).items():
                        local[name] = combine([local.get(name, 0), v])
                out.tensors[key] = local
        return out

    def state_dict(self):
        # one global tensor per name (model/<name>, optim/<name>/exp_avg, optim/<name>/exp_avg_sq), of the
        # parameter's shape: each rank saves the boxes of its bucket shards (checkpoint/chunks.py), so a sharded
        # optimizer is saved by the ranks that hold it, writes are spread over ranks otherwise, and plain DCP
        # reads every name as one tensor
        from dettrain.checkpoint.chunks import NAMED, named_chunks

        regions = self._write_regions()
        sd = named_chunks(self.layout.entries, {buf: regions for buf, _ in NAMED}, self.flat_slice)
        return sd, {"kind": "flat", "step_count": self.opt.step_count}

    def _write_regions(self) -> list[tuple[int, int]]:
        N = self.layout.numel
        return [(a, min(b, N)) for a, b in self.reducer.layout.own_shards(self.info.rank) if a < N]

    def flat_slice(self, name: str, a: int, b: int) -> torch.Tensor:
        """Global flat range [a, b) of the parameters (a full buffer on every rank) or of an AdamW moment (held
        only for this rank's regions; ValueError if [a, b) is not inside one of them)."""
        return self.reducer.param[a:b] if name == "param" else self.opt.view(name, a, b)


# ---- FSDP2 -----------------------------------------------------------------------------------------------
class CanonicalReduceScatter:
    """FSDP2's reduce-scatter with the sum written here: ``all_to_all`` of the flat input (rank i's row j goes to
    rank j), then ``tree_sum_rows`` over the W received rows in rank order.  The backend only moves bytes.

    FSDP2 lays the input out rank by rank (W rows of one padded shard each), so row i received on rank j is rank
    i's contribution to shard j.  Plugged in with ``FSDPModule.set_custom_reduce_scatter`` (torch >= 2.9)."""

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group=None, op=None, async_op=False):
        world = dist.get_world_size(group)
        if world == 1:  # one row: the all_to_all would be a copy and the tree the identity
            output_tensor.copy_(input_tensor.view(output_tensor.shape))
            return None
        recv = torch.empty_like(input_tensor)
        dist.all_to_all_single(recv, input_tensor, group=group)
        tree_sum_rows_into(recv.view(world, -1), output_tensor.view(-1))
        return None


def use_canonical_reduce_scatter(units: list) -> None:
    """Tiers 3-4: every FSDP2 unit reduce-scatters through ``CanonicalReduceScatter`` as a plain sum (the 1/M scale
    is applied after the tree).  Shared by the FSDP2 engine and the memory planner, so both run the same sums."""
    comm = CanonicalReduceScatter()
    for u in units:
        u.set_custom_reduce_scatter(comm)
        u.set_gradient_divide_factor(1.0)
        u.set_force_sum_reduction_for_comms(True)


def _ensure_group(info: D.DistInfo) -> None:
    """FSDP2 needs a process group even on one rank: a one-rank group on a local store."""
    if not dist.is_initialized():
        backend = "nccl" if info.device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


class FSDP2Engine(Engine):
    """torch FSDP2: parameters, gradients and optimizer state sharded by rows (ZeRO-3).

    Every micro-batch is reduce-scattered and accumulates on fp32 shards.  Tiers 0-2: FSDP2's own reduce-scatter
    and accumulation.  Tier 3: the canonical reduce-scatter, accumulated by FSDP2 in micro-batch order.  Tier 4:
    micro-batches are dealt round-robin (round k: rank r runs global micro-batch kW + r); every round is
    reduce-scattered canonically, which gives the tree node of leaves kW..kW+W-1 for this rank's shard, and a binary
    counter over rounds builds the upper levels on shards (post-accumulate-grad hooks take each round's sharded
    gradient before FSDP2 would add it to the previous one)."""

    name = "fsdp2"

    def __init__(self, model, info, tier, optim, mixed_precision: bool, reshard_after_forward: bool) -> None:
        super().__init__(model, info, tier, optim)  # the layout is taken before sharding: full shapes
        from torch.distributed.device_mesh import init_device_mesh

        from dettrain.loop.fsdp import shard_model

        _ensure_group(info)
        self.mesh = init_device_mesh(info.device.type, (info.world,))
        self.units = shard_model(model, self.mesh, mixed_precision=mixed_precision,
                                 reshard_after_forward=reshard_after_forward)
        if self.policy.world_invariant:
            self.assignment = "round_robin"
        if self.policy.canonical_sum:
            use_canonical_reduce_scatter(self.units)
        self.params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.exp_avg = [torch.zeros_like(p) for _, p in self.params]  # DTensors like their parameters
        self.exp_avg_sq = [torch.zeros_like(p) for _, p in self.params]
        self._counters = [BinaryCounter() for _ in self.params]
        self._last = False
        self._pairs = False  # tier 4 on one rank: each reduction is a pair of micro-batches (backward)
        self._hooks = []
        if self.policy.world_invariant:
            for i, (_, p) in enumerate(self.params):
                self._hooks.append(p.register_post_accumulate_grad_hook(self._make_hook(i)))

    def _make_hook(self, i: int):
        def hook(p: torch.Tensor) -> None:
            # this round's node of the micro-batch tree for this shard (the canonical reduce-scatter's output)
            leaf = p.grad._local_tensor
            c = self._counters[i]
            if not self._last:
                # keeps this round's reduce-scatter output alive; FSDP2 allocates a new one per round
                c.push(leaf, level=1 if self._pairs else 0)
                p.grad = None  # the next round assigns a fresh gradient instead of adding to this one
            else:
                c.finish_(leaf, slice(None))  # earlier subtrees + this round, into place
                c.reset()
        return hook

    def begin_step(self, n_micro):
        super().begin_step(n_micro)
        self._pairs = self.policy.world_invariant and self.info.world == 1 and n_micro > 1
        for _, p in self.params:
            p.grad = None

    def backward(self, loss, k):
        # every micro-batch is reduce-scattered (as FSDP2 users accumulate): reduced, gradients accumulate in fp32
        # on shards (tiers 0-3: FSDP2's += in micro-batch order; tier 4: the tree).  On one rank the shard is the
        # whole gradient, so the reduce-scatters and re-gathers between micro-batches buy nothing: there the
        # gathered parameters stay for the next micro-batch and (tiers 0-3) FSDP2 accumulates the unsharded
        # gradients in its reduce dtype (fp32: the same += in the same order, so the same bits) and reduces once.
        # Tier 4 on one rank reduces every pair (2j, 2j+1) instead: FSDP2's g_2j + g_2j+1 is the tree's lowest
        # node (up to the sign of a zero sum, which reduce() normalises), and the counter takes pairs at level 1
        self._last = k == self.n_micro - 1
        if self.info.world == 1 and self.n_micro > 1:
            root = self.units[-1]
            root.set_reshard_after_backward(self._last)
            root.set_requires_gradient_sync(k % 2 == 1 if self.policy.world_invariant else self._last)
        (loss if self.policy.canonical_sum else loss / self.n_micro).backward()

    def _local(self, t: torch.Tensor) -> torch.Tensor:
        return t._local_tensor if hasattr(t, "_local_tensor") else t

    def grad_parts(self):
        return [self._local(p.grad) for _, p in self.params if p.grad is not None]

    def reduce(self, scale):
        for _, p in self.params:
            if p.grad is None:  # unused in every micro-batch: a zero gradient, as in the flat engine
                p.grad = torch.zeros_like(p)
        if self.policy.canonical_sum:
            grads = self.grad_parts()
            torch._foreach_add_(grads, 0.0)  # -0.0 -> +0.0 in place: the flat engine's buffers accumulate onto +0.0
            if scale != 1.0:
                torch._foreach_mul_(grads, scale)
        # the canonical norm at every tier: one definition, cheap next to the step
        return math.sqrt(exact_sumsq(self.grad_parts(), self.info.world))

    @torch.no_grad()
    def step(self, lr):
        c = self.optim_cfg
        self.step_count += 1
        for (name, p), m, v in zip(self.params, self.exp_avg, self.exp_avg_sq):
            lp = self._local(p)
            if lp.numel() == 0 or name in self.frozen:  # frozen: model.allow_unused
                continue
            adamw_(lp.view(-1), self._local(p.grad).reshape(-1), self._local(m).view(-1),
                   self._local(v).view(-1), beta1=c.beta1, beta2=c.beta2, lr=lr,
                   weight_decay=self.weight_decay(name), eps=c.eps, step=self.step_count)
        for _, p in self.params:
            p.grad = None

    def _shard_offset(self, name: str, p: torch.Tensor) -> int:
        """Global flat index of this rank's first element of ``p``: FSDP2 shards dim 0 in torch.chunk pieces."""
        rows = p.shape[0] if p.dim() else 1
        per_row = p.numel() // max(rows, 1)
        chunk = -(-rows // self.info.world)
        return self.offsets[name] + min(self.info.rank * chunk, rows) * per_row

    def partials(self, keys, per_tensor):
        N = self.layout.numel
        parts = []
        for key in keys:
            for i, (name, p) in enumerate(self.params):
                off = self._shard_offset(name, p)
                if key == "param":
                    parts.append((key, name, self._local(p).detach().reshape(-1), off))
                elif key == "grad":
                    g = self._local(p.grad) if p.grad is not None else torch.zeros_like(self._local(p))
                    parts.append((key, name, g.reshape(-1), off))
                else:
                    parts.append((key, name, self._local(self.exp_avg[i]).reshape(-1), off))
                    parts.append((key, name, self._local(self.exp_avg_sq[i]).reshape(-1), N + off))
        return _hash(parts, keys, per_tensor)

    def state_dict(self):
        # DTensors: DCP saves each rank's shards and reshards them on load onto any world size
        sd = {}
        for (name, p), m, v in zip(self.params, self.exp_avg, self.exp_avg_sq):
            sd[f"model/{name}"] = p
            sd[f"optim/{name}/exp_avg"] = m
            sd[f"optim/{name}/exp_avg_sq"] = v
        return sd, {"kind": "fsdp2", "step_count": self.step_count}

    def close(self):
        for h in self._hooks:
            h.remove()


def build_engine(name: str, model: nn.Module, info: D.DistInfo, tier: int, optim: OptimConfig, *, lr: float,
                 bucket_mb: float, shard_optimizer: bool, mixed_precision: bool,
                 reshard_after_forward: bool, allow_unused: bool = False) -> Engine:
    """The engine ``name`` (already resolved by ``resolve_engine``) around ``model``."""
    if name == "ddp":
        return DDPEngine(model, info, tier, optim, lr, bucket_mb, allow_unused)
    if name == "flat":
        return FlatEngine(model, info, tier, optim, bucket_mb, shard_optimizer)
    if name == "fsdp2":
        return FSDP2Engine(model, info, tier, optim, mixed_precision, reshard_after_forward)
    raise UserError(f"dist.engine={name!r} is not one of {', '.join(ENGINES)}")
