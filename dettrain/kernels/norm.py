"""The exact sum of squares of the canonical gradient norm in one pass (Triton), equal to the torch path's integers.

``collectives.exact_sumsq`` defines the value: every square (exact in fp64 for fp32 input) scaled by 2^s, rounded
half to even to an integer below 2^52, split into a high and a low 26-bit limb, and both limbs summed as integers.
Every step is elementwise and exact, and the sums are of integers, so the totals are the same integers whatever
adds them in whatever order: this kernel (one read of each fp32 element, int64 partials per block) returns exactly
what the torch path (fp64 temporaries, seven passes) returns.  It walks the same block table as the fingerprint
kernel (``kernels/blocks.py``), so any number of tensors of any sizes go in one launch.

``finish_`` is the reduced gradient's last elementwise pass before the norm (the FSDP2 engine's): -0.0 becomes +0.0
and every element is multiplied by the step's 1/M, in place, and the same pass returns the largest |x| the norm's
scale starts from.  On CUDA one launch reads and writes each element once, where torch takes two in-place passes and
a third that writes |x| to a temporary to find its max; the values are the same bits (each element gets the same
two correctly rounded fp32 operations, and a max is exact in any order).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence

import torch

from dettrain.kernels._triton import HAVE_TRITON, tl, triton
from dettrain.kernels.blocks import BLOCK, device_table, launch_meta, to_device

PER_PROG = 4  # table entries per program
NUM_WARPS = 8


def available() -> bool:
    """True when Triton is importable, a CUDA device is visible and DETTRAIN_NORM_TORCH=1 (the torch path, for tests
    and benchmarks) is not set."""
    return HAVE_TRITON and torch.cuda.is_available() and os.environ.get("DETTRAIN_NORM_TORCH") != "1"


if HAVE_TRITON:

    @triton.jit
    def _sumsq_limbs_kernel(meta_ptr, ent_ptr, n_ent, part_ptr, scale_ptr, LIMB: tl.constexpr, BLOCK: tl.constexpr,
                            PER_PROG: tl.constexpr):
        # entry e: (tensor t, block q, lo, hi) as in the fingerprint kernel; writes (sum of high limbs, sum of low
        # limbs) of elements [q*BLOCK + lo, q*BLOCK + hi) of fp32 tensor t to part[2e], part[2e + 1]
        pid = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        scale = tl.load(scale_ptr)  # 2^s in fp64 (a float argument would be fp32, and 2^s can exceed its range)
        for j in tl.static_range(PER_PROG):
            e = pid * PER_PROG + j
            if e < n_ent:
                t = tl.load(ent_ptr + 4 * e)
                q = tl.load(ent_ptr + 4 * e + 1).to(tl.int64)
                lo = tl.load(ent_ptr + 4 * e + 2)
                hi = tl.load(ent_ptr + 4 * e + 3)
                ptr = tl.load(meta_ptr + t).to(tl.pointer_type(tl.float32))
                m = (offs >= lo) & (offs < hi)
                x = tl.load(ptr + q * BLOCK + offs, mask=m, other=0.0).to(tl.float64)
                # a non-negative integer below 2^52 (masked lanes: 0), so exact as an int64; its limbs are its
                # bits above and below LIMB (the torch path's floor(u / 2^LIMB) and remainder)
                y = x * x * scale  # exact: a 48-bit square times a power of two (masked lanes: 0)
                t = y.to(tl.int64)  # truncation = floor, y >= 0
                f = y - t.to(tl.float64)  # the fraction, exact (y and t are within 1 of each other)
                u = t + ((f > 0.5) | ((f == 0.5) & ((t & 1) == 1))).to(tl.int64)  # round half to even
                tl.store(part_ptr + 2 * e, tl.sum(u >> LIMB, axis=0))
                tl.store(part_ptr + 2 * e + 1, tl.sum(u & ((1 << LIMB) - 1), axis=0))


    @triton.jit
    def _finish_kernel(meta_ptr, ent_ptr, max_ptr, scale, BLOCK: tl.constexpr, SCALE: tl.constexpr,
                       ALIGNED: tl.constexpr):
        # entry e: (tensor t, block q, lo, hi): x = (x + 0.0) * scale in place on those elements of fp32 tensor t,
        # and max_ptr[e] = max |x| after it (NaN when one is NaN, as torch's max)
        e = tl.program_id(0)
        t = tl.load(ent_ptr + 4 * e)
        q = tl.load(ent_ptr + 4 * e + 1).to(tl.int64)
        lo = tl.load(ent_ptr + 4 * e + 2)
        hi = tl.load(ent_ptr + 4 * e + 3)
        ptr = tl.load(meta_ptr + t).to(tl.pointer_type(tl.float32))
        if ALIGNED:
            ptr = tl.multiple_of(ptr, 16)
        offs = tl.arange(0, BLOCK)
        m = (offs >= lo) & (offs < hi)
        x = tl.load(ptr + q * BLOCK + offs, mask=m, other=0.0)
        x = tl.where(x == 0.0, 0.0, x)  # x + 0.0: -0.0 -> +0.0, every other value unchanged
        if SCALE:
            x = x * scale  # one fp32 multiply by the fp32 scale, as torch's in-place mul by a Python float
        tl.store(ptr + q * BLOCK + offs, x, mask=m)
        a = tl.where(m, tl.abs(x), 0.0)
        nan = tl.sum((a != a).to(tl.int32), axis=0)
        tl.store(max_ptr + e, tl.where(nan > 0, float("nan"), tl.max(a, axis=0)))


def local_max(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """max |x| over every element of ``parts`` (one-element fp32 tensor; 0 for none; NaN if any is NaN), each part
    read once (no |x| temporary)."""
    if not parts:
        return torch.zeros(1)
    return torch.stack([torch.linalg.vector_norm(p, float("inf")).float() for p in parts]).max().reshape(1)


def finish_(parts: Sequence[torch.Tensor], scale: float) -> torch.Tensor:
    """In place on every fp32 tensor of ``parts``: x = (x + 0.0) * scale (-0.0 -> +0.0, then the fp32 multiply;
    ``scale`` 1: no multiply).  Returns ``local_max`` of the result, without a host sync.  CUDA (contiguous, Triton):
    one launch over all of them; else torch's in-place passes.  Both give the same bits."""
    parts = [p for p in parts if p.numel()]
    if not parts:
        return torch.zeros(1)
    flats = [p.view(-1) for p in parts] if all(p.is_contiguous() for p in parts) else None
    device = parts[0].device
    if (flats is None or not available() or device.type != "cuda"
            or any(p.dtype != torch.float32 for p in parts)):
        torch._foreach_add_(parts, 0.0)
        if scale != 1.0:
            torch._foreach_mul_(parts, scale)
        return local_max(parts)
    meta, aligned, _ = launch_meta(flats, [0] * len(flats), device)
    table, _, n_ent = device_table(tuple((k, 0, f.numel()) for k, f in enumerate(flats)), device)
    maxes = torch.empty(n_ent, dtype=torch.float32, device=device)
    with torch.cuda.device(device):
        _finish_kernel[(n_ent,)](meta, table, maxes, float(scale), BLOCK=BLOCK, SCALE=scale != 1.0,
                                 ALIGNED=aligned, num_warps=NUM_WARPS)
    return maxes.max().reshape(1)


