"""The exact sum of squares of the canonical gradient norm in one pass (Triton), equal to the torch path's integers.

``collectives.exact_sumsq`` defines the value: every square (exact in fp64 for fp32 input) scaled by 2^s, rounded
half to even to an integer below 2^52, split into a high and a low 26-bit limb, and both limbs summed as integers.
Every step is elementwise and exact, and the sums are of integers, so the totals are the same integers whatever
adds them in whatever order: this kernel (one read of each fp32 element, int64 partials per block) returns exactly
what the torch path (fp64 temporaries, seven passes) returns.  It walks the same block table as the fingerprint
kernel (``kernels/blocks.py``), so any number of tensors of any sizes go in one launch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch

from dettrain.kernels._triton import HAVE_TRITON, tl, triton
from dettrain.kernels.blocks import BLOCK, device_table, launch_meta, to_device

PER_PROG = 4  # table entries per program
NUM_WARPS = 8


def available() -> bool:
    """True when Triton is importable and a CUDA device is visible."""
    return HAVE_TRITON and torch.cuda.is_available()


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
