"""Single-pass CUDA fingerprints (Triton), bit-identical to ``dettrain.record.fingerprint``'s torch path.

Same definition (record/fingerprint.py): fp = sum_i mix64(bits(x_i) XOR (i * GOLDEN)) mod 2^64.  One launch hashes any
number of *pieces* (an element range of one tensor) of any number of same-width tensors and returns one partial sum
per piece, so a step's gradient, parameters and optimizer state, or every parameter of a model separately, are hashed
in one pass over memory with one host sync.

How.  Each tensor is cut into BLOCK-element blocks aligned to its first element; a piece becomes the blocks it
overlaps, clipped to the piece (``lo``/``hi`` inside the block).  The launch walks a table of such entries, PER_PROG
entries per program; full blocks load without a mask (16-byte vector loads when the tensor is 16-byte aligned),
clipped ones with a mask.  Each entry writes one uint64 partial; a second tiny kernel adds each piece's contiguous run
of partials.  Integer addition modulo 2^64 is associative and commutative, so neither the grid order nor the block
split can change a value: every call returns exactly what the torch path returns.

Cost.  The hash is integer arithmetic on 64-bit values (three 64-bit multiplies, six 64-bit shift/xor pairs and an
add per element), which the GPU builds from 32-bit instructions: about 25 per element.  For 4-byte elements that is
close to the memory time on an H200; 2- and 1-byte elements are bound by the arithmetic (BENCHMARKS.md).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence

import torch

from dettrain.kernels._triton import HAVE_TRITON, tl, triton
from dettrain.kernels.blocks import BITS_VIEW, device_table, launch_meta, to_device

# without Triton (CPU installs, CI) dettrain/record/fingerprint.py keeps its torch path and never calls this module

# the definition's constants, shared with the torch path (record/fingerprint.py imports them from here)
MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15  # the global index's multiplier: 2^64 / golden ratio
MIX1 = 0xBF58476D1CE4E5B9  # splitmix64's two finaliser multipliers
MIX2 = 0x94D049BB133111EB

BLOCK = 4096  # elements per table entry (kernels/blocks.py): 16 per thread at 8 warps
PER_PROG = 4  # table entries per program
NUM_WARPS = 8
SUM_CHUNK = 1024  # partials added per iteration of the per-piece sum
_INTERPRET = os.environ.get("TRITON_INTERPRET", "") == "1"  # tests of the kernels on a CPU


def available() -> bool:
    """True when Triton is importable and a CUDA device is visible."""
    return HAVE_TRITON and torch.cuda.is_available()


if HAVE_TRITON:
    _GOLDEN = tl.constexpr(GOLDEN)
    _MIX1 = tl.constexpr(MIX1)
    _MIX2 = tl.constexpr(MIX2)

    @triton.jit
    def _mix64(z):
        # splitmix64 finaliser on uint64 (>> is a logical shift and * wraps modulo 2^64 for unsigned types)
        z = z ^ (z >> 30)
        z = z * _MIX1
        z = z ^ (z >> 27)
        z = z * _MIX2
        return z ^ (z >> 31)

    @triton.jit
    def _terms(x, gidx_golden, WIDTH: tl.constexpr):
        """mix64(zero-extended bits of x XOR index*GOLDEN) for a block of raw integer views."""
        if WIDTH == 64:
            b = x.to(tl.uint64, bitcast=True)
        elif WIDTH == 32:
            b = x.to(tl.uint32, bitcast=True).to(tl.uint64)
        elif WIDTH == 16:
            b = x.to(tl.uint16, bitcast=True).to(tl.uint64)
        else:
            b = x.to(tl.uint8, bitcast=True).to(tl.uint64)
        return _mix64(b ^ gidx_golden)

    @triton.jit
    def _fp_blocks_kernel(meta_ptr, ent_ptr, n_ent, n_tensors, part_ptr, ELEM: tl.constexpr, WIDTH: tl.constexpr,
                          BLOCK: tl.constexpr, PER_PROG: tl.constexpr, ALIGNED: tl.constexpr):
        # meta: [address of tensor t (int64) for t < n_tensors] + [global index of its element 0]
        # entry e: (tensor t, block q, lo, hi): elements [q*BLOCK + lo, q*BLOCK + hi) of tensor t
        pid = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        offs_golden = offs.to(tl.uint64) * _GOLDEN  # hoisted: idx*G = (block base)*G + offs*G modulo 2^64
        for j in tl.static_range(PER_PROG):
            e = pid * PER_PROG + j
            if e < n_ent:
                t = tl.load(ent_ptr + 4 * e)
                q = tl.load(ent_ptr + 4 * e + 1).to(tl.int64)
                lo = tl.load(ent_ptr + 4 * e + 2)
                hi = tl.load(ent_ptr + 4 * e + 3)
                addr = tl.load(meta_ptr + t)
                base_idx = tl.load(meta_ptr + n_tensors + t)
                ptr = addr.to(tl.pointer_type(ELEM))
                if ALIGNED:
                    ptr = tl.multiple_of(ptr, 16)
                start = q * BLOCK
                g0 = (base_idx + start).to(tl.uint64, bitcast=True) * _GOLDEN
                if (lo == 0) & (hi == BLOCK):
                    x = tl.load(ptr + start + offs)
                    s = tl.sum(_terms(x, g0 + offs_golden, WIDTH), axis=0)
                else:
                    m = (offs >= lo) & (offs < hi)
                    x = tl.load(ptr + start + offs, mask=m, other=0)
                    s = tl.sum(tl.where(m, _terms(x, g0 + offs_golden, WIDTH), 0), axis=0)
                tl.store(part_ptr + e, s.to(tl.int64, bitcast=True))

    @triton.jit
    def _sum_ranges_kernel(part_ptr, bounds_ptr, out_ptr, CHUNK: tl.constexpr):
        # piece p's partials are part[bounds[p]:bounds[p+1]]; int64 addition wraps exactly like uint64
        p = tl.program_id(0)
        a = tl.load(bounds_ptr + p)
        b = tl.load(bounds_ptr + p + 1)
        offs = tl.arange(0, CHUNK)
        acc = tl.zeros([CHUNK], dtype=tl.int64)
        for s in range(a, b, CHUNK):
            acc += tl.load(part_ptr + s + offs, mask=s + offs < b, other=0)
        tl.store(out_ptr + p, tl.sum(acc, axis=0))

    _ELEM = {8: tl.uint8, 16: tl.int16, 32: tl.int32, 64: tl.int64}


def _flat_view(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(contiguous 1-D integer view of x's bits, bit width)."""
    if x.dtype not in BITS_VIEW:
        raise TypeError(f"fingerprint: unsupported dtype {x.dtype}; supported: {sorted(map(str, BITS_VIEW))}")
    width, view = BITS_VIEW[x.dtype]
    flat = x.detach().reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    if x.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    return flat.view(view), width