def sumsq_limbs(parts: Sequence[torch.Tensor], scale: float | torch.Tensor, limb_bits: int) -> torch.Tensor:
    """int64 (high, low) limb totals of the scaled, rounded squares of every element of the fp32 CUDA ``parts``
    (``collectives.exact_sumsq``'s definition), on the device and without a host sync.  ``scale``: the power of two
    2^s, a float or an fp64 tensor already on the device (``exact_sumsq_tensor`` computes it there)."""
    flats = [p.reshape(-1) for p in parts]
    flats = [f if f.is_contiguous() else f.contiguous() for f in flats]
    device = flats[0].device
    cached = launch_meta(flats, [0] * len(flats), device)
    if cached is None:  # not reachable for contiguous fp32 tensors; kept explicit
        raise ValueError("sumsq_limbs: fp32 tensors only")
    meta = cached[0]
    table, _, n_ent = device_table(tuple((k, 0, f.numel()) for k, f in enumerate(flats)), device)
    part = torch.zeros(2 * max(n_ent, 1), dtype=torch.int64, device=device)
    if isinstance(scale, torch.Tensor):
        scale_t = scale.to(device=device, dtype=torch.float64).reshape(1)
    else:
        scale_t = to_device(torch.tensor([scale], dtype=torch.float64), device)
    if n_ent:
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            _sumsq_limbs_kernel[(triton.cdiv(n_ent, PER_PROG),)](meta, table, n_ent, part, scale_t, LIMB=limb_bits,
                                                                 BLOCK=BLOCK, PER_PROG=PER_PROG,
                                                                 num_warps=NUM_WARPS)
    return part.view(-1, 2).sum(0)  # int64: exact in any order
