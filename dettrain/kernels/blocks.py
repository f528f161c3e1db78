"""What a kernel launch over many tensors walks: their raw bits, cut into blocks (the fingerprint kernel,
kernels/fingerprint.py, and the exact gradient-norm kernel, kernels/norm.py).

``BITS_VIEW`` maps every dtype the harness hashes to its bit width and the integer dtype that views its bits.
A launch takes any number of *pieces* (tensor index, start, end): element ranges of same-width tensors.  Each tensor
is cut into ``block``-element blocks aligned to its first element, and a piece becomes the blocks it overlaps,
clipped to the piece: the entries (t, q, lo, hi) of ``block_table`` stand for elements [q*block + lo, q*block + hi)
of tensor t.  ``device_table`` caches that table on the device (a run hashes the same layouts every step) and
``launch_meta`` the tensors' addresses and global base indices, so a repeated launch does no host work.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import torch

BLOCK = 4096  # elements per table entry: 16 per thread at 8 warps

# bit width and the integer view dtype for every dtype the harness hashes
BITS_VIEW: dict[torch.dtype, tuple[int, torch.dtype]] = {
    torch.float32: (32, torch.int32),
    torch.float64: (64, torch.int64),
    torch.bfloat16: (16, torch.int16),
    torch.float16: (16, torch.int16),
    torch.int64: (64, torch.int64),
    torch.int32: (32, torch.int32),
    torch.int16: (16, torch.int16),
    torch.uint8: (8, torch.uint8),
    torch.bool: (8, torch.uint8),
}


@functools.lru_cache(maxsize=64)
def block_table(pieces: tuple[tuple[int, int, int], ...], block: int) -> tuple[np.ndarray, np.ndarray]:
    """Entries (t, q, lo, hi) of every piece, in piece order, and the piece bounds into the entry list."""
    ents, bounds = [], [0]
    for t, a, b in pieces:
        if b <= a:
            bounds.append(bounds[-1])
            continue
        q = np.arange(a // block, (b - 1) // block + 1, dtype=np.int64)
        lo = np.maximum(a - q * block, 0)
        hi = np.minimum(b - q * block, block)
        ents.append(np.stack([np.full_like(q, t), q, lo, hi], axis=1))
        bounds.append(bounds[-1] + len(q))
    table = np.concatenate(ents).astype(np.int32) if ents else np.zeros((0, 4), np.int32)
    return table, np.asarray(bounds, dtype=np.int64)


_DEV_TABLES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on ``device`` without a host sync: a plain copy from pageable memory waits for the
    stream (torch synchronizes after it), which would drain the queued step; pinned memory copies in stream order
    (torch's pinned allocator keeps the host buffer until the copy has run)."""
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def device_table(pieces: tuple, device: torch.device,
                 block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``block_table`` on ``device``: (flat int32 entries, int64 piece bounds, number of entries), cached."""
    key = (pieces, block, str(device))
    hit = _DEV_TABLES.get(key)
    if hit is None:
        table, bounds = block_table(pieces, block)
        hit = (to_device(torch.from_numpy(table.reshape(-1)), device), to_device(torch.from_numpy(bounds), device))
        if len(_DEV_TABLES) > 64:  # layouts are few per run; bound the cache anyway
            _DEV_TABLES.clear()
        _DEV_TABLES[key] = hit
    return hit[0], hit[1], hit[0].numel() // 4


_META: dict[tuple, tuple[torch.Tensor, bool]] = {}  # launch metadata by (device, addresses, bases)


def launch_meta(tensors: Sequence[torch.Tensor], bases: Sequence[int], device: torch.device):
    """(device int64 [addresses..., bases...], all 16-byte aligned, bit width) of contiguous same-width tensors,
    or None when one is not contiguous (its bits must be copied first, at a fresh address each call).

    A step hashes the same parameters and optimizer state every time, at the same addresses, so the metadata is
    cached by (addresses, bases): the host then does no per-tensor view work and no host->device copy.  A cached
    entry is only a list of addresses, read by the kernel as whatever lives there now, which is exactly the
    tensors whose addresses formed the key."""
    widths = set()
    ptrs = []
    for t in tensors:
        if not t.is_contiguous() or t.dtype not in BITS_VIEW:
            return None
        widths.add(BITS_VIEW[t.dtype][0])
        ptrs.append(t.data_ptr())
    if len(widths) != 1:
        raise ValueError(f"piece_sums: one bit width per launch, got {sorted(widths)}")
    key = (str(device), tuple(ptrs), tuple(int(b) for b in bases))
    hit = _META.get(key)
    if hit is None:
        meta = to_device(torch.tensor(ptrs + [int(b) for b in bases], dtype=torch.int64), device)
        hit = (meta, all(a % 16 == 0 for a in ptrs))
        if len(_META) > 64:  # a few part lists per run (grad, param + opt, batch); bound the cache anyway
            _META.clear()
        _META[key] = hit
    return hit[0], hit[1], widths.pop()
