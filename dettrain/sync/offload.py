"""Tier 4's partial sums in host memory (``dist.offload_partials``): the flat engine's final partials
(``HostPartials``), the FSDP2 engine's every counter entry (``HostLevels``, ``HostCounter``); both queue their copies
through ``SideCopies``.

The flat engine.  At tier 4 a rank with L micro-batches a step holds up to log2(L/2) partial sums of the tree beside
the gradient being built (accumulate.py, ``BinaryCounter``): a whole fp32 gradient each on one rank.  A partial is
*final* once no later subtree of its level will be merged into it; from then on it is only read, once per bucket,
when the last pair's buckets are finished.  ``HostPartials`` keeps the final partials in host memory between those
two moments:

- the pair just before the last one (micro-batches L-4, L-3), whose partial is always final and never merged,
  accumulates in the gradient buffer itself and is copied out bucket by bucket while its second backward runs, as
  each bucket's gradients are complete, so the copy overlaps the backward (and the next forward); the last pair waits
  for those copies just before its first backward zeroes the buffer.  With 4 micro-batches a rank this is the whole
  tree: the device holds one gradient buffer, as at tier 3;
- a partial that becomes final through a merge (L >= 8) is copied out whole right after the merge;
- during the last micro-batch's backward, each bucket's slice of every host partial comes back a few buckets ahead
  of the bucket's finishing (``stage_mb`` of device memory at most) and is added where the device partial would have
  been.

Copies are exact, so the sums see the same values in the same order: the bits do not change
(``tests/test_collectives.py``).  On CUDA the copies run on a side stream into pinned host memory and the device
buffer is handed back to the caching allocator with ``record_stream``, so activations can reuse it as soon as the
copy is done.  On the CPU host and device are the same memory: the copies are plain (what the CPU tests exercise).
"""

from __future__ import annotations

import collections

import torch


