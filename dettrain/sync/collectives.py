"""Canonical-order gradient reduction (tiers 3-4): the flat engine's collectives (FSDP2's: engines/fsdp2.py).

Layout.  Parameters are laid out in one flat fp32 buffer in *canonical order*: the reverse of
``named_parameters()`` order (roughly the order in which backward produces their gradients), each parameter
contiguous, no gaps.  The order and every offset depend only on the model, never on world size or bucket size.  The
buffer is padded at its end to a multiple of ``world * CHUNK``.

Buckets are fixed contiguous slices of that buffer, each a multiple of ``world * CHUNK`` elements (a parameter may
straddle two buckets).  A bucket is launched as soon as every parameter overlapping it has its gradient, always in
bucket-index order on every rank, so collectives match across ranks.

Reduce-scatter of one bucket (world size W, shard size S = bucket / W):
  1. ``all_to_all``: rank j receives shard j of every rank's bucket -> a (W, S) tensor, row i from rank i;
  2. ``tree_sum_rows``: a fixed pairwise tree over the rows, written here (level s adds row i+s into row i for i a
     multiple of 2s), so each element is a fixed sequence of IEEE additions (on CUDA, one Triton pass per eight
     rows does the same additions: ``kernels/rowsum.py``);
  3. ``all_gather`` of the summed shards (or the shard is kept, with ``dist.shard_optimizer``).
No floating-point sum ever happens inside NCCL or Gloo, so their algorithm, protocol, channel count or topology cannot
change a bit.  Bytes moved: (W-1)/W of the bucket twice, the same as a ring all-reduce.

Inside a rank (accumulate.py, one protocol per case behind one interface).  Tier 3 accumulates the local
micro-batches in autograd's natural left fold (``FoldSum``: identical for a fixed world size, cheapest in memory).
Tier 4 (world-size invariance) combines the M micro-batch gradients of a step by one balanced binary tree over their
global indices 0..M-1: rank r owns the aligned block [r*M/W, (r+1)*M/W) and builds the block's subtree with a binary
counter (``CounterSum``; ``OffloadedCounterSum`` keeps its waiting partials in host memory), and ``tree_sum_rows``
over ranks applies the tree's top levels.  With M and W powers of two the result is the same tree whatever W is.

The step gradient is the tree sum times 1/M (exact for M a power of two).  Every other reduction that feeds the update
is canonical too: the loss mean (``tree_sum_rows`` over the M micro-batch losses in index order) and the gradient norm
(``exact_sumsq``: squares rounded once to a fixed point, summed as integers, so no split of the elements matters).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from dettrain.dist import all_gather_flat
from dettrain.errors import UserError
from dettrain.kernels import norm as _norm
from dettrain.kernels import rowsum as _rowsum
from dettrain.kernels.rowsum import tree_sum_rows_torch  # the tree's definition, beside its Triton pass
from dettrain.sync.accumulate import local_sum
from dettrain.tiers import policy

CHUNK = 1024  # elements; granularity of bucket/shard boundaries and of the gradient-norm partial sums


def tree_sum_rows(x: torch.Tensor) -> torch.Tensor:
    """Sum the rows of ``x`` (shape (n, ...)) by a fixed pairwise tree, in place; returns ``x[0]``.

    Level s = 1, 2, 4, ...: row i += row i+s for every i that is a multiple of 2s with i+s < n.  For n a power of two
    this is the balanced binary tree over row indices; rows of zeros appended at the end never change the result.
    On CUDA (fp32 rows, Triton present) one kernel pass per eight rows does the same additions
    (``kernels/rowsum.py``)."""
    if x.shape[0] > 1 and x.dtype == torch.float32 and _rowsum.available(x):  # one row is its own sum: no pass
        _rowsum.tree_sum_rows_into(x, x[0])
        return x[0]
    return tree_sum_rows_torch(x)


def tree_sum_rows_into(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out`` = ``tree_sum_rows(x)``, bit for bit, with the tree's last addition written straight into ``out``
    (no pass to copy row 0 out); ``x`` is clobbered.  The last level of the tree is the single addition
    row 0 + row s, s the largest power of two below n.  On CUDA: ``kernels/rowsum.py``, as ``tree_sum_rows``.

    bf16 rows into an fp32 ``out`` (FSDP2's bf16 reduce-scatter input, engines/fsdp2.py): the tree of the rows
    widened to fp32, which is exact, so the bits are those of fp32 rows holding the same values."""
    if out.dtype == torch.float32 and _rowsum.available(x) and out.is_contiguous():
        return _rowsum.tree_sum_rows_into(x, out)
    if x.dtype != out.dtype:
        x = x.to(out.dtype)  # widening bf16 -> fp32 is exact (a copy; x is clobbered anyway)
    n, s = x.shape[0], 1
    if n == 1:
        return out.copy_(x[0])
    while 2 * s < n:
        x[0 : n - s : 2 * s].add_(x[s:n : 2 * s])
        s *= 2
    return torch.add(x[0], x[s], out=out)


