"""``dist.engine=fsdp2``: torch FSDP2 (ZeRO-3; ``fully_shard`` per block, or per unit of blocks on one rank:
``UNITS_ENV``); at tiers 3-4 its reduce-scatter is replaced by ``CanonicalReduceScatter`` (all_to_all, then a
fixed-order sum written here), so NCCL/Gloo never sum."""

from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist

from dettrain import dist as D
from dettrain.errors import UserError
from dettrain.kernels.norm import finish_
from dettrain.kernels.optim import adamw_many_, fp_launch_shape
from dettrain.record.fingerprint import Deferred
from dettrain.sync.accumulate import BinaryCounter
from dettrain.sync.collectives import canonical_norm, tree_sum_rows_into
from dettrain.sync.engines.base import OPTIM, Engine, _hash, register
from dettrain.sync.offload import HostCounter, HostLevels


class CanonicalReduceScatter:
    """FSDP2's reduce-scatter with the sum written here: ``all_to_all`` of the flat input (rank i's row j goes to
    rank j), then ``tree_sum_rows`` over the W received rows in rank order.  The backend only moves bytes.

    FSDP2 lays the input out rank by rank (W rows of one padded shard each), so row i received on rank j is rank
    i's contribution to shard j.  Plugged in with ``FSDPModule.set_custom_reduce_scatter`` (torch >= 2.9).

    ``sum_dtype`` fp32 with bf16 rows (``bf16_rows``, engines computing in bf16): FSDP2's reduce dtype is then the
    gradients' own bf16 (``fsdp.mp_policy``), so its copy-in casts nothing; the ``all_to_all`` moves 2 bytes an
    element instead of 4, and the tree adds the rows in fp32 into an fp32 output.  Widening bf16 to fp32 is exact,
    so every sum is the one the fp32 rows of FSDP2's fp32 reduce dtype would give, bit for bit.  FSDP2 asks
    ``allocate`` for the W-row input and then for the one-row output (``foreach_reduce``); the output is the call
    whose size is the last input's divided by W, and it is allocated in ``sum_dtype``."""

    def __init__(self, world: int = 1, sum_dtype: torch.dtype | None = None) -> None:
        self.world = world
        self.sum_dtype = sum_dtype
        self._input_numel: int | None = None

    def allocate(self, size, *, dtype, device):
        numel = 1
        for n in size:
            numel *= n
        if self.sum_dtype is not None and self._input_numel is not None and numel * self.world == self._input_numel:
            self._input_numel = None
            return torch.empty(*size, dtype=self.sum_dtype, device=device)  # the output: the tree's fp32 sums
        self._input_numel = numel
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group=None, op=None, async_op=False):
        world = dist.get_world_size(group)
        if self.sum_dtype is not None and output_tensor.dtype != self.sum_dtype:
            # a torch whose FSDP2 allocates its buffers in another order: summing into 16-bit would round
            raise RuntimeError(f"CanonicalReduceScatter: FSDP2 handed a {output_tensor.dtype} output for "
                               f"{input_tensor.dtype} rows; the tree sums into {self.sum_dtype} only "
                               f"(torch {torch.__version__})")
        if world == 1:  # one row: the all_to_all would be a copy and the tree the identity
            output_tensor.copy_(input_tensor.view(output_tensor.shape))
            return None
        recv = torch.empty_like(input_tensor)
        dist.all_to_all_single(recv, input_tensor, group=group)
        tree_sum_rows_into(recv.view(world, -1), output_tensor.view(-1))
        return None


def bf16_rows(mixed_precision: bool, world: int) -> bool:
    """Whether the canonical reduce-scatter moves the gradients in bf16 (summed in fp32, see
    ``CanonicalReduceScatter``): with bf16 compute on several ranks.  One rank keeps fp32: there FSDP2 may
    accumulate unsharded gradients in its reduce dtype between micro-batches, and that sum must stay fp32."""
    return mixed_precision and world > 1


