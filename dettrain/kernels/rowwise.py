"""Batch-invariant CPU ops: det.batch_invariant on CPU (dettrain's LLaMA), and what generation needs to match it.

On a CPU, torch's kernels give a row different bits in different company: ``F.linear`` of one row differs from the
same row inside a batch (BLAS picks another kernel and blocking for another M), and some elementwise kernels
(``silu``, ``sigmoid``) compute the vectorised body and the scalar tail of a tensor differently, so an element's
bits depend on where it sits (measured: docs/generate.md).  The ops here are written so that a row's (a
token's, a query's) result is a function of that row's inputs only:

* every sum is a fixed balanced tree of elementwise additions (``tree_sum``): an elementwise add, multiply,
  divide or square root is correctly rounded in every code path, so no kernel choice or thread split can move a bit;
* transcendental functions are limited to ``exp`` and ``log``, whose vector and scalar paths agree on this CPU
  (tests/test_generate.py checks it at start: ``transcendentals_agree``);
* attention walks the keys of each query in blocks of ``KEY_BLOCK`` positions counted from position 0, a tree
  inside a block and the blocks in order, and stops at the query's own block: a query's output is the same
  whether it is computed with its whole sequence (training), with a chunk of it (chunked prefill) or alone
  against a KV cache (decode), whatever the batch and whatever sits in the cache beyond its position.

Backward passes (training) use torch's matmuls on the saved inputs: deterministic for fixed shapes and threads,
which is all the tiers ask of gradients.  These ops are slow next to BLAS (a product tensor of rows x out x in
elements, in chunks of ``CHUNK_ELEMENTS``); they exist for tiny CPU models, tests and the RL example.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

KEY_BLOCK = 16
"""Keys per attention block: the tree inside a block, sequential across blocks (fixed from position 0)."""

CHUNK_ELEMENTS = 1 << 22
"""Largest product tensor (elements) one step of ``linear`` or ``attention`` materialises; rows are chunked to it
(a row's result does not depend on its chunk: every op is elementwise)."""


def tree_sum(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Sum over ``dim`` by a fixed balanced tree (the length zero-padded to a power of two): elementwise adds only,
    so each result depends on its own inputs and their count, never on the rest of the tensor."""
    x = x.movedim(dim, -1)
    n = x.shape[-1]
    p = 1 << max(n - 1, 0).bit_length()
    if p != n:
        x = F.pad(x, (0, p - n))
    while x.shape[-1] > 1:
        h = x.shape[-1] // 2
        x = x[..., :h] + x[..., h:]
    return x[..., 0]


def _rows_per_chunk(per_row: int) -> int:
    return max(1, CHUNK_ELEMENTS // max(per_row, 1))


def _mm_rows(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x (M, K) @ w (N, K).T with each output element a ``tree_sum`` of its K products."""
    M, K = x.shape
    rows = _rows_per_chunk(w.shape[0] * K)
    parts = [tree_sum(x[i:i + rows, None, :] * w, -1) for i in range(0, M, rows)]
    return torch.cat(parts) if parts else x.new_empty((0, w.shape[0]))


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        return _mm_rows(x, w)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, w = ctx.saved_tensors
        # torch's matmuls: gradients need determinism for a fixed shape, not batch invariance
        dx = dy @ w if ctx.needs_input_grad[0] else None
        dw = dy.t() @ x if ctx.needs_input_grad[1] else None
        return dx, dw


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w.T (+ bias), batch-invariant rows, in x's dtype."""
    y = _Linear.apply(x.reshape(-1, x.shape[-1]), w.to(x.dtype)).view(*x.shape[:-1], w.shape[0])
    return y if bias is None else y + bias.to(y.dtype)


def _div(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    # an elementwise division (correctly rounded); 1 / t in Python would be reciprocal(), a separate kernel
    return torch.div(a, b)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim (fp32 math), the mean of squares by ``tree_sum`` (a fixed order by construction,
    not by what torch's reduction happens to do), 1/sqrt as sqrt and a division (each correctly rounded)."""
    xf = x.float()
    ms = tree_sum(xf * xf, -1) / xf.shape[-1]
    r = _div(torch.ones_like(ms), torch.sqrt(ms + eps))
    return ((xf * r[..., None]) * w.float()).type_as(x)


def silu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(x) as x / (1 + exp(-x)): exp, add and divide agree in every code path (torch's silu does not)."""
    return _div(x, torch.exp(-x) + 1.0)


def _blocked_sum(t: torch.Tensor, dim: int, visible: torch.Tensor) -> torch.Tensor:
    """Sum of ``t`` over key axis ``dim`` (a multiple of KEY_BLOCK long): a tree inside each block, then the blocks
    in order, each block added only where ``visible`` (..., blocks) says the query reaches it."""
    t = t.movedim(dim, -1)
    nb = t.shape[-1] // KEY_BLOCK
    parts = tree_sum(t.reshape(*t.shape[:-1], nb, KEY_BLOCK), -1)  # (..., nb)
    acc = parts[..., 0]
    for b in range(1, nb):  # blocks past the query's own are skipped, not added as zeros (a -0.0 stays -0.0)
        vis = visible[..., b]
        acc = torch.where(vis.view(*vis.shape, *([1] * (acc.dim() - vis.dim()))), acc + parts[..., b], acc)
    return acc


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
              scale: float | None = None) -> torch.Tensor:
    """Causal attention of queries ``q`` (B, H, Tq, D) at positions ``q_pos`` (B, Tq) over keys/values ``k``, ``v``
    (B, HKV, Tk, D) whose slot j holds position j (HKV divides H: grouped-query attention).  Query i sees slots
    0 .. q_pos[i]; everything in later slots (future tokens, padding, an unfilled cache) is never read into its
    result.  Scores are scaled by ``scale`` (None: 1/sqrt(D)).  Output (B, H, Tq, D) in q's dtype."""
    B, H, Tq, D = q.shape
    Tk = k.shape[2]
    G = H // k.shape[1]
    pad = -Tk % KEY_BLOCK
    kf = F.pad(k.float(), (0, 0, 0, pad)).repeat_interleave(G, 1)[:, :, None]  # (B, H, 1, P, D)
    vf = F.pad(v.float(), (0, 0, 0, pad)).repeat_interleave(G, 1)[:, :, None]
    P = Tk + pad
    sc = torch.tensor(1.0 / math.sqrt(D) if scale is None else scale, dtype=torch.float32)
    slots = torch.arange(P, device=q.device)
    rows = _rows_per_chunk(B * H * P * D)  # queries per chunk
    outs = []
    for i in range(0, Tq, rows):
        qc = q[:, :, i:i + rows].float()[:, :, :, None]  # (B, H, t, 1, D)
        pos = q_pos[:, i:i + rows]  # (B, t)
        hidden = (slots[None, None, :] > pos[:, :, None])[:, None]  # (B, 1, t, P): later slots
        s = tree_sum(qc * kf, -1) * sc  # (B, H, t, P)
        s = s.masked_fill(hidden, float("-inf"))
        m = s.amax(-1, keepdim=True).detach()  # max is exact in any order; softmax does not depend on it
        p = torch.exp(s - m)
        visible = (torch.arange(0, P, KEY_BLOCK, device=q.device)[None, None, :] <= pos[:, :, None])[:, None]
        den = _blocked_sum(p, -1, visible)  # (B, H, t)
        pv = torch.where(hidden[..., None], 0.0, p[..., None] * vf)  # (B, H, t, P, D); hidden slots exact +0
        num = _blocked_sum(pv, -2, visible[..., None, :])  # (B, H, t, D)
        outs.append(_div(num, den[..., None]))
    return torch.cat(outs, 2).to(q.dtype)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """``attention`` for a training batch: q, k, v of one length T, positions 0 .. T-1 in every row."""
    B, _, T, _ = q.shape
    return attention(q, k, v, torch.arange(T, device=q.device).expand(B, T), scale)


def log_softmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """log_softmax over the last dim in fp32, per row: max (exact), ``tree_sum`` of exp, log."""
    x = logits.float()
    m = x.amax(-1, keepdim=True).detach()
    lse = m + torch.log(tree_sum(torch.exp(x - m), -1))[..., None]
    return x - lse


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(target) of each row of ``logits`` (..., V): batch-invariant, fp32."""
    return log_softmax_rows(logits).gather(-1, targets[..., None].long())[..., 0]


def transcendentals_agree(n: int = 4099) -> bool:
    """Whether torch's exp and log give an element the same bits in a vector body and a scalar tail on this CPU
    (the ops above rely on it): each value computed inside a long tensor and alone."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, generator=g) * 8
    pos = x.abs() + 1e-3
    return bool(all(torch.equal(f(t), torch.cat([f(t[i:i + 1]) for i in range(n)]))
                    for f, t in ((torch.exp, x), (torch.log, pos))))