class FlatLayout:
    """Canonical flat layout of a model's parameters, and its buckets and shards for one world size."""

    def __init__(self, model: nn.Module, world: int, bucket_mb: float) -> None:
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        named.reverse()  # canonical order: backward produces the last layers' gradients first
        self.entries: list[tuple[str, nn.Parameter, int, int]] = []
        off = 0
        for n, p in named:
            self.entries.append((n, p, off, p.numel()))
            off += p.numel()
        self.numel = off
        self.world = world
        align = world * CHUNK
        self.padded = max(align, -(-off // align) * align)
        want = max(1, int(bucket_mb * (1 << 20)) // 4)
        bsize = max(align, -(-want // align) * align)
        self.buckets = [(a, min(a + bsize, self.padded)) for a in range(0, self.padded, bsize)]
        # which buckets each parameter overlaps
        self.param_buckets: list[range] = []
        for _, _, o, k in self.entries:
            self.param_buckets.append(range(o // bsize, (o + k - 1) // bsize + 1))
        self.bsize = bsize

    def segments(self) -> list[tuple[str, int, int]]:
        """(name, start, end) of every parameter in the flat index space (for per-tensor fingerprints)."""
        return [(n, o, o + k) for n, _, o, k in self.entries]

    def shard(self, b: int, rank: int) -> tuple[int, int]:
        a, e = self.buckets[b]
        s = (e - a) // self.world
        return a + rank * s, a + (rank + 1) * s

    def own_shards(self, rank: int) -> list[tuple[int, int]]:
        return [self.shard(b, rank) for b in range(len(self.buckets))]


class CanonicalReducer:
    """Owns the flat parameter and gradient buffers and reduces gradients in canonical order.

    Usage per optimizer step with L local micro-batches::

        reducer.begin_step(L)
        for k in range(L):
            reducer.begin_micro(k)
            loss_k.backward()          # hooks copy gradients and launch buckets during the last backward
            reducer.end_micro(k)
        reducer.finish(scale=1/M)      # waits, sums, scales; full gradient (or own shards) in reducer.grad
    """

    def __init__(self, model: nn.Module, rank: int, world: int, bucket_mb: float, tier: int,
                 shard: bool, device: torch.device, offload: bool = False) -> None:
        self.rank, self.world, self.tier, self.shard = rank, world, tier, shard
        # tier 4: each micro-batch's gradient is a leaf of the tree over global micro-batch indices
        self.invariant = policy(tier).world_invariant
        self.layout = FlatLayout(model, world, bucket_mb)
        L = self.layout
        # the parameters become views into one flat fp32 buffer: all_gather of updated shards lands in place
        self.param = torch.zeros(L.padded, dtype=torch.float32, device=device)
        for _, p, o, k in L.entries:
            if p.dtype != torch.float32:
                raise UserError(f"parameter dtype {p.dtype}: tiers 3-4 keep fp32 master weights; build the model "
                                 "in fp32 and use autocast for lower precision")
            self.param[o : o + k].copy_(p.detach().reshape(-1))
            p.data = self.param[o : o + k].view_as(p)
        self.grad = torch.zeros_like(self.param)
        # receive buffer of the all_to_alls: bucket b receives into recv[a:e] viewed as (W, S), and after the tree
        # its row 0 (the summed shard) is the all_gather's input.  Every bucket is in flight until finish(), so it
        # peaks at the size of the flat buffer at the end of backward.  On the CPU it is kept (fresh pages cost
        # more than the copies); on CUDA it is released after the step so it never coexists with activations.
        self._recv: torch.Tensor | None = None
        self._keep_recv = device.type != "cuda"
        self._gloo = world > 1 and dist.get_backend() == "gloo"
        self._views: dict[int, list[torch.Tensor]] = {}  # id(buffer) -> its per-parameter views
        # how this rank sums its micro-batches into grad: the fold (tier 3), the counter's tree (tier 4), the tree
        # with its waiting partials in host memory (tier 4, dist.offload_partials): accumulate.py
        self.local = local_sum(self.invariant, offload, self.grad, self._bind_grads, self._adopt, L.buckets)
        self.host = self.local.host
        self._hooks = [p.register_post_accumulate_grad_hook(self._make_hook(i))
                       for i, (_, p, _, _) in enumerate(L.entries)]
        # the watched backward (the last one, or the offload's streamed one): buckets complete in index order
        self._pending: list[int] = []
        self._ready: list[bool] = []
        self._next = 0
        self._works: list[tuple[int, torch.Tensor, object]] = []
        self._last = False
        self._local_micro = 1
        self.overlap = True  # False: launch every bucket only after backward (the benchmark's baseline)

    @property
    def spares_peak(self) -> int:
        """The most spare gradient buffers the local sum held at once (tests, benchmarks)."""
        return self.local.spares_peak

    # ---- hooks ------------------------------------------------------------------------------------------
    def _make_hook(self, i: int):
        # a weak reference: the hook lives in autograd's C++ state, where Python's collector cannot see a cycle
        # back to this reducer, so a strong one would keep the reducer and its flat buffers alive forever
        ref = weakref.ref(self)

        def hook(p: torch.Tensor) -> None:
            r = ref()
            if r is not None and r._watching:  # other micro-batches accumulate in the bound views
                r._take(i, p)
        return hook

    def _grad_views(self, buf: torch.Tensor) -> list[torch.Tensor]:
        """One view of ``buf`` per parameter, made once per buffer (the buffers live across steps): binding and
        checking the gradients of a micro-batch then dispatches no op per parameter.  A buffer the engine drops
        (offload) takes its views with it: the entry goes when the buffer object does (the views hold its storage,
        not the object)."""
        views = self._views.get(id(buf))
        if views is None:
            views = [buf[o : o + k].view_as(p) for _, p, o, k in self.layout.entries]
            self._views[id(buf)] = views
            weakref.finalize(buf, self._views.pop, id(buf), None)
        return views

    def _bind_grads(self, dst: torch.Tensor) -> None:
        """Make every p.grad a view of ``dst`` (zeroed by the caller): autograd then accumulates in place into the
        flat buffer, so no separate gradient tensors are allocated and ``_take`` has nothing to copy."""
        for (_, p, _, _), v in zip(self.layout.entries, self._grad_views(dst)):
            p.grad = v

    def _take(self, i: int, p: torch.Tensor) -> None:
        """Move parameter i's gradient into the flat buffers; pass on the buckets this completes (watched
        backward only)."""
        _, _, o, k = self.layout.entries[i]
        dst = self.local.buffer()  # tier 4 too: the last pair accumulates in grad
        if p.grad.data_ptr() != dst[o:].data_ptr():  # a gradient autograd allocated itself (not our view)
            dst[o : o + k].copy_(p.grad.reshape(-1))
        p.grad = None  # flush: the flat buffer holds it now, no need for this memory any more
        if not self._ready[i]:
            self._mark_ready(i)
            if self.overlap or not self._last:  # the streamed backward copies out as it goes, whatever overlap
                self._pass_ready()

    def _mark_ready(self, i: int) -> None:
        self._ready[i] = True
        for b in self.layout.param_buckets[i]:
            self._pending[b] -= 1

    def _pass_ready(self) -> None:
        """Hand on every complete bucket, strictly in bucket-index order (the k-th collective on every rank is
        bucket k): the last backward launches it, the streamed one gives it to the local sum to copy out."""
        while self._next < len(self.layout.buckets) and self._pending[self._next] == 0:
            if self._last:
                self._launch(self._next)
            else:
                self.local.bucket_done(self._next)
            self._next += 1

    def _launch(self, b: int) -> None:
        a, e = self.layout.buckets[b]
        sl = slice(a, e)
        self.local.finish_bucket(b, sl)  # grad[sl] = this rank's whole sum
        if self.world == 1:
            self._works.append((b, self.grad[sl].view(1, -1), None))
            return
        recv = self.recv()[sl]
        work = dist.all_to_all_single(recv, self.grad[sl], async_op=True)
        self._works.append((b, recv.view(self.world, -1), work))

    def _all_gather(self, out: torch.Tensor, rows: torch.Tensor):
        """Async all_gather of ``rows[0]`` (this rank's shard) into ``out``; ``rows`` is a (W, S) scratch.

        Gloo's all_gather runs 2-3x slower than its all_to_all for the same bytes on these machines (BENCHMARKS.md),
        so on Gloo the shard is replicated into every row and sent with all_to_all_single: row j goes to rank j, the
        same bytes as an all_gather.  Either way no arithmetic happens in the backend."""
        if self._gloo:
            rows[1:].copy_(rows[0].expand(self.world - 1, -1))
            return dist.all_to_all_single(out, rows.reshape(-1), async_op=True)
        return all_gather_flat(out, rows[0], async_op=True)

    # ---- step protocol ----------------------------------------------------------------------------------
    def begin_step(self, local_micro: int) -> None:
        self.local.begin_step(local_micro)
        self._local_micro = local_micro
        self._works.clear()

    def begin_micro(self, k: int) -> None:
        self._last = k == self._local_micro - 1
        self.local.begin_micro(k)
        if self._watching:  # every parameter's gradient is pending in every bucket it overlaps
            self._pending = [0] * len(self.layout.buckets)
            for rng in self.layout.param_buckets:
                for b in rng:
                    self._pending[b] += 1
            self._ready = [False] * len(self.layout.entries)
            self._next = 0

    @property
    def _watching(self) -> bool:
        """This backward is followed parameter by parameter: the last one, or the offload's streamed one."""
        return self._last or self.local.streaming

    def end_micro(self, k: int) -> None:
        if self._watching:
            self._take_unready()
        self.local.end_micro(k)
        if self._last:
            self._pass_ready()

    def _take_unready(self) -> None:
        # parameters whose hook did not fire in this backward (unused there, or no grad at all)
        for i, (_, p, _, _) in enumerate(self.layout.entries):
            if not self._ready[i]:
                if p.grad is not None:
                    self._take(i, p)
                else:
                    self._mark_ready(i)
        if not self._last:
            self._pass_ready()

    def finish(self, scale: float) -> None:
        """Wait for the all_to_alls, sum shards in tree order, scale, and all_gather (unless sharded)."""
        gathers = []
        for b, recv, work in self._works:
            if work is not None:
                work.wait()
            shard = tree_sum_rows(recv)
            if scale != 1.0:  # one micro-batch: x * 1.0 == x, skip the pass over the bucket
                shard.mul_(scale)
            lo, hi = self.layout.shard(b, self.rank)
            if self.world == 1:
                continue  # recv is a view of self.grad: already in place
            if self.shard:
                self.grad[lo:hi].copy_(shard)
            else:  # the summed shard (row 0 of recv) goes straight to every rank, this one included
                a, e = self.layout.buckets[b]
                gathers.append(self._all_gather(self.grad[a:e], recv))
        for w in gathers:
            w.wait()
        self._works.clear()
        if not self.shard:
            self._release_recv()

    def _adopt(self, buf: torch.Tensor) -> None:
        """Copy into ``buf`` any gradient autograd allocated itself instead of accumulating into our view (an
        in-place accumulation keeps the very tensor ``_bind_grads`` set)."""
        for (_, p, _, _), v in zip(self.layout.entries, self._grad_views(buf)):
            if p.grad is not None and p.grad is not v:
                v.copy_(p.grad)

    # ---- canonical reductions ---------------------------------------------------------------------------
    def owned(self) -> list[tuple[int, int]]:
        """Index ranges of the flat buffers this rank holds valid gradient (and, sharded, optimizer state) for."""
        if self.shard and self.world > 1:
            return self.layout.own_shards(self.rank)
        return [(0, self.layout.padded)]

    def grad_norm(self) -> float:
        """``grad_norm_tensor`` read on the host (one sync)."""
        return float(self.grad_norm_tensor())

    def grad_norm_tensor(self) -> torch.Tensor:
        """L2 norm of the reduced gradient (``canonical_norm``): the same bits for every bucket size, sharding,
        world size (tier 4) and engine; a 0-dim fp64 device tensor, no host sync.  A collective when sharded (each
        rank holds only its shards)."""
        N = self.layout.numel
        sharded = self.shard and self.world > 1
        parts = [self.grad[a:min(b, N)] for a, b in self.owned() if a < N]
        return canonical_norm(parts, self.world if sharded else 1)

    def named_grad_params(self) -> Iterator[tuple[str, torch.Tensor]]:
        for n, _, o, k in self.layout.entries:
            yield n, self.grad[o : o + k]

    def gather_params(self) -> None:
        """After a sharded update: every rank's updated shards -> the full flat parameter buffer."""
        if not (self.shard and self.world > 1):
            return
        works = []
        for b, (a, e) in enumerate(self.layout.buckets):
            lo, hi = self.layout.shard(b, self.rank)
            rows = self.recv()[a:e].view(self.world, -1)  # the input must not alias the output; recv is free now
            rows[0].copy_(self.param[lo:hi])
            works.append(self._all_gather(self.param[a:e], rows))
        for w in works:
            w.wait()
        self._release_recv()

    def recv(self) -> torch.Tensor:
        if self._recv is None:
            self._recv = torch.empty_like(self.param)
        return self._recv

    def _release_recv(self) -> None:
        if not self._keep_recv:
            self._recv = None


# ---- the canonical gradient norm (one definition for every engine) ----------------------------------------
NORM_UNIT_BITS = 52  # the largest square maps just below 2^52 units: an exact integer in fp64
NORM_LIMB_BITS = 26  # each rounded square splits into two int64 limbs of at most 26 bits
NORM_CHUNK = 1 << 24  # elements per pass (bounds the fp64 temporaries)


def _limb_kernel(parts: list[torch.Tensor]):
    """dettrain.kernels.norm when every part is an fp32 CUDA tensor and Triton is there, else None (torch path).
    DETTRAIN_NORM_TORCH=1 forces the torch path (tests, benchmarks; ``kernels.norm.available``)."""
    if not parts or not all(p.is_cuda and p.dtype == torch.float32 for p in parts):
        return None
    return _norm if _norm.available() else None


def canonical_norm(parts: list[torch.Tensor], world: int, local_max: torch.Tensor | None = None) -> torch.Tensor:
    """The gradient norm the flat and FSDP2 engines report and clip with, at every tier: ``sqrt(exact_sumsq_tensor)``,
    torch's fp64 square root on the parts' device (0-dim, no host sync).  One definition for the trainer, those
    engines and ``dettrain.api``, so their ledgers agree to the bit.  ``local_max``: see ``exact_sumsq_tensor``."""
    return torch.sqrt(exact_sumsq_tensor(parts, world, local_max))


def exact_sumsq(parts: list[torch.Tensor], world: int) -> float:
    """``exact_sumsq_tensor`` read on the host (one sync)."""
    return float(exact_sumsq_tensor(parts, world))


def exact_sumsq_tensor(parts: list[torch.Tensor], world: int, local_max: torch.Tensor | None = None) -> torch.Tensor:
    """Sum of squares of every element of ``parts`` over all ranks, the same bits for any split of the elements, as
    a 0-dim fp64 tensor on the parts' device, computed without a host sync (the training step stays queued ahead of
    the device; the step line reads it with the fingerprints).

    The global max |x| sets a scale 2^s so that the largest square is below 2^52; each square (exact in fp64 for
    fp32 input) is scaled by 2^s (exact), rounded to an integer (round half to even: elementwise, so where an element
    lives cannot matter) and summed in two 26-bit int64 limbs.  Integer addition is associative, so the total does
    not depend on order, sharding, bucketing or world size.  Squares below 2^-53 of the largest are dropped: the
    relative error of the sum is below numel * 2^-53.  The integer total (hi * 2^26 + lo, up to 86 bits) is rounded
    to fp64 once, to nearest, ties to even (``_round_limbs``), then scaled by 2^-s: the value Python's
    ``math.ldexp(float(hi << 26 | lo), -s)`` gives.  inf or nan anywhere: max^2 (the non-finite check stops the
    run); all zero: 0.  A collective when ``world`` > 1 (every rank calls it).  ``local_max``: max |x| over this
    rank's parts when the caller already has it (``kernels.norm.finish_`` finds it in the pass that scales the
    gradient); else each part is read once for it."""
    parts = [p.reshape(-1) for p in parts if p.numel()]
    dev = parts[0].device if parts else torch.device("cpu")
    if local_max is not None:
        m = local_max.float().reshape(1).to(dev)
    else:
        m = _norm.local_max(parts).to(dev)
    if world > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX)  # max is exact in any order
    mx = m[0].double()
    finite = torch.isfinite(mx)
    # mx^2 < 2^e, so mx^2 * 2^s < 2^52 (a non-finite max gets s = 0: its limbs are discarded below)
    e = torch.frexp(torch.where(finite, mx * mx, 1.0)).exponent.to(torch.int64)
    s = NORM_UNIT_BITS - e
    scale = _pow2(s)
    kernel = _limb_kernel(parts)
    if kernel is not None:  # CUDA: one pass over every part in one launch, the same integers (kernels/norm.py)
        limbs = kernel.sumsq_limbs(parts, scale, NORM_LIMB_BITS)
    else:
        down, up = 2.0**-NORM_LIMB_BITS, -(2.0**NORM_LIMB_BITS)
        limbs = torch.zeros(2, dtype=torch.int64, device=dev)  # integer totals: exact, no host sync per chunk
        for p in parts:
            for a in range(0, p.numel(), NORM_CHUNK):
                q = p[a : a + NORM_CHUNK].double().square_().mul_(scale).round_()  # integers below 2^52
                hi = (q * down).floor_()  # the high 26 bits
                q.add_(hi, alpha=up)  # the low 26 bits (q - 2^26 hi is an integer below 2^26: computed exactly)
                # a chunk's limb sums stay below 2^24 * 2^26 = 2^50 < 2^53: every partial sum is an exact fp64
                # integer, so these fp64 sums are exact in any order; across chunks they add as int64
                limbs += torch.stack((hi.sum(), q.sum())).to(torch.int64)
    if world > 1:
        dist.all_reduce(limbs)  # integer sum: exact, whatever the backend's order
    total = _round_limbs(torch.where(finite, limbs, 0)) * _pow2(-s)  # a power of two: exact
    return torch.where(finite, total, mx * mx)


def _pow2(n: torch.Tensor) -> torch.Tensor:
    """2^n in fp64, exactly, for int64 ``n`` in [-1022, 1023], built from its bit pattern: exact by construction,
    whatever dtype torch.ldexp or pow would compute the power in."""
    return ((n + 1023) << 52).view(torch.float64)


def _round_limbs(limbs: torch.Tensor) -> torch.Tensor:
    """fp64 of the integer hi * 2^26 + lo (int64 limbs, both >= 0 and below 2^62), rounded to nearest, ties to even,
    on the device: Python's ``float(hi << 26 | lo)``.  The total is rewritten as a * 2^52 + c with 0 <= c < 2^52;
    when a > 0 it has 52 + bitlen(a) bits, and keeping the top 53 drops the low k = bitlen(a) - 1 bits of c."""
    hi, lo = limbs[0], limbs[1]
    L, unit = NORM_LIMB_BITS, 2 * NORM_LIMB_BITS  # 26, 52
    c = ((hi & ((1 << L) - 1)) << L) + lo  # below 2^52 + 2^62: an int64
    a = (hi >> L) + (c >> unit)
    c = c & ((1 << unit) - 1)
    k = (torch.frexp(a.double()).exponent.to(torch.int64) - 1).clamp(min=0)  # a < 2^53: its fp64 is exact
    top = (a << (unit - k)) + (c >> k)  # the top 53 bits: below 2^53
    rest = c & ((1 << k) - 1)
    half = (1 << k) >> 1  # k = 0: nothing is dropped, rest = half = 0
    up = (rest > half) | ((rest == half) & (k > 0) & ((top & 1) == 1))
    top = top + up.to(torch.int64)  # may reach 2^53: still exact in fp64
    return top.double() * _pow2(k)  # exact: top < 2^54, k <= 34


def canonical_mean(local_values: torch.Tensor, world: int, order: list[int] | None = None) -> torch.Tensor:
    """Mean of per-micro-batch scalars over the global batch, the same at every world size.

    ``local_values`` holds this rank's M/W values; all ranks' values are gathered (rank-major), put into global
    micro-batch index order (``order[i]`` is the global index of gathered position i; None: already in order) and
    summed by ``tree_sum_rows`` (fp32), then divided by M."""
    vals = local_values.detach().float().reshape(-1)
    if world > 1:
        full = torch.empty(world * vals.numel(), dtype=vals.dtype, device=vals.device)
        all_gather_flat(full, vals)
    else:
        full = vals.clone()
    if order is not None and list(order) != sorted(order):
        full = full[torch.argsort(torch.tensor(order, device=full.device))]
    M = full.numel()
    return tree_sum_rows(full.view(M, 1))[0] / M