def use_canonical_reduce_scatter(units: list, world: int, *, bf16: bool = False) -> None:
    """Tiers 3-4: every FSDP2 unit reduce-scatters through ``CanonicalReduceScatter`` as a plain sum (the 1/M scale
    is applied after the tree).  Shared by the FSDP2 engine and the memory planner, so both run the same sums.
    ``bf16``: the units were sharded with ``bf16_rows`` (their reduce dtype is bf16); the sums are fp32."""
    comm = CanonicalReduceScatter(world, torch.float32 if bf16 else None)
    for u in units:
        u.set_custom_reduce_scatter(comm)
        u.set_gradient_divide_factor(1.0)
        u.set_force_sum_reduction_for_comms(True)


def keep_gathered(units: list) -> bool:
    """On one rank: FSDP2's gathered (unsharded) parameters keep their memory when FSDP2 reshards, so every later
    gather writes into the same addresses.  FSDP2 frees that memory at each reshard and allocates it again at the
    next gather, where it may land elsewhere; a CUDA graph of a compiled block (train.cuda_graphs) reads its
    parameters at the addresses it was captured with, so under cudagraph trees every move re-recorded the graph
    (seen on the GPU: "static input data pointer changed", 224 re-records in 8 steps at 125m).  On one rank the
    gathered copy is the whole model in the compute dtype and is alive through every forward and backward anyway
    (dist.reshard_after_forward resolves to false there), so keeping it between steps adds it only to what the
    optimizer step and the fingerprints hold, not to the peak of the forward and backward it is part of.  The
    gather still runs and rewrites every value: the bits do not change (with and without graphs, the same ledgers:
    tests/test_cuda_graphs_gpu.py).

    Reaches into FSDP2's parameter groups (``FSDPParam.free_unsharded_param``, torch >= 2.6); returns False and
    changes nothing where they are not there."""
    params = []
    for u in units:
        state = getattr(u, "_get_fsdp_state", None)
        group = getattr(state(), "_fsdp_param_group", None) if state is not None else None
        if group is None:
            continue
        params.extend(group.fsdp_params)
    if not params or not all(callable(getattr(fp, "free_unsharded_param", None)) for fp in params):
        return False
    for fp in params:
        fp.free_unsharded_param = _keep  # an instance attribute: shadows FSDPParam's method for this one
    return True


def _keep() -> None:
    """FSDPParam.free_unsharded_param on one rank (``keep_gathered``): the memory stays."""


FP_FUSED_ENV = "DETTRAIN_FP_FUSED"
"""``1``: the AdamW launches (``kernels.optim.adamw_many_``, Triton on CUDA) also hash the parameters and moments
they store, and the step line takes its param and opt fields from them instead of reading 12 bytes a parameter
again; the same values (tests/test_fused_fp.py, also on a GPU).  An experiment, off: at its first launch shape it
ran slower at 7B (BENCHMARKS.md); its own shape since (kernels/optim.py ``ADAMW_FP_SHAPE``) is not measured yet.
Without the Triton kernel (CPU) it changes nothing."""

UNITS_ENV = "DETTRAIN_FSDP2_UNITS"
"""How many blocks FSDP2 shards together as one unit (``fully_shard`` of a list of consecutive blocks): FSDP2's
post-forward, pre-backward and post-backward hooks run once a unit (its pre-forward hook still runs on every block
of a list, its work gated to once a unit: torch's ``_register_group_forward_hooks``; the root's one unit has none of
that), and each unit's gradients are reduced as one piece at the end of its backward. Values: ``auto`` (the
default), ``blocks`` (one block a unit), ``root`` (the whole model as the root's one unit), or a whole number of
blocks a unit.

On several ranks, or with ``dist.reshard_after_forward``, units are blocks (the gathered copy of a unit is alive
from its all-gather to its reshard, so bigger units cost memory there and overlap less); any other value is refused.
On one rank without resharding the whole model is gathered through every forward and backward anyway, and FSDP2's
hooks are host time with nothing to hide behind: on the CPU they take 6.1-6.9 ms a micro-batch at 12 blocks, 1.1-2.1
ms as one unit (``bench/engine_host_profile.py``).  There ``auto`` groups small blocks only, under ``SMALL_BLOCK``
parameters, where a block computes for less time than FSDP2's hooks take: into the fewest units of consecutive
blocks within ``UNIT_PARAMS`` parameters each, as even as they go, and a model that fits in one whole is the root's
one unit (125m: 12 blocks of 7.1M parameters, 134M in all).  Bigger blocks stay one a unit (1b: 44M, 7B: 202M).
Measured on one H100 (BENCHMARKS.md), FSDP2 tier 3 against flat tier 3: 125m at micro-batch 4 1.06-1.07x as one
unit, 0.59-0.94x one block a unit (on one H200 1.00-1.03x against 0.56x, three units of four blocks between at
0.86-0.89x); 1b at micro-batches 1 and 2 1.10x / 1.05x one block a unit and 1.095x / 1.056x as one unit, which
bought no speed there and cost peak.  What a unit costs: its whole gradient is alive unreduced at the end of its
backward, beside its reduced fp32 copy, about 6 bytes a parameter (+5.3 GiB at 1b micro-batch 1 as one unit of
970M; 1.5 GiB at most within ``UNIT_PARAMS``).  Never changes a bit: the sums are per element, whatever the
grouping (``tests/test_step_ops.py``)."""

