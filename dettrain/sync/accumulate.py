"""How one rank sums the gradients of its L local micro-batches into the flat gradient buffer, before the canonical
reducer (collectives.py) sums the ranks' buffers bucket by bucket.

Three protocols behind one interface (``LocalSum``); ``local_sum`` picks one for a tier:

- ``FoldSum`` (tier 3): the left fold ``((g_0 + g_1) + g_2) + ... + g_{L-1}``, autograd's own in-place
  accumulation into the zeroed buffer.  Fixed for a fixed world size.
- ``CounterSum`` (tier 4): the balanced binary tree over the L gradients in micro-batch order.  Each pair
  ``g_2j + g_2j+1`` accumulates in place in a zeroed buffer (the tree's lowest level), and a ``BinaryCounter`` merges
  the pairs as levels fill up (earlier subtree + later subtree).  The rank's tree is one aligned block of the tree
  over the whole step's micro-batches, so the reducer's tree over ranks completes the same tree at any world size.
- ``OffloadedCounterSum`` (tier 4, ``dist.offload_partials``): ``CounterSum``'s tree, the same additions in the same
  order, with every partial sum in host memory (offload.py, one counter per bucket) instead of device buffers.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dettrain.sync.offload import HostCounter, HostLevels


class BinaryCounter:
    """Pairwise accumulation of a sequence of subtrees, as a binary counter, in place.

    ``push(x, level)`` adds a subtree of 2^level leaves; when the counter holds an earlier subtree of the same level
    they merge (earlier + later, written into the earlier one's storage; the later one's storage is handed to
    ``release``).  After pushes totalling 2^j leaves in order, the single remaining entry is the balanced binary tree
    over the leaves in push order.  In place is bitwise the same as ``top + x``: IEEE addition is commutative and
    rounds once either way."""

    def __init__(self) -> None:
        self.stack: list[tuple[int, torch.Tensor]] = []

    def push(self, x: torch.Tensor, level: int = 0, release=None) -> None:
        while self.stack and self.stack[-1][0] == level:
            _, top = self.stack.pop()
            top.add_(x)  # earlier subtree + later subtree
            if release is not None:
                release(x)
            x, level = top, level + 1
        self.stack.append((level, x))

    def finish_(self, out: torch.Tensor, sl: slice, fetch=None) -> None:
        """out[sl] (holding the last subtree) becomes the whole tree, restricted to slice ``sl`` (elementwise, so
        slices can be finished independently as their buckets become ready).  ``fetch(j, e)``, when given, returns
        entry j's slice (a copy of ``e[sl]`` brought back from the host, sync/offload.py)."""
        acc = out[sl]
        for j in range(len(self.stack) - 1, -1, -1):
            e = self.stack[j][1]
            acc.add_(e[sl] if fetch is None else fetch(j, e))  # earlier subtrees + later ones, innermost first

    def reset(self) -> None:
        self.stack.clear()


class LocalSum:
    """The interface: the order in which one rank sums its micro-batch gradients into ``grad``.

    Per step: ``begin_step(L)``; for micro-batch k = 0 .. L-1: ``begin_micro(k)`` (binds the buffer autograd then
    accumulates into), the backward, ``end_micro(k)``.  Gradients autograd allocated itself go to ``buffer()``.
    During the last backward the reducer calls ``finish_bucket(b, sl)`` for each bucket as it completes (``sl`` its
    slice of the flat buffer): ``grad[sl]`` then holds the rank's whole sum there.  ``streaming``: this backward's
    buckets are handed to ``bucket_done(b)``, in index order, as they complete (only the offload streams).

    ``bind(buf)`` makes every parameter's ``.grad`` a view of ``buf``; ``adopt(buf)`` copies into ``buf`` any
    gradient autograd allocated instead of accumulating into that view (both are the reducer's)."""

    streaming = False
    spares_peak = 0  # the most spare gradient buffers held at once (tests, benchmarks)
    host: HostLevels | None = None

    def __init__(self, grad: torch.Tensor, bind: Callable[[torch.Tensor], None],
                 adopt: Callable[[torch.Tensor], None]) -> None:
        self.grad, self.bind, self.adopt = grad, bind, adopt
        self.L = 1

    def begin_step(self, local_micro: int) -> None:
        self.L = local_micro

    def begin_micro(self, k: int) -> None:
        pass

    def buffer(self) -> torch.Tensor:
        return self.grad

    def bucket_done(self, b: int) -> None:
        raise RuntimeError(f"{type(self).__name__} does not stream buckets")

    def end_micro(self, k: int) -> None:
        pass

    def finish_bucket(self, b: int, sl: slice) -> None:
        pass


class FoldSum(LocalSum):
    """Tier 3: ``grad`` = ``((0 + g_0) + g_1) + ... + g_{L-1}``, each addition autograd's in-place accumulation into
    the buffer bound once per step; nothing is left to add when a bucket finishes."""

    def begin_step(self, local_micro: int) -> None:
        super().begin_step(local_micro)
        self.grad.zero_()
        self.bind(self.grad)