class SideCopies:
    """The copies between device and host memory that both offloads queue, all on one side stream, so they run in
    the order they are queued and overlap the compute on the current stream.

    ``out(host, dev)`` queues dev -> host after the work queued so far on the current stream (which wrote dev);
    ``release(dev)`` hands dev's memory back to the caching allocator once the copies queued so far are done;
    ``back(hosts)`` queues a device copy of each host tensor and returns them with the event that marks them done;
    ``take(bufs, done)`` makes them usable on the current stream; ``wait_out()`` orders the current stream's
    later work after every copy queued so far.  On the CPU (host and device the same memory) the copies are plain
    and run at once."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.side = torch.cuda.Stream(device) if self.cuda else None

    def out(self, host: torch.Tensor, dev: torch.Tensor) -> None:
        if not self.cuda:
            host.copy_(dev)
            return
        self.side.wait_stream(torch.cuda.current_stream(self.device))  # after the work that wrote dev
        with torch.cuda.stream(self.side):
            host.copy_(dev, non_blocking=True)

    def release(self, dev: torch.Tensor) -> None:
        if self.cuda:
            dev.record_stream(self.side)  # its memory is reusable once the copies queued so far are done

    def back(self, hosts: list[torch.Tensor]) -> tuple[list[torch.Tensor], object]:
        if not self.cuda:
            return [h.clone() for h in hosts], None
        with torch.cuda.stream(self.side):
            bufs = [h.to(self.device, non_blocking=True) for h in hosts]
            done = torch.cuda.Event()
            done.record(self.side)
        return bufs, done

    def take(self, bufs: list[torch.Tensor], done: object) -> None:
        if not self.cuda:
            return
        cur = torch.cuda.current_stream(self.device)
        cur.wait_event(done)
        for t in bufs:
            t.record_stream(cur)  # allocated on the side stream, used on this one

    def wait_out(self) -> None:
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_stream(self.side)


class HostPartials:
    """Host copies of final partial sums, and their staged device slices while the last buckets finish.

    ``take()`` gives a host buffer for one partial of this step (pooled across steps; pinned on CUDA);
    ``copy_out(host, dev, sl)`` queues dev[sl] -> host[sl] after the device work queued so far; ``release(dev)``
    lets the allocator reuse ``dev`` once the queued copies are done (the caller then drops its references);
    ``begin_finish(hosts)`` starts bringing back the first buckets' slices of ``hosts`` and ``fetch(b)`` returns
    bucket b's slices (on the device, ready for the current stream), staging the next ones."""

    def __init__(self, numel: int, device: torch.device, buckets: list[tuple[int, int]],
                 stage_mb: float = 256.0) -> None:
        self.numel, self.device, self.buckets = numel, device, buckets
        self.copies = SideCopies(device)
        self.cuda = self.copies.cuda
        self.stage_bytes = int(stage_mb * 2**20)
        self._pool: list[torch.Tensor] = []
        self._used = 0
        self._hosts: list[torch.Tensor] = []
        self._staged: dict[int, tuple[list[torch.Tensor], object]] = {}
        self._ahead = 0
        self.copied_out = 0  # bytes copied to the host in this step (for tests and benchmarks)

    def reset(self) -> None:
        """A new step: every pooled host buffer is free again (the previous step's reads of them are queued on the
        side stream before any new copy into them)."""
        self._used = 0
        self._hosts = []
        self._staged.clear()
        self._ahead = 0
        self.copied_out = 0

    def take(self) -> torch.Tensor:
        if self._used == len(self._pool):
            self._pool.append(torch.empty(self.numel, dtype=torch.float32, pin_memory=self.cuda))
        self._used += 1
        return self._pool[self._used - 1]

    def copy_out(self, host: torch.Tensor, dev: torch.Tensor, sl: slice) -> None:
        self.copied_out += dev[sl].numel() * dev.element_size()
        self.copies.out(host[sl], dev[sl])

    def wait_out(self) -> None:
        """Work queued on the current stream from now on runs after the copies to the host queued so far (before
        a buffer that was copied out is written again)."""
        self.copies.wait_out()

    def release(self, dev: torch.Tensor) -> None:
        self.copies.release(dev)

    # ---- the way back -----------------------------------------------------------------------------------------
    def begin_finish(self, hosts: list[torch.Tensor]) -> None:
        self._hosts = hosts
        self._staged.clear()
        self._ahead = 0
        self._stage_ahead(0)

    def _stage_ahead(self, b: int) -> None:
        """Stage buckets b, b+1, ... while the staged bytes stay within ``stage_bytes`` (at least bucket b)."""
        if not self.cuda or not self._hosts:
            return
        per = 4 * len(self._hosts)
        staged = sum((e - a) * per for a, e in (self.buckets[i] for i in self._staged))
        while self._ahead < len(self.buckets):
            a, e = self.buckets[self._ahead]
            if self._ahead > b and staged + (e - a) * per > self.stage_bytes:
                break
            self._staged[self._ahead] = self.copies.back([h[a:e] for h in self._hosts])
            staged += (e - a) * per
            self._ahead += 1

    def fetch(self, b: int) -> list[torch.Tensor]:
        """Bucket b's slice of each host partial, in the order given to ``begin_finish``, usable on the current
        stream; buckets are fetched in increasing order."""
        a, e = self.buckets[b]
        if not self.cuda:
            return [h[a:e] for h in self._hosts]
        self._stage_ahead(b)
        bufs, done = self._staged.pop(b)
        self.copies.take(bufs, done)
        self._stage_ahead(b + 1)
        return bufs


