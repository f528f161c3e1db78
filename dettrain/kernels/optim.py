"""Fused elementwise ops over the flat fp32 buffers of tiers 3-4 (Triton on CUDA, torch elsewhere).

``adamw_`` is FlatAdamW's update in one pass over memory (read g, p, m, v; write p, m, v) instead of ~14 torch
kernels; ``adamw_many_`` the same update of many tensors (the FSDP2 engine's per-parameter shards) in one launch per
weight-decay value, walking a block table as the fingerprint kernel does (``kernels/blocks.py``). It performs
exactly the torch reference's sequence of correctly rounded fp32 operations (mul, add, sqrt, div: Triton's multiply-
add fusion is switched off for it, sqrt and div are the IEEE round-to-nearest forms), so both paths give the same
bits and an element's result does not depend on which slice or shard it is updated in."""

from __future__ import annotations

import contextlib
import math
import os

import torch

from dettrain.kernels._triton import HAVE_TRITON, tl, triton, unavailable_reason
from dettrain.kernels.blocks import device_table, launch_meta, to_device
from dettrain.kernels.fingerprint import _INTERPRET, SUM_CHUNK

if HAVE_TRITON:
    from dettrain.kernels.fingerprint import _GOLDEN, _sum_ranges_kernel, _terms

ADAMW_BLOCK = 2048
# The fused kernel (_adamw_many_fp_kernel) keeps three 64-bit hash terms per element beside the update: at the
# unfused shape (2048 elements, 8 warps: 8 a thread) it needs 178 registers a thread on sm_90, one block (8 warps)
# an SM; at 1024 elements and 16 warps (2 a thread) 54, two blocks (32 warps) an SM, the unfused kernel's 60
# registers' occupancy (ptxas of Triton 3.6, `tests/test_fused_fp.py`).  DETTRAIN_FP_FUSED_SHAPE=BLOCKxWARPS
# (e.g. 2048x8, the first form) names another shape, for measuring.
ADAMW_FP_SHAPE = (1024, 16)
FP_SHAPE_ENV = "DETTRAIN_FP_FUSED_SHAPE"


def fp_launch_shape() -> tuple[int, int]:
    """The fused kernel's (BLOCK, num_warps): ADAMW_FP_SHAPE, or DETTRAIN_FP_FUSED_SHAPE=BLOCKxWARPS (powers of
    two, BLOCK 128-8192, warps 1-32)."""
    raw = os.environ.get(FP_SHAPE_ENV, "")
    if not raw:
        return ADAMW_FP_SHAPE
    try:
        block, warps = (int(x) for x in raw.lower().split("x"))
    except ValueError:
        block = warps = 0
    if not (128 <= block <= 8192 and 1 <= warps <= 32 and block & (block - 1) == 0 and warps & (warps - 1) == 0):
        raise ValueError(f"{FP_SHAPE_ENV}={raw!r}: give BLOCKxWARPS, powers of two with BLOCK 128-8192 and WARPS 1-32 "
                         f"(e.g. 1024x16), or unset it for {ADAMW_FP_SHAPE[0]}x{ADAMW_FP_SHAPE[1]}")
    return block, warps


def _fast(t: torch.Tensor, impl: str) -> bool:
    """Whether to use the Triton kernel: impl 'auto' (CUDA tensor, Triton importable, DETTRAIN_TORCH_OPS unset),
    'torch' (the reference) or 'triton' (required)."""
    if impl == "torch":
        return False
    ok = HAVE_TRITON and (t.is_cuda or _INTERPRET)  # TRITON_INTERPRET=1: the kernels on CPU tensors (tests)
    if impl == "triton":
        if not ok:
            raise RuntimeError("kernels.optim.adamw_: impl='triton' needs Triton and a CUDA tensor"
                               + (f" ({unavailable_reason()})" if not HAVE_TRITON else ""))
        return True
    return ok and os.environ.get("DETTRAIN_TORCH_OPS", "") != "1"


