"""Fused elementwise ops over the flat fp32 buffers of tiers 3-4 (Triton on CUDA, torch elsewhere).

``adamw_`` is FlatAdamW's update in one pass over memory (read g, p, m, v; write p, m, v) instead of ~14 torch
kernels.  It performs exactly the torch reference's sequence of correctly rounded fp32 operations (mul, add, sqrt,
div: Triton's multiply-add fusion is switched off for it, sqrt and div are the IEEE round-to-nearest forms), so both
paths give the same bits and an element's result does not depend on which slice or shard it is updated in.
"""

from __future__ import annotations

import math
import os

import torch

from dettrain.kernels._triton import HAVE_TRITON, tl, triton, unavailable_reason

ADAMW_BLOCK = 2048


def _fast(t: torch.Tensor, impl: str) -> bool:
    """Whether to use the Triton kernel: impl 'auto' (CUDA tensor, Triton importable, DETTRAIN_TORCH_OPS unset),
    'torch' (the reference) or 'triton' (required)."""
    if impl == "torch":
        return False
    ok = HAVE_TRITON and t.is_cuda
    if impl == "triton":
        if not ok:
            raise RuntimeError("kernels.optim.adamw_: impl='triton' needs Triton and a CUDA tensor"
                               + (f" ({unavailable_reason()})" if not HAVE_TRITON else ""))
        return True
    return ok and os.environ.get("DETTRAIN_TORCH_OPS", "") != "1"


if HAVE_TRITON:

    @triton.jit
    def _adamw_kernel(p_ptr, g_ptr, m_ptr, v_ptr, n, b1, c1, b2, c2, decay, inv_sqrt_bc2, eps, step_size,
                      BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        g = tl.load(g_ptr + offs, mask=mask)
        p = tl.load(p_ptr + offs, mask=mask)
        m = tl.load(m_ptr + offs, mask=mask)
        v = tl.load(v_ptr + offs, mask=mask)
        # one correctly rounded fp32 op per line, in the torch reference's order (launched with fp fusion off)
        m = m * b1 + g * c1
        v = v * b2 + (g * g) * c2
        p = p * decay
        denom = tl.sqrt_rn(v) * inv_sqrt_bc2 + eps
        p = p - tl.div_rn(m, denom) * step_size
        tl.store(m_ptr + offs, m, mask=mask)
        tl.store(v_ptr + offs, v, mask=mask)
        tl.store(p_ptr + offs, p, mask=mask)


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
        with torch.cuda.device(p.device):
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