SMALL_BLOCK = 32 * 2**20
UNIT_PARAMS = 256 * 2**20


def blocks_per_unit(world: int, reshard_after_forward: bool, block_params: int, n_blocks: int,
                    root_params: int = 0) -> int:
    """``shard_model``'s ``blocks_per_unit`` from ``DETTRAIN_FSDP2_UNITS`` (0: the root only) for ``n_blocks``
    blocks of ``block_params`` parameters and ``root_params`` outside them (the root's own unit: embeddings, final
    norm, output).  UserError for a value that is not one of the documented forms or cannot apply."""
    value = os.environ.get(UNITS_ENV, "auto").strip() or "auto"
    grouped = world == 1 and not reshard_after_forward
    if value == "auto":
        if not grouped or n_blocks < 2 or block_params >= SMALL_BLOCK:
            return 1
        most = max(1, UNIT_PARAMS // max(block_params, 1))  # blocks one unit may hold
        if most >= n_blocks:  # every block fits in one unit: the root's too, if it fits beside them
            return 0 if n_blocks * block_params + root_params <= UNIT_PARAMS else n_blocks
        return -(-n_blocks // -(-n_blocks // most))  # the fewest units, as even as they go
    if value == "blocks":
        return 1
    if value != "root" and not (value.isdigit() and int(value) >= 1):
        raise UserError(f"{UNITS_ENV}={value!r} must be auto (the default), blocks (fully_shard per block), root "
                        f"(one FSDP2 unit) or a whole number of blocks a unit; unset it for the default")
    if not grouped and value != "1":
        why = f"this run has {world} ranks" if world > 1 else "dist.reshard_after_forward resolves to true"
        raise UserError(f"{UNITS_ENV}={value} shards several blocks as one FSDP2 unit, which only one rank that "
                        f"keeps its parameters gathered through forward can afford; {why}: unset {UNITS_ENV}")
    return 0 if value == "root" else int(value)


def _block_sizes(model) -> tuple[int, int, int]:
    """Parameters of ``model``'s largest block, its number of blocks, and its parameters outside the blocks."""
    from dettrain.sync.fsdp import transformer_blocks

    blocks = transformer_blocks(model)
    sizes = [sum(p.numel() for p in b.parameters()) for b in blocks]
    return max(sizes, default=0), len(blocks), sum(p.numel() for p in model.parameters()) - sum(sizes)


def _ensure_group(info: D.DistInfo) -> None:
    """FSDP2 needs a process group even on one rank: a one-rank group on a local store."""
    if not dist.is_initialized():
        backend = "nccl" if info.device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


@register
class FSDP2Engine(Engine):
    """torch FSDP2: parameters, gradients and optimizer state sharded by rows (ZeRO-3).

    Every micro-batch is reduce-scattered and accumulates on fp32 shards.  Tiers 0-2: FSDP2's own reduce-scatter
    and accumulation.  Tier 3: the canonical reduce-scatter, accumulated by FSDP2 in micro-batch order.  Tier 4:
    micro-batches are dealt round-robin (round k: rank r runs global micro-batch kW + r); every round is
    reduce-scattered canonically, which gives the tree node of leaves kW..kW+W-1 for this rank's shard, and a binary
    counter over rounds builds the upper levels on shards (post-accumulate-grad hooks take each round's sharded
    gradient before FSDP2 would add it to the previous one)."""

    name = "fsdp2"
    state_kind = "fsdp2"
    canonical_bits = True
    offloads_partials = True  # at tier 4 (dist.offload_partials): every counter entry, sync/offload.py

    def __init__(self, model, info, tier, optim, mixed_precision: bool, reshard_after_forward: bool,
                 offload_partials: bool = False) -> None:
        # the layout is taken before sharding: full shapes
        super().__init__(model, info, tier, optim, mixed_precision=mixed_precision)
        from torch.distributed.device_mesh import init_device_mesh

        from dettrain.sync.fsdp import shard_model

        _ensure_group(info)
        self.mesh = init_device_mesh(info.device.type, (info.world,))
        # tiers 3-4 with bf16 compute on several ranks: the gradients travel in bf16 and are summed in fp32
        self.bf16_rows = self.policy.canonical_sum and bf16_rows(mixed_precision, info.world)
        self.units = shard_model(model, self.mesh, mixed_precision=mixed_precision,
                                 reshard_after_forward=reshard_after_forward, bf16_rows=self.bf16_rows,
                                 blocks_per_unit=blocks_per_unit(info.world, reshard_after_forward,
                                                                 *_block_sizes(model)))
        if self.policy.world_invariant:
            self.assignment = "round_robin"
        if self.policy.canonical_sum:
            use_canonical_reduce_scatter(self.units, info.world, bf16=self.bf16_rows)
        # one rank, parameters kept gathered through forward: the gathered copies keep their memory between steps
        # (``keep_gathered``), so train.cuda_graphs can replay the compiled blocks on them
        self.kept_gathered = keep_gathered(self.units) if info.world == 1 and not reshard_after_forward else False
        # the layout keeps what it needs of the unsharded parameters (names, shapes, dtypes, offsets), not the
        # tensors: they would hold the whole fp32 model alive on every rank after sharding (+25 GiB a rank at 7B,
        # seen when tools/memory.py began measuring this engine); meta tensors keep shape and dtype, no storage
        self.layout.entries = [(n, torch.empty(p.shape, dtype=p.dtype, device="meta"), o, k)
                               for n, p, o, k in self.layout.entries]
        self.params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.exp_avg = [torch.zeros_like(p) for _, p in self.params]  # DTensors like their parameters
        self.exp_avg_sq = [torch.zeros_like(p) for _, p in self.params]
        # tier 4, dist.offload_partials: every counter entry waits in pinned host memory between rounds
        # (sync/offload.py); the device then holds no partial sum, only the round being reduced
        self.host = None
        if offload_partials and self.policy.world_invariant:
            self.host = HostLevels([self._local(p).numel() for _, p in self.params], info.device)
            self._counters = [HostCounter(self.host, i) for i in range(len(self.params))]
        else:
            self._counters = [BinaryCounter() for _ in self.params]
        self._order: list[int] = []  # the order the hooks last fired in: the order host copies are staged in
        self._fired: list[int] = []
        self._last = False
        self._pairs = False  # tier 4 on one rank: each reduction is a pair of micro-batches (backward)
        # (reshard after backward, reduce the gradients) as last set on every unit on one rank; FSDP2 never changes
        # them itself, and the last micro-batch of a step sets both back to FSDP2's defaults (true, true)
        self._flags: tuple[bool, bool] | None = None
        # DETTRAIN_FP_FUSED=1 (an experiment, off): the AdamW launches also hash the parameters and moments they
        # store, so the step line's param and opt fields need no second read of them (kernels/optim.py)
        self.fp_fused = os.environ.get(FP_FUSED_ENV, "") == "1"
        if self.fp_fused:  # its launch shape (DETTRAIN_FP_FUSED_SHAPE), checked before the first step
            try:
                fp_launch_shape()
            except ValueError as e:
                raise UserError(str(e)) from None
        self._fused: torch.Tensor | None = None  # the last step's fused partials (param, opt), until ``partials``
        self._unfused: set[str] = set()  # the parameters that step did not update (frozen, empty shard)
        self._hooks = []
        if self.policy.world_invariant:
            for i, (_, p) in enumerate(self.params):
                self._hooks.append(p.register_post_accumulate_grad_hook(self._make_hook(i)))

    @classmethod
    def from_config(cls, cfg, model, info, *, mixed_precision):
        return cls(model, info, cfg.det.tier, cfg.optim, mixed_precision,
                   D.resolve_reshard(cfg.dist.reshard_after_forward, info.world),
                   offload_partials=cfg.dist.offload_partials)

    @classmethod
    def check(cls, cfg):
        super().check(cfg)
        try:
            from torch.distributed.fsdp import FSDPModule
        except ImportError:
            FSDPModule = None
        if FSDPModule is None or not hasattr(FSDPModule, "set_custom_reduce_scatter"):
            raise UserError(f"dist.engine=fsdp2 needs torch >= 2.9 (FSDPModule.set_custom_reduce_scatter); this is "
                            f"torch {torch.__version__}: upgrade torch or use dist.engine=flat")

    @classmethod
    def graphs_blocker(cls, cfg, world, mixed_precision):
        # CUDA graphs read the gathered parameters where they were captured: on one rank they stay put
        # (``keep_gathered``); on several, every gather after a reshard may put them elsewhere
        if world > 1:
            return (f"dist.engine resolves to fsdp2 on {world} ranks, whose gathered parameters are freed and "
                    f"gathered again at other addresses (CUDA graphs need them in place: one rank only)")
        if cfg is not None and D.resolve_reshard(cfg.dist.reshard_after_forward, world):
            return ("dist.engine resolves to fsdp2 with dist.reshard_after_forward=true, which frees the gathered "
                    "parameters after every forward (CUDA graphs need them in place)")
        # fp32: between micro-batches FSDP2 keeps the backward's own output as the gradient it adds the next one
        # to, memory the next replay overwrites; bf16 compute hands it over as an fp32 copy
        if not mixed_precision:
            return ("dist.engine resolves to fsdp2 with train.precision=fp32, whose accumulated gradient is a "
                    "backward's output (memory a CUDA graph's next replay rewrites); train.precision=bf16 avoids it")
        return None

    @classmethod
    def autocast(cls, device, mixed_precision):
        # bf16 compute through FSDP2's MixedPrecisionPolicy (fp32 master and reduce), not torch.autocast
        return contextlib.nullcontext()

    def _make_hook(self, i: int):
        def hook(p: torch.Tensor) -> None:
            # this round's node of the micro-batch tree for this shard (the canonical reduce-scatter's output)
            leaf = p.grad._local_tensor
            c = self._counters[i]
            self._fired.append(i)
            if not self._last:
                # keeps this round's reduce-scatter output alive; FSDP2 allocates a new one per round
                c.push(leaf, level=1 if self._pairs else 0)
                p.grad = None  # the next round assigns a fresh gradient instead of adding to this one
            elif self.host is not None:
                c.finish_(leaf)  # earlier subtrees, brought back from the host, + this round, into place
            else:
                c.finish_(leaf, slice(None))  # earlier subtrees + this round, into place
                c.reset()
        return hook

    def begin_step(self, n_micro):
        super().begin_step(n_micro)
        self._pairs = self.policy.world_invariant and self.info.world == 1 and n_micro > 1
        for c in self._counters:
            c.reset()  # empty after a whole step; a step cut short (an exception) must not leave entries behind
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
            want = (self._last, k % 2 == 1 if self.policy.world_invariant else self._last)
            have = self._flags or (None, None)
            root = self.units[-1]
            # each set only when it changes: a setter walks every module of the model
            if want[0] != have[0]:
                root.set_reshard_after_backward(want[0])
            if want[1] != have[1]:
                root.set_requires_gradient_sync(want[1])
            self._flags = want
        self._expect(k)
        self._fired = []
        (loss if self.policy.canonical_sum else loss / self.n_micro).backward()
        if self._fired:
            self._order = self._fired

    def _expect(self, k: int) -> None:
        """dist.offload_partials: before micro-batch k's backward, tell the host which entries its hooks will read
        (in the order the hooks fired last time), so their copies come back ahead of them.  (Starting them with the
        forward instead, together with a second side stream, measured slower at 7B: BENCHMARKS.md.)"""
        hooks = self.policy.world_invariant and not (self._pairs and k % 2 == 0)  # the counters' hooks fire
        if self.host is None or not hooks:
            return
        level = None if k == self.n_micro - 1 else (1 if self._pairs else 0)
        order = self._order or range(len(self.params))
        self.host.expect([(i, lv) for i in order for lv in self._counters[i].reads(level)])

    def _local(self, t: torch.Tensor) -> torch.Tensor:
        return t._local_tensor if hasattr(t, "_local_tensor") else t

    def grad_parts(self):
        return [self._local(p.grad) for _, p in self.params if p.grad is not None]

    def reduce(self, scale):
        for _, p in self.params:
            if p.grad is None:  # unused in every micro-batch: a zero gradient, as in the flat engine
                p.grad = torch.zeros_like(p)
        grads = self.grad_parts()
        if self.policy.canonical_sum:
            # one pass over the shards: -0.0 -> +0.0 (the flat engine's buffers accumulate onto +0.0), times 1/M,
            # and the local max |g| the norm's scale starts from (kernels/norm.py; on CUDA one launch)
            local_max = finish_(grads, scale)
            return canonical_norm(grads, self.info.world, local_max)
        # the canonical norm at every tier: one definition, cheap next to the step; on the device (no host sync)
        return canonical_norm(grads, self.info.world)

    @torch.no_grad()
    def step(self, lr):
        c = self.optim_cfg
        self.step_count += 1
        quads: list[list[torch.Tensor]] = [[], [], [], []]
        decays, bases, skipped = [], [], set()
        for (name, p), m, v in zip(self.params, self.exp_avg, self.exp_avg_sq):
            lp = self._local(p)
            if lp.numel() == 0 or name in self.frozen:  # frozen: model.allow_unused
                skipped.add(name)
                continue
            for quad, t in zip(quads, (lp.view(-1), self._local(p.grad).reshape(-1), self._local(m).view(-1),
                                       self._local(v).view(-1))):
                quad.append(t)
            decays.append(self.weight_decay(name))
            bases.append(self._shard_offset(name, p))
        # every shard in one launch per weight decay (CUDA), the same bits as one adamw_ per parameter; fused (an
        # experiment), the launches also return the param and opt partials of what they stored
        self._fused = adamw_many_(*quads, beta1=c.beta1, beta2=c.beta2, lr=lr, weight_decays=decays, eps=c.eps,
                                  step=self.step_count, fp_bases=bases if self.fp_fused else None,
                                  fp_numel=self.layout.numel)
        self._unfused = skipped
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
        # the last step's fused partials (DETTRAIN_FP_FUSED=1) stand for the parameters and moments it updated,
        # once, right after it: the step line's totals; per-tensor values, or any later call, hash as usual
        fused, self._fused = self._fused, None
        fused = fused if fused is not None and not per_tensor and set(keys) == {"param", "opt"} else None
        for key in keys:
            for i, (name, p) in enumerate(self.params):
                if fused is not None and name not in self._unfused:
                    continue
                off = self._shard_offset(name, p)
                if key == "param":
                    parts.append((key, name, self._local(p).detach().reshape(-1), off))
                elif key == "grad":
                    g = self._local(p.grad) if p.grad is not None else torch.zeros_like(self._local(p))
                    parts.append((key, name, g.reshape(-1), off))
                else:
                    parts.append((key, name, self._local(self.exp_avg[i]).reshape(-1), off))
                    parts.append((key, name, self._local(self.exp_avg_sq[i]).reshape(-1), N + off))
        out = _hash(parts, keys, per_tensor)
        if fused is not None:
            out.pending.append((Deferred(fused, [0, 1]), [("param", None), ("opt", None)]))
        return out

    # ---- checkpoint: the DTensors themselves; DCP saves each rank's rows and reshards them onto any world size ---
    def state_dict(self):
        sd: dict = {}
        for (name, p), m, v in zip(self.params, self.exp_avg, self.exp_avg_sq):
            sd[f"model/{name}"] = p
            sd[f"optim/{name}/exp_avg"] = m
            sd[f"optim/{name}/exp_avg_sq"] = v
        sd[OPTIM] = {"kind": self.state_kind, "step_count": self.step_count}
        return sd

    def load_state_dict(self, state_dict):
        # DCP has loaded each rank's rows into the DTensors in place (load_target: state_dict()'s own tensors)
        self.step_count = int(state_dict[OPTIM]["step_count"])
        self._fused = None  # the state is no longer what the last step stored

    def close(self):
        for h in self._hooks:
            h.remove()