# ---- the FSDP2 engine: every entry of the counters in host memory ---------------------------------------------------
class HostLevels:
    """Pinned host memory for the FSDP2 engine's tier-4 counters (``dist.offload_partials``, engines/fsdp2.py).

    The engine keeps one binary counter per parameter shard (``BinaryCounter``'s merges over rounds).  A counter
    holds at most one entry per tree level, so level k of parameter i has one fixed place: ``host(i, k)``, a slice
    of one flat fp32 buffer per level (allocated the first time the level is used, kept across steps).  Every entry
    lives there; the device keeps none of them between rounds:

    - ``put(i, k, dev)`` queues the copy dev -> host(i, k) on a side stream, after the work queued so far on the
      current stream, and hands ``dev``'s memory back to the allocator once that copy is done;
    - ``expect(reads)`` is told, before a round's backward, which entries its hooks will read, in order;
      copies of them come back on the side stream, a little ahead of the hooks (up to ``stage_bytes`` of device
      memory, plus one entry);
    - ``get(i, k)`` returns the device copy of host(i, k), usable on the current stream (staging it now if it was
      not expected).

    Every copy runs on the one side stream, in the order it is queued: a read of host(i, k) is queued after the
    write that filled it (an earlier round) and before the next write to it (a later one; within one round no place
    is both read and written: a round's push merges the entries of levels 0 ... c-1 that exist at its start and
    writes level c, which does not, and the last round only reads).  Copies are exact, so the merges and the finish
    add the same values in the same order as on the device: the bits do not change.  On the CPU host and device are
    the same memory: the copies are plain (the CPU tests run this path)."""

    STAGE_BYTES = 256 * 2**20  # device memory the copies staged ahead take, plus one entry at most

    def __init__(self, sizes: list[int], device: torch.device, stage_bytes: int = STAGE_BYTES) -> None:
        self.sizes = list(sizes)
        self.offsets = [0]
        for n in self.sizes:
            self.offsets.append(self.offsets[-1] + n)
        self.numel = self.offsets[-1]
        self.device = device
        self.copies = SideCopies(device)
        self.cuda = self.copies.cuda
        self.stage_bytes = stage_bytes
        self.levels: dict[int, torch.Tensor] = {}  # level -> its flat host buffer (levels a counter never holds: none)
        self._staged: dict[tuple[int, int], tuple[torch.Tensor, object]] = {}
        self._staged_bytes = 0
        self._queue: collections.deque[tuple[int, int]] = collections.deque()
        self.copied_out = 0  # bytes copied to the host so far (tests, benchmarks)
        self.copied_in = 0  # bytes brought back

    @property
    def host_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.levels.values())

    def host(self, i: int, level: int) -> torch.Tensor:
        if level not in self.levels:
            self.levels[level] = torch.empty(self.numel, dtype=torch.float32, pin_memory=self.cuda)
        return self.levels[level][self.offsets[i] : self.offsets[i + 1]]

    def put(self, i: int, level: int, dev: torch.Tensor) -> None:
        h = self.host(i, level)
        self.copied_out += h.numel() * 4
        self.copies.out(h, dev.reshape(-1))
        self.copies.release(dev)

    def expect(self, reads: list[tuple[int, int]]) -> None:
        """The entries the coming round's hooks read, in the order they read them; copies not read since the last
        call are dropped (their memory goes back to the allocator)."""
        self._staged.clear()
        self._staged_bytes = 0
        self._queue = collections.deque(reads)
        self._stage()

    def _stage_one(self, key: tuple[int, int]) -> None:
        h = self.host(*key)
        self.copied_in += h.numel() * 4
        (buf,), done = self.copies.back([h])
        self._staged[key] = (buf, done)
        self._staged_bytes += h.numel() * 4

    def _stage(self) -> None:
        while self._queue and (self._staged_bytes < self.stage_bytes or not self._staged):
            key = self._queue.popleft()
            if key not in self._staged:
                self._stage_one(key)

    def get(self, i: int, level: int) -> torch.Tensor:
        key = (i, level)
        if key not in self._staged:  # not expected (a hook out of the recorded order): stage it now
            self._stage_one(key)
        buf, done = self._staged.pop(key)
        self._staged_bytes -= buf.numel() * 4
        self.copies.take([buf], done)
        self._stage()
        return buf


class HostCounter:
    """``BinaryCounter`` with every entry in host memory (``HostLevels``), for parameter shard ``i``.

    ``push`` reads back the entries it merges with and adds them exactly as ``BinaryCounter.push`` does (earlier +
    later, into the earlier one's copy), then writes the merged subtree out; ``finish_`` adds every entry into
    ``out``, innermost first, as ``BinaryCounter.finish_`` does.  So the sums are the device counter's, bit for bit."""

    def __init__(self, host: HostLevels, i: int) -> None:
        self.host, self.i = host, i
        self.levels: list[int] = []  # the stack of the entries' levels; entry k lives at host.host(i, k)

    def reads(self, level: int | None) -> list[int]:
        """Levels the next ``push(x, level)`` reads (``None``: ``finish_``), in the order it reads them."""
        if level is None:
            return self.levels[::-1]
        out = []
        for lv in reversed(self.levels):
            if lv != level:
                break
            out.append(lv)
            level += 1
        return out

    def push(self, x: torch.Tensor, level: int = 0) -> None:
        while self.levels and self.levels[-1] == level:
            self.levels.pop()
            top = self.host.get(self.i, level)
            top.add_(x.reshape(-1))  # earlier subtree + later subtree (flat: the host keeps shards flat)
            x, level = top, level + 1
        self.host.put(self.i, level, x)
        self.levels.append(level)

    def finish_(self, out: torch.Tensor) -> None:
        for level in reversed(self.levels):
            out.add_(self.host.get(self.i, level).view_as(out))
        self.levels.clear()

    def reset(self) -> None:
        self.levels.clear()