def piece_sums(tensors: Sequence[torch.Tensor], bases: Sequence[int],
               pieces: Sequence[tuple[int, int, int]]) -> torch.Tensor:
    """Partial fingerprints of ``pieces`` = (tensor index, start, end) element ranges, as an int64 CUDA tensor.

    ``bases[t]`` is the global index of element 0 of ``tensors[t]``.  All tensors must be on one CUDA device and have
    the same bit width (fp32/int32, bf16/fp16/int16, ...).  The values are exact (read them with ``to_u64``); the
    call does not synchronise."""
    device = tensors[0].device
    cached = launch_meta(tensors, bases, device)
    if cached is not None:
        meta, aligned, width = cached
        n_flats = len(tensors)
    else:
        views = [_flat_view(t) for t in tensors]
        widths = {w for _, w in views}
        if len(widths) != 1:
            raise ValueError(f"piece_sums: one bit width per launch, got {sorted(widths)}")
        width = widths.pop()
        flats = [v for v, _ in views]
        # copies of non-contiguous tensors live at fresh addresses: this metadata travels with this launch only
        meta = to_device(torch.tensor([f.data_ptr() for f in flats] + [int(b) for b in bases], dtype=torch.int64),
                         device)
        aligned = all(f.data_ptr() % 16 == 0 for f in flats)
        n_flats = len(flats)
    table, bounds, n_ent = device_table(tuple(pieces), device, BLOCK)
    parts = torch.empty(max(n_ent, 1), dtype=torch.int64, device=device)
    out = torch.empty(len(pieces), dtype=torch.int64, device=device)
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        if n_ent:
            grid = (triton.cdiv(n_ent, PER_PROG),)
            _fp_blocks_kernel[grid](meta, table, n_ent, n_flats, parts, ELEM=_ELEM[width], WIDTH=width,
                                    BLOCK=BLOCK, PER_PROG=PER_PROG, ALIGNED=aligned, num_warps=NUM_WARPS)
        if len(pieces) and _INTERPRET:  # Triton's CPU interpreter cannot loop over loaded bounds: add on the host
            b = bounds.tolist()
            out.copy_(torch.stack([parts[b[i]:b[i + 1]].sum() if b[i + 1] > b[i] else parts.new_zeros(())
                                   for i in range(len(pieces))]))
        elif len(pieces):
            _sum_ranges_kernel[(len(pieces),)](parts, bounds, out, CHUNK=SUM_CHUNK, num_warps=4)
    # no need to keep copies alive: the caching allocator hands freed memory only to later work on this stream
    return out


