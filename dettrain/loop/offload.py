"""Tier 4's finished partial sums in host memory (``dist.offload_partials``, the flat engine).

At tier 4 a rank with L micro-batches a step holds up to log2(L/2) partial sums of the tree beside the gradient being
built (collectives.py, ``BinaryCounter``): a whole fp32 gradient each on one rank.  A partial is *final* once no later
subtree of its level will be merged into it; from then on it is only read, once per bucket, when the last pair's
buckets are finished.  This module keeps the final partials in host memory between those two moments:

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

import torch


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
        self.cuda = device.type == "cuda"
        self.side = torch.cuda.Stream(device) if self.cuda else None
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
        if not self.cuda:
            host[sl].copy_(dev[sl])
            return
        self.side.wait_stream(torch.cuda.current_stream(self.device))  # after the work that wrote dev[sl]
        with torch.cuda.stream(self.side):
            host[sl].copy_(dev[sl], non_blocking=True)

    def wait_out(self) -> None:
        """Work queued on the current stream from now on runs after the copies to the host queued so far (before
        a buffer that was copied out is written again)."""
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_stream(self.side)

    def release(self, dev: torch.Tensor) -> None:
        if self.cuda:
            dev.record_stream(self.side)  # reusable once the copies queued on the side stream are done

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
            with torch.cuda.stream(self.side):
                bufs = [h[a:e].to(self.device, non_blocking=True) for h in self._hosts]
                done = torch.cuda.Event()
                done.record(self.side)
            self._staged[self._ahead] = (bufs, done)
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
        main = torch.cuda.current_stream(self.device)
        main.wait_event(done)
        for t in bufs:
            t.record_stream(main)  # allocated on the side stream, read on this one
        self._stage_ahead(b + 1)
        return bufs