class CounterSum(LocalSum):
    """Tier 4: ``grad`` = the balanced binary tree over ``g_0 .. g_{L-1}`` in micro-batch order (L a power of two).

    Pair j, ``(0 + g_2j) + g_2j+1``, accumulates in one zeroed buffer; each complete pair but the last is pushed to a
    ``BinaryCounter`` as a subtree of level 1, merging with earlier subtrees of its level.  The last pair accumulates
    in ``grad`` itself, and ``finish_bucket`` adds the counter's subtrees into it, innermost (latest) first.  The
    other pairs' buffers are spares (log2(L/2) of them at most), kept across steps."""

    def __init__(self, grad, bind, adopt) -> None:
        super().__init__(grad, bind, adopt)
        self.counter = BinaryCounter()
        self.spares: list[torch.Tensor] = []
        self.free: list[torch.Tensor] = []
        self.cur: torch.Tensor | None = None  # the buffer the current pair accumulates in

    def begin_step(self, local_micro: int) -> None:
        if local_micro & (local_micro - 1):
            raise ValueError(f"det.tier=4 needs a power-of-two number of micro-batches per rank, got {local_micro}")
        super().begin_step(local_micro)
        self.counter.reset()
        self.free = list(self.spares)

    def starts_pair(self, k: int) -> bool:
        """Micro-batch k is the first of a pair (2j, 2j+1)."""
        return k % 2 == 0

    def in_last_pair(self, k: int) -> bool:
        return k >= self.L - 2

    def begin_micro(self, k: int) -> None:
        if self.starts_pair(k):
            self.start_pair(self.grad if self.in_last_pair(k) else self.spare())

    def start_pair(self, buf: torch.Tensor) -> None:
        self.cur = buf
        self.cur.zero_()  # parameters unused by a micro-batch contribute zeros
        self.bind(self.cur)

    def buffer(self) -> torch.Tensor:
        return self.cur

    def end_micro(self, k: int) -> None:
        if not self.starts_pair(k) and not self.in_last_pair(k):  # a pair is complete: one level-1 subtree
            self.adopt(self.cur)
            self.counter.push(self.cur, level=1, release=self.free.append)

    def finish_bucket(self, b: int, sl: slice) -> None:
        self.counter.finish_(self.grad, sl)

    def spare(self) -> torch.Tensor:
        if not self.free:
            self.spares.append(torch.empty_like(self.grad))
            self.free.append(self.spares[-1])
            self.spares_peak = max(self.spares_peak, len(self.spares))
        return self.free.pop()


class OffloadedCounterSum(CounterSum):
    """Tier 4 with ``dist.offload_partials``: ``CounterSum``'s tree with every partial sum in host memory, so the
    device holds no gradient buffer beyond ``grad`` (tier 3's memory, plus a few buckets staged on their way back).

    With L >= 4 every pair accumulates in ``grad`` itself.  During the second backward of each pair but the last,
    each bucket, as soon as it is complete, is pushed onto that bucket's ``HostCounter`` (sync/offload.py): the host
    entries it merges with come back staged a few buckets ahead, are added exactly as ``BinaryCounter.push`` adds
    them (earlier + later, into the earlier one's copy), and the result goes to the host on a side stream.  The next
    pair waits for those copies before its first backward zeroes ``grad`` (its forward runs meanwhile).  The last
    pair's backward finishes each bucket by adding the host entries back in the counter's order.  The same values
    are added in the same order as on the device, so the bits do not change.  With L < 4 the last pair is the whole
    tree: nothing is offloaded."""

    def __init__(self, grad, bind, adopt, buckets: list[tuple[int, int]], stage_bytes: int = 128 * 2**20) -> None:
        super().__init__(grad, bind, adopt)
        self.buckets = buckets
        self.host = HostLevels([e - a for a, e in buckets], grad.device, stage_bytes=stage_bytes)
        self.counters = [HostCounter(self.host, b) for b in range(len(buckets))]

    @property
    def on_host(self) -> list[int]:
        """The levels of the partial sums waiting in host memory (every bucket's counter holds the same ones)."""
        return list(self.counters[0].levels) if self.counters else []

    def begin_step(self, local_micro: int) -> None:
        super().begin_step(local_micro)
        for c in self.counters:
            c.reset()
        self.host.copied_out = 0

    def offloads(self) -> bool:
        return self.L >= 4

    def begin_micro(self, k: int) -> None:
        self.streaming = self.offloads() and not self.starts_pair(k) and not self.in_last_pair(k)
        if not self.offloads():
            return super().begin_micro(k)
        if self.starts_pair(k):
            self.host.copies.wait_out()  # the previous pair's copies out of grad are done before grad is zeroed
            self.start_pair(self.grad)
        # the entries this backward's buckets read (merges, or the last one's finish), staged back in bucket order
        if self.streaming or k == self.L - 1:
            level = 1 if self.streaming else None
            self.host.expect([(b, lv) for b, c in enumerate(self.counters) for lv in c.reads(level)])

    def bucket_done(self, b: int) -> None:
        a, e = self.buckets[b]
        self.counters[b].push(self.grad[a:e], level=1, release=False)  # grad's memory stays: it is the buffer

    def end_micro(self, k: int) -> None:
        if not self.offloads():
            return super().end_micro(k)
        self.streaming = False

    def finish_bucket(self, b: int, sl: slice) -> None:
        if not self.offloads():
            return super().finish_bucket(b, sl)
        self.counters[b].finish_(self.grad[sl])


def local_sum(tier_invariant: bool, offload: bool, grad: torch.Tensor, bind, adopt,
              buckets: list[tuple[int, int]]) -> LocalSum:
    """The protocol for a tier: the counter's tree where the sum must not depend on the world size, else the fold."""
    if not tier_invariant:
        return FoldSum(grad, bind, adopt)
    if offload:
        return OffloadedCounterSum(grad, bind, adopt, buckets)
    return CounterSum(grad, bind, adopt)
