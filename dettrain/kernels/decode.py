"""One kernel for a generation step's RoPE and cache writes (CUDA; generate/llama.py).

``rope_into_caches`` takes the fused q|k|v projection of a step's rows, rotates q and k by RoPE at each row's
position and writes q, k and v into the caches at that position: one launch where the eager path runs about 20
(the tables' gathers, RoPE's upcast, four products, a difference, a sum, the stack and the downcast, for q and for
k, and three indexed writes).  Its arithmetic is ``models.llama.apply_rope``'s, operation by operation: the input
widened to fp32 (exact), each product and the difference and sum one correctly rounded fp32 operation (Triton's
multiply-add fusion is switched off, as torch's separate kernels never fuse them), the result rounded to the input's
dtype to nearest even, as ``type_as`` does.  So every written element has the eager path's bits
(``tests/test_generate_gpu.py`` compares them)."""

from __future__ import annotations

import torch

from dettrain.kernels._triton import HAVE_TRITON, tl, triton

if HAVE_TRITON:

    @triton.jit
    def _rope_caches_kernel(x_ptr, pos_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, T, sx, sqb, sqh, sqs, skb, skh, sks,
                            H: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr):
        r = tl.program_id(0)  # row b * T + t
        h = tl.program_id(1)  # head among q (H), k (HKV), v (HKV)
        b = r // T
        p = tl.load(pos_ptr + r)
        i = tl.arange(0, BLOCK)
        m = i < HALF
        src = x_ptr + r.to(tl.int64) * sx + h * (2 * HALF)
        x1 = tl.load(src + 2 * i, mask=m, other=0.0)
        x2 = tl.load(src + 2 * i + 1, mask=m, other=0.0)
        if h < H + HKV:
            c = tl.load(cos_ptr + p * HALF + i, mask=m, other=0.0)
            s = tl.load(sin_ptr + p * HALF + i, mask=m, other=0.0)
            a1, a2 = x1.to(tl.float32), x2.to(tl.float32)
            e = a1 * c - a2 * s
            o = a1 * s + a2 * c
            if h < H:
                dst = q_ptr + b.to(tl.int64) * sqb + h * sqh + p * sqs
            else:
                dst = k_ptr + b.to(tl.int64) * skb + (h - H) * skh + p * sks
            tl.store(dst + 2 * i, e.to(dst.dtype.element_ty), mask=m)
            tl.store(dst + 2 * i + 1, o.to(dst.dtype.element_ty), mask=m)
        else:
            dst = v_ptr + b.to(tl.int64) * skb + (h - H - HKV) * skh + p * sks
            tl.store(dst + 2 * i, x1, mask=m)
            tl.store(dst + 2 * i + 1, x2, mask=m)


def rope_into_caches(qkv: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cq: torch.Tensor,
                     ck: torch.Tensor, cv: torch.Tensor, n_heads: int, n_kv: int, head_dim: int) -> None:
    """``qkv`` (R, (n_heads + 2 n_kv) * head_dim), rows b * T + t, the projections q | k | v of R = B * T rows;
    ``pos`` (B, T) their positions; ``cos``, ``sin`` (positions, head_dim / 2) fp32, the model's RoPE tables;
    ``cq`` (B, n_heads, slots, P), ``ck`` and ``cv`` (B, n_kv, slots, P), P >= head_dim, in ``qkv``'s dtype.
    Writes rope(q), rope(k) and v at each row's slot (its position), columns :head_dim."""
    R, W = qkv.shape
    B, T = pos.shape
    if W != (n_heads + 2 * n_kv) * head_dim or R != B * T or head_dim % 2:
        raise ValueError(f"rope_into_caches: qkv {tuple(qkv.shape)} for {B} x {T} rows of {n_heads} + 2 x {n_kv} "
                         f"heads of {head_dim}")
    if not (cq.dtype == ck.dtype == cv.dtype == qkv.dtype) or ck.stride() != cv.stride():
        raise ValueError("rope_into_caches: the caches need qkv's dtype and k and v the same layout")
    if qkv.stride(1) != 1 or cq.stride(3) != 1 or ck.stride(3) != 1:
        raise ValueError("rope_into_caches: rows and cache slots must be contiguous in their last dimension")
    if cos.dtype != torch.float32 or sin.dtype != torch.float32 or not (cos.is_contiguous() and sin.is_contiguous()):
        raise ValueError("rope_into_caches: the RoPE tables must be contiguous fp32 (models.llama.rope_tables)")
    half = head_dim // 2
    _rope_caches_kernel[(R, n_heads + 2 * n_kv)](
        qkv, pos.contiguous().view(-1), cos, sin, cq, ck, cv, T, qkv.stride(0), cq.stride(0), cq.stride(1),
        cq.stride(2), ck.stride(0), ck.stride(1), ck.stride(2), H=n_heads, HKV=n_kv, HALF=half,
        BLOCK=triton.next_power_of_2(half), num_warps=1, enable_fp_fusion=False)
