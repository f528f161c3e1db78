"""Tier 4's partial sums in host memory (``dist.offload_partials``): every entry of the binary counters that build
the tree over micro-batches waits in pinned host memory (``HostLevels``, ``HostCounter``), copied through
``SideCopies`` on a side stream.

At tier 4 a rank with L micro-batches a step holds up to log2(L/2) partial sums of the tree beside the gradient being
built (accumulate.py, ``BinaryCounter``): a whole fp32 gradient each on one rank.  Offloaded, the device holds none of
them between the moments they are written and read:

- the FSDP2 engine keeps one counter per parameter shard; each round's reduce-scatter output is pushed onto it;
- the flat engine keeps one counter per bucket of its flat gradient buffer (accumulate.py,
  ``OffloadedCounterSum``); every pair of micro-batches accumulates in that buffer, and during the pair's second
  backward each complete bucket is pushed (merged with the host entries it meets, then copied out), so the copies
  overlap the backward and the next forward.

A merge reads its host entries back a few entries ahead of the hook that adds them (``stage_bytes`` of device memory
at most, plus one entry). Copies are exact, so the sums see the same values in the same order: the bits do not change
(``tests/test_collectives.py``, ``tests/test_offload_gpu.py``). On CUDA the copies run on one side stream per direction
(``DETTRAIN_OFFLOAD_STREAMS=1``: one for both) into pinned host memory and each device buffer that only the copies still
read is handed back to the caching allocator with ``record_stream``. On the CPU host and device are the same memory:
the copies are plain (what the CPU tests exercise).
"""

from __future__ import annotations

import collections
import os

import torch

from dettrain.errors import UserError

STREAMS_ENV = "DETTRAIN_OFFLOAD_STREAMS"
"""2 (the default): the copies back to the device run on a stream of their own, so they can overlap the copies out
(``SideCopies``); 1: the copies of both directions share one side stream.  Never changes a bit (both forms pass
``tests/test_offload_gpu.py``); two streams are the default because flat tier 4 offloaded ran at 0.84-0.85x of tier 0
with them against 0.75-0.76x with one (H100, 125m micro-batch 4 and 1b micro-batch 2; BENCHMARKS.md, issue 41)."""


def copy_streams() -> int:
    """The number of side streams ``DETTRAIN_OFFLOAD_STREAMS`` asks for (1 or 2; unset: 2)."""
    value = os.environ.get(STREAMS_ENV, "2").strip()
    if value not in ("1", "2"):
        raise UserError(f"{STREAMS_ENV}={value!r} must be 1 (one side stream for the host copies of "
                        f"dist.offload_partials) or 2 (one per direction); unset it for the default, 2")
    return int(value)


class SideCopies:
    """The copies between device and host memory that both offloads queue, on side streams, so they overlap the
    compute on the current stream.

    ``out(host, dev)`` queues dev -> host after the work queued so far on the current stream (which wrote dev);
    ``release(dev)`` hands dev's memory back to the caching allocator once the copies out queued so far are done;
    ``back(hosts)`` queues a device copy of each host tensor and returns them with the event that marks them done;
    ``take(bufs, done)`` makes them usable on the current stream; ``wait_out()`` orders the current stream's
    later work after every copy out queued so far; ``reads_after_writes()`` orders the copies back queued from now
    on after every copy out queued so far.  On the CPU (host and device the same memory) the copies are plain and
    run at once.

    ``streams=1``: every copy runs on one side stream, in the order it is queued.  ``streams=2``: the copies back
    run on a second stream, so a copy back can run while a copy out does (the link moves both directions at once);
    their order against the copies out is then what ``reads_after_writes`` and the callers' waits make it
    (``HostLevels``)."""

    def __init__(self, device: torch.device, streams: int = 1) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.side = torch.cuda.Stream(device) if self.cuda else None
        self.reads = torch.cuda.Stream(device) if self.cuda and streams == 2 else self.side
        self.streams = streams

    def out(self, host: torch.Tensor, dev: torch.Tensor, after: object = None) -> None:
        """``after``: an event of the copies back (two streams) that this copy must follow: the last read of
        ``host``'s place, which this copy overwrites."""
        if not self.cuda:
            host.copy_(dev)
            return
        self.side.wait_stream(torch.cuda.current_stream(self.device))  # after the work that wrote dev
        if after is not None and self.reads is not self.side:
            self.side.wait_event(after)
        with torch.cuda.stream(self.side):
            host.copy_(dev, non_blocking=True)

    def release(self, dev: torch.Tensor) -> None:
        if self.cuda:
            dev.record_stream(self.side)  # its memory is reusable once the copies queued so far are done

    def back(self, hosts: list[torch.Tensor]) -> tuple[list[torch.Tensor], object]:
        if not self.cuda:
            return [h.clone() for h in hosts], None
        with torch.cuda.stream(self.reads):
            bufs = [h.to(self.device, non_blocking=True) for h in hosts]
            done = torch.cuda.Event()
            done.record(self.reads)
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

    def reads_after_writes(self) -> None:
        if self.cuda and self.reads is not self.side:
            self.reads.wait_stream(self.side)