if HAVE_TRITON:

    @triton.jit
    def _adamw_update(p_ptr, g_ptr, m_ptr, v_ptr, offs, mask, b1, c1, b2, c2, decay, inv_sqrt_bc2, eps, step_size):
        # one correctly rounded fp32 op per line, in the torch reference's order (launched with fp fusion off);
        # elementwise, so an element's result is the same whichever launch, slice or shard updates it.  Returns
        # the stored values (the fused fingerprint hashes them where they are)
        g = tl.load(g_ptr + offs, mask=mask)
        p = tl.load(p_ptr + offs, mask=mask)
        m = tl.load(m_ptr + offs, mask=mask)
        v = tl.load(v_ptr + offs, mask=mask)
        m = m * b1 + g * c1
        v = v * b2 + (g * g) * c2
        p = p * decay
        denom = tl.sqrt_rn(v) * inv_sqrt_bc2 + eps
        p = p - tl.div_rn(m, denom) * step_size
        tl.store(m_ptr + offs, m, mask=mask)
        tl.store(v_ptr + offs, v, mask=mask)
        tl.store(p_ptr + offs, p, mask=mask)
        return p, m, v

    @triton.jit
    def _adamw_kernel(p_ptr, g_ptr, m_ptr, v_ptr, n, b1, c1, b2, c2, decay, inv_sqrt_bc2, eps, step_size,
                      BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        _adamw_update(p_ptr, g_ptr, m_ptr, v_ptr, offs, offs < n, b1, c1, b2, c2, decay, inv_sqrt_bc2, eps,
                      step_size)

    @triton.jit
    def _entry(meta_ptr, ent_ptr, e, n_tensors, ALIGNED: tl.constexpr):
        # entry e of a block table: (tensor t, block q, lo, hi), and tensor t's p, g, m, v pointers from meta
        # (addresses of p_0..p_{n-1}, g_0.., m_0.., v_0.., int64)
        t = tl.load(ent_ptr + 4 * e)
        q = tl.load(ent_ptr + 4 * e + 1).to(tl.int64)
        lo = tl.load(ent_ptr + 4 * e + 2)
        hi = tl.load(ent_ptr + 4 * e + 3)
        p_ptr = tl.load(meta_ptr + t).to(tl.pointer_type(tl.float32))
        g_ptr = tl.load(meta_ptr + n_tensors + t).to(tl.pointer_type(tl.float32))
        m_ptr = tl.load(meta_ptr + 2 * n_tensors + t).to(tl.pointer_type(tl.float32))
        v_ptr = tl.load(meta_ptr + 3 * n_tensors + t).to(tl.pointer_type(tl.float32))
        if ALIGNED:
            p_ptr = tl.multiple_of(p_ptr, 16)
            g_ptr = tl.multiple_of(g_ptr, 16)
            m_ptr = tl.multiple_of(m_ptr, 16)
            v_ptr = tl.multiple_of(v_ptr, 16)
        return t, q, lo, hi, p_ptr, g_ptr, m_ptr, v_ptr

    @triton.jit
    def _adamw_many_kernel(meta_ptr, ent_ptr, n_ent, n_tensors, b1, c1, b2, c2, decay, inv_sqrt_bc2, eps, step_size,
                           BLOCK: tl.constexpr, ALIGNED: tl.constexpr):
        # meta: addresses of p_0..p_{n-1}, g_0.., m_0.., v_0.. (int64); entry e: (tensor t, block q, lo, hi)
        e = tl.program_id(0)
        t, q, lo, hi, p_ptr, g_ptr, m_ptr, v_ptr = _entry(meta_ptr, ent_ptr, e, n_tensors, ALIGNED)
        ar = tl.arange(0, BLOCK)
        offs = q * BLOCK + ar
        if (lo == 0) & (hi == BLOCK):  # a whole block: unmasked, vectorised loads
            _adamw_update(p_ptr, g_ptr, m_ptr, v_ptr, offs, None, b1, c1, b2, c2, decay, inv_sqrt_bc2, eps,
                          step_size)
        else:  # a tensor's last block
            _adamw_update(p_ptr, g_ptr, m_ptr, v_ptr, offs, (ar >= lo) & (ar < hi), b1, c1, b2, c2, decay,
                          inv_sqrt_bc2, eps, step_size)

    @triton.jit
    def _adamw_many_fp_kernel(meta_ptr, ent_ptr, n_ent, n_tensors, part_ptr, b1, c1, b2, c2, decay, inv_sqrt_bc2,
                              eps, step_size, BLOCK: tl.constexpr, ALIGNED: tl.constexpr):
        # _adamw_many_kernel, and the fingerprint terms (kernels/fingerprint.py) of the values it stores: meta also
        # holds each tensor's global base index after the addresses (p_0.., g_0.., m_0.., v_0..); entry e writes
        # the sum of its parameters' terms to part[e] and of its two moments' to part[n_ent + e]
        e = tl.program_id(0)
        t, q, lo, hi, p_ptr, g_ptr, m_ptr, v_ptr = _entry(meta_ptr, ent_ptr, e, n_tensors, ALIGNED)
        ar = tl.arange(0, BLOCK)
        offs = q * BLOCK + ar
        ar_golden = ar.to(tl.uint64) * _GOLDEN
        gp = (tl.load(meta_ptr + 4 * n_tensors + t) + q * BLOCK).to(tl.uint64, bitcast=True) * _GOLDEN + ar_golden
        gm = (tl.load(meta_ptr + 6 * n_tensors + t) + q * BLOCK).to(tl.uint64, bitcast=True) * _GOLDEN + ar_golden
        gv = (tl.load(meta_ptr + 7 * n_tensors + t) + q * BLOCK).to(tl.uint64, bitcast=True) * _GOLDEN + ar_golden
        if (lo == 0) & (hi == BLOCK):  # a whole block: unmasked, vectorised loads
            p, m, v = _adamw_update(p_ptr, g_ptr, m_ptr, v_ptr, offs, None, b1, c1, b2, c2, decay, inv_sqrt_bc2,
                                    eps, step_size)
            sp = tl.sum(_terms(p, gp, 32), axis=0)
            so = tl.sum(_terms(m, gm, 32), axis=0) + tl.sum(_terms(v, gv, 32), axis=0)
        else:  # a tensor's last block
            mask = (ar >= lo) & (ar < hi)
            p, m, v = _adamw_update(p_ptr, g_ptr, m_ptr, v_ptr, offs, mask, b1, c1, b2, c2, decay, inv_sqrt_bc2,
                                    eps, step_size)
            sp = tl.sum(tl.where(mask, _terms(p, gp, 32), 0), axis=0)
            so = tl.sum(tl.where(mask, _terms(m, gm, 32), 0), axis=0) + tl.sum(tl.where(mask, _terms(v, gv, 32), 0),
                                                                                axis=0)
        tl.store(part_ptr + e, sp.to(tl.int64, bitcast=True))
        tl.store(part_ptr + n_ent + e, so.to(tl.int64, bitcast=True))


def adamw_many_(ps: list[torch.Tensor], gs: list[torch.Tensor], ms: list[torch.Tensor], vs: list[torch.Tensor], *,
                beta1: float, beta2: float, lr: float, weight_decays: list[float], eps: float, step: int,
                impl: str = "auto", fp_bases: list[int] | None = None, fp_numel: int = 0) -> torch.Tensor | None:
    """``adamw_`` on every (p, g, m, v) of the lists, ``weight_decays[i]`` for tensor i; the same bits as one
    ``adamw_`` call per tensor.  On CUDA (contiguous fp32, Triton) one launch per distinct weight decay, with no
    host work on a repeated call (the addresses and the block table are cached on the device); else the loop.

    ``fp_bases`` (one global index per tensor): the same launches also hash what they store, as the ledger's
    fingerprints define it (record/fingerprint.py), with ``ps[i]``'s element j at index ``fp_bases[i] + j``, the
    first moment's at the same index and the second's at ``fp_numel`` more (the engines' layout of the ``opt``
    field).  Returns an int64 device tensor of two partials, the parameters' and the moments', not yet read (no
    host sync), whose values equal the fingerprint kernel's over the same tensors read again after the update; None
    where the loop runs (no Triton kernel), and then the caller hashes as usual."""
    if not len(ps) == len(gs) == len(ms) == len(vs) == len(weight_decays):
        raise ValueError(f"adamw_many_: {len(ps)} parameters, {len(gs)} gradients, {len(ms)} and {len(vs)} moments, "
                         f"{len(weight_decays)} weight decays: one of each per tensor")
    fast = bool(ps) and all(_fast(t, impl) and t.dtype == torch.float32 and t.is_contiguous()
                            for quad in (ps, gs, ms, vs) for t in quad)
    if fp_bases is not None and len(fp_bases) != len(ps):
        raise ValueError(f"adamw_many_: {len(fp_bases)} fingerprint bases for {len(ps)} tensors: one each")
    if not fast:
        for p, g, m, v, wd in zip(ps, gs, ms, vs, weight_decays, strict=True):
            adamw_(p, g, m, v, beta1=beta1, beta2=beta2, lr=lr, weight_decay=wd, eps=eps, step=step, impl=impl)
        return None
    bc1, bc2 = 1 - beta1**step, 1 - beta2**step
    inv_sqrt_bc2 = 1.0 / math.sqrt(bc2)
    step_size = lr / bc1
    device = ps[0].device
    fp = None if fp_bases is None else torch.zeros(2, dtype=torch.int64, device=device)
    for wd in sorted(set(weight_decays)):
        idx = [i for i, w in enumerate(weight_decays) if w == wd and ps[i].numel()]
        if not idx:
            continue
        quads = [[lst[i].view(-1) for i in idx] for lst in (ps, gs, ms, vs)]
        flat = [t for quad in quads for t in quad]
        bases = [0] * len(flat) if fp is None else (
            [fp_bases[i] for i in idx] + [0] * len(idx) + [fp_bases[i] for i in idx]
            + [fp_numel + fp_bases[i] for i in idx])
        meta, aligned, _ = launch_meta(flat, bases, device)
        block, warps = (ADAMW_BLOCK, 8) if fp is None else fp_launch_shape()
        table, _, n_ent = device_table(tuple((k, 0, t.numel()) for k, t in enumerate(quads[0])), device, block)
        scalars = (beta1, 1 - beta1, beta2, 1 - beta2, 1 - lr * wd, inv_sqrt_bc2, eps, step_size)
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            if fp is None:
                _adamw_many_kernel[(n_ent,)](meta, table, n_ent, len(idx), *scalars, BLOCK=ADAMW_BLOCK,
                                             ALIGNED=aligned, num_warps=8, enable_fp_fusion=False)
                continue
            parts = torch.empty(2 * n_ent, dtype=torch.int64, device=device)
            _adamw_many_fp_kernel[(n_ent,)](meta, table, n_ent, len(idx), parts, *scalars, BLOCK=block,
                                            ALIGNED=aligned, num_warps=warps, enable_fp_fusion=False)
            if _INTERPRET:  # Triton's CPU interpreter cannot loop over loaded bounds: add on the host
                fp += parts.view(2, n_ent).sum(dim=1)
            else:
                sums = torch.empty(2, dtype=torch.int64, device=device)
                _sum_ranges_kernel[(2,)](parts, _halves(n_ent, device), sums, CHUNK=SUM_CHUNK, num_warps=4)
                fp += sums  # int64 addition wraps as the fingerprint's modulo 2^64 does
    return fp


_HALVES: dict[tuple[int, str], torch.Tensor] = {}


def _halves(n: int, device: torch.device) -> torch.Tensor:
    """The piece bounds [0, n, 2n] of a fused launch's partials on ``device`` (cached: no host work per step)."""
    key = (n, str(device))
    if key not in _HALVES:
        if len(_HALVES) > 64:
            _HALVES.clear()
        _HALVES[key] = to_device(torch.tensor([0, n, 2 * n], dtype=torch.int64), device)
    return _HALVES[key]


def adamw_(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, *, beta1: float, beta2: float,
           lr: float, weight_decay: float, eps: float, step: int, impl: str = "auto") -> None:
    """One AdamW update of contiguous fp32 slices, in place (``step`` is the 1-based step count)."""
    bc1, bc2 = 1 - beta1**step, 1 - beta2**step
    decay = 1 - lr * weight_decay
    inv_sqrt_bc2 = 1.0 / math.sqrt(bc2)
    step_size = lr / bc1
    if _fast(p, impl):
        n = p.numel()
        grid = (triton.cdiv(n, ADAMW_BLOCK),)
        with torch.cuda.device(p.device) if p.is_cuda else contextlib.nullcontext():
            _adamw_kernel[grid](p, g, m, v, n, beta1, 1 - beta1, beta2, 1 - beta2, decay, inv_sqrt_bc2, eps,
                                step_size, BLOCK=ADAMW_BLOCK, num_warps=8, enable_fp_fusion=False)
        return
    # the reference: each op rounds once; python floats become fp32 scalars in every op
    m.mul_(beta1).add_(g * (1 - beta1))
    v.mul_(beta2).add_((g * g) * (1 - beta2))
    if weight_decay:
        p.mul_(decay)
    # sqrt through fp64 is the correctly rounded fp32 sqrt: torch's vectorised CPU sqrt is not (seen on
    # torch 2.13, about 1 element in 5 off by an ulp), and the scalar tail loop would disagree with it
    denom = v.double().sqrt_().float().mul_(inv_sqrt_bc2).add_(eps)
    p.sub_((m / denom).mul_(step_size))