def to_u64(values: torch.Tensor) -> list[int]:
    """int64 device tensor -> Python ints in [0, 2^64) (one device-to-host copy)."""
    return [v & MASK64 for v in values.cpu().tolist()]


def fingerprint(x: torch.Tensor, offset: int = 0) -> int:
    """Same value as ``dettrain.record.fingerprint.fingerprint_torch(x, offset)``, for a CUDA tensor."""
    return to_u64(piece_sums([x], [offset], [(0, 0, x.numel())]))[0]


def fingerprint_many_async(parts: Sequence[tuple[torch.Tensor, int]]) -> tuple[torch.Tensor | None, list[int]]:
    """fp of each (tensor, offset), still on the device: (int64 values, order) where value k is the fingerprint of
    ``parts[order[k]]``; one launch per bit width and no host sync (``to_u64`` reads the values)."""
    groups: dict[int, list[int]] = {}
    for i, (t, _) in enumerate(parts):
        groups.setdefault(BITS_VIEW[t.dtype][0] if t.dtype in BITS_VIEW else -1, []).append(i)
    pending, order = [], []
    for _, idx in sorted(groups.items()):
        ts = [parts[i][0] for i in idx]
        pending.append(piece_sums(ts, [parts[i][1] for i in idx], [(k, 0, t.numel()) for k, t in enumerate(ts)]))
        order += idx
    if not pending:
        return None, []
    return (pending[0] if len(pending) == 1 else torch.cat(pending)), order


def fingerprint_many(parts: Sequence[tuple[torch.Tensor, int]]) -> list[int]:
    """fp of each (tensor, offset): one launch per bit width and one host sync in all."""
    values, order = fingerprint_many_async(parts)
    out: list[int] = [0] * len(parts)
    if values is not None:
        for i, v in zip(order, to_u64(values)):
            out[i] = v
    return out


def segment_fingerprints(flat: torch.Tensor, flat_offset: int,
                         segments: Sequence[tuple[str, int, int]]) -> dict[str, int]:
    """Same contract as ``dettrain.record.fingerprint.segment_fingerprints``: one launch for all segments."""
    lo, hi = flat_offset, flat_offset + flat.numel()
    names, pieces = [], []
    for name, start, end in segments:
        a, b = max(start, lo), min(end, hi)
        if a < b:
            names.append(name)
            pieces.append((0, a - lo, b - lo))
    if not pieces:
        return {}
    vals = to_u64(piece_sums([flat], [flat_offset], pieces))
    return dict(zip(names, vals))