# ---- every entry of the counters in host memory ----------------------------------------------------------------------
class HostLevels:
    """Pinned host memory for tier 4's counters (``dist.offload_partials``): one counter per piece ``i`` of the
    gradient, a parameter shard for the FSDP2 engine (engines/fsdp2.py), a bucket of the flat buffer for the flat
    engine (accumulate.py, ``OffloadedCounterSum``).

    Each piece's counter follows ``BinaryCounter``'s merges over rounds (FSDP2) or pairs (flat).  A counter
    holds at most one entry per tree level, so level k of piece i has one fixed place: ``host(i, k)``, a slice
    of one flat fp32 buffer per level (allocated the first time the level is used, kept across steps).  Every entry
    lives there; the device keeps none of them between rounds:

    - ``put(i, k, dev)`` queues the copy dev -> host(i, k) on a side stream, after the work queued so far on the
      current stream, and hands ``dev``'s memory back to the allocator once that copy is done;
    - ``expect(reads)`` is told, before a round's backward, which entries its hooks will read, in order;
      copies of them come back on the side stream, a little ahead of the hooks (up to ``stage_bytes`` of device
      memory, plus one entry);
    - ``get(i, k)`` returns the device copy of host(i, k), usable on the current stream (staging it now if it was
      not expected).

    A read of host(i, k) runs after the write that filled it (an earlier round) and before the next write to it (a
    later one); within one round no place is both read and written (a round's push merges the entries of levels
    0 ... c-1 that exist at its start and writes level c, which does not, and the last round only reads).  With one
    side stream (``streams=1``) that is the order the copies are queued in.  With two (``streams=2``, one per
    direction) the waits make it: ``expect`` makes the reads it stages, and every read until the next ``expect``,
    wait for the writes queued before it (the earlier rounds'), and a write waits for the last read queued from
    its place.  Copies are exact, so the merges and the finish add the same values in the same order as on the
    device: the bits do not change.  On the CPU host and device are the same memory: the copies are plain (the CPU
    tests run this path)."""

    STAGE_BYTES = 256 * 2**20  # device memory the copies staged ahead take, plus one entry at most

    def __init__(self, sizes: list[int], device: torch.device, stage_bytes: int = STAGE_BYTES,
                 streams: int | None = None) -> None:
        self.sizes = list(sizes)
        self.offsets = [0]
        for n in self.sizes:
            self.offsets.append(self.offsets[-1] + n)
        self.numel = self.offsets[-1]
        self.device = device
        self.copies = SideCopies(device, copy_streams() if streams is None else streams)
        self.cuda = self.copies.cuda
        self.stage_bytes = stage_bytes
        self.levels: dict[int, torch.Tensor] = {}  # level -> its flat host buffer (levels a counter never holds: none)
        self._staged: dict[tuple[int, int], tuple[torch.Tensor, object]] = {}
        self._staged_bytes = 0
        self._queue: collections.deque[tuple[int, int]] = collections.deque()
        self._read_done: dict[tuple[int, int], object] = {}  # place -> the event of its last copy back
        self.copied_out = 0  # bytes copied to the host so far (tests, benchmarks)
        self.copied_in = 0  # bytes brought back

    @property
    def host_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.levels.values())

    def host(self, i: int, level: int) -> torch.Tensor:
        if level not in self.levels:
            self.levels[level] = torch.empty(self.numel, dtype=torch.float32, pin_memory=self.cuda)
        return self.levels[level][self.offsets[i] : self.offsets[i + 1]]

    def put(self, i: int, level: int, dev: torch.Tensor, release: bool = True) -> None:
        """``release=False``: ``dev`` is a view of a buffer that lives on (the flat engine's gradient buffer); its
        next writer waits for the copy itself (``copies.wait_out``)."""
        h = self.host(i, level)
        self.copied_out += h.numel() * 4
        # two streams: after the last copy back from this place (an earlier round's read of it)
        self.copies.out(h, dev.reshape(-1), after=self._read_done.pop((i, level), None))
        if release:
            self.copies.release(dev)

    def expect(self, reads: list[tuple[int, int]]) -> None:
        """The entries the coming round's hooks read, in the order they read them; copies not read since the last
        call are dropped (their memory goes back to the allocator)."""
        self._staged.clear()
        self._staged_bytes = 0
        self._queue = collections.deque(reads)
        self.copies.reads_after_writes()  # the entries written by earlier rounds are on the host before they come back
        self._stage()

    def _stage_one(self, key: tuple[int, int]) -> None:
        h = self.host(*key)
        self.copied_in += h.numel() * 4
        (buf,), done = self.copies.back([h])
        self._staged[key] = (buf, done)
        self._read_done[key] = done
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

    def push(self, x: torch.Tensor, level: int = 0, release: bool = True) -> None:
        """``release=False``: ``x`` stays its owner's (the flat engine's gradient buffer), even when it is the
        entry copied out; a merged entry's staged copy is always released."""
        while self.levels and self.levels[-1] == level:
            self.levels.pop()
            top = self.host.get(self.i, level)
            top.add_(x.reshape(-1))  # earlier subtree + later subtree (flat: the host keeps shards flat)
            x, level, release = top, level + 1, True
        self.host.put(self.i, level, x, release=release)
        self.levels.append(level)

    def finish_(self, out: torch.Tensor) -> None:
        for level in reversed(self.levels):
            out.add_(self.host.get(self.i, level).view_as(out))
        self.levels.clear()

    def reset(self) -> None:
        self.levels.clear()
