"""The KV-cache forward of dettrain's LLaMA: the training forward's modules and arithmetic, one position set at a time.

Each block runs its own submodules (norms, projections, feed-forward: batch-invariant under det.batch_invariant), the
same RoPE arithmetic as ``apply_rope`` at each request's own positions, and the attention the training forward runs
(``rowwise.attention`` on CPU; on CUDA the training kernel over the cached queries), so a position's logits are the
training forward's.  The cache has one slot per position (slot j holds position j of that request), so requests of
different lengths need no padding inside it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dettrain.errors import UserError
from dettrain.kernels import attention as attn_kernel
from dettrain.kernels import batch_invariant as bi
from dettrain.kernels import rowwise
from dettrain.models.llama import Transformer


@dataclass
class _Cache:
    k: list[torch.Tensor]
    v: list[torch.Tensor]
    q: list[torch.Tensor] | None  # CUDA: the training kernel recomputes every query up to the longest position
    total: int  # slots: the longest prompt + new tokens
    filled: int = 0  # slots written so far (an upper bound of every request's length)


def _rope_at(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``apply_rope``'s arithmetic with per-row tables: x (B, H, T, D), cos/sin (B, 1, T, D/2)."""
    x1, x2 = x.float()[..., 0::2], x.float()[..., 1::2]
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    return out.type_as(x)


class LlamaStepper:
    """prefill / decode steps over a cache for one batch of requests."""

    def __init__(self, model: Transformer, exact: bool) -> None:
        self.model = model
        self.exact = exact
        self.device = model.tok_emb.weight.device

    def start(self, prompts: list[list[int]], total: int) -> _Cache:
        cfg = self.model.cfg
        if total > cfg.seq_len:
            raise UserError(f"generate: prompt + max_new_tokens = {total} positions exceed model.seq_len="
                            f"{cfg.seq_len} (the RoPE table and the training context); shorten the prompt or "
                            "max_new_tokens")
        n = len(self.model.layers)
        return _Cache([None] * n, [None] * n, [None] * n if self.device.type == "cuda" else None, total)

    def prefill(self, cache: _Cache, prompts: list[list[int]], chunk: int | None) -> torch.Tensor:
        """Run every prompt position (right-padded to the longest; a padded position is never a real query's key:
        it lies after the request's last position, and decode overwrites its slot before reaching it)."""
        B, n = len(prompts), max(map(len, prompts))
        toks = torch.zeros(B, n, dtype=torch.long, device=self.device)
        for b, p in enumerate(prompts):
            toks[b, :len(p)] = torch.tensor(p, dtype=torch.long)
        last_pos = torch.tensor([len(p) - 1 for p in prompts], device=self.device)
        out = None
        c = chunk or n
        for c0 in range(0, n, c):
            c1 = min(n, c0 + c)
            pos = torch.arange(c0, c1, device=self.device).expand(B, c1 - c0)
            logits = self._forward(cache, toks[:, c0:c1], pos)
            if out is None:
                out = logits.new_empty(B, logits.shape[-1])
            here = (last_pos >= c0) & (last_pos < c1)
            rows = here.nonzero()[:, 0]
            out[rows] = logits[rows, last_pos[rows] - c0]
        return out

    def decode(self, cache: _Cache, tokens: list[int], positions: list[int]) -> torch.Tensor:
        toks = torch.tensor(tokens, dtype=torch.long, device=self.device)[:, None]
        pos = torch.tensor(positions, device=self.device)[:, None]
        return self._forward(cache, toks, pos)[:, 0]

    def _forward(self, cache: _Cache, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Logits (B, T, V) of ``tokens`` (B, T) at positions ``pos`` (B, T); writes their keys and values."""
        m = self.model
        B, T = tokens.shape
        cos, sin = m.rope_cos[pos][:, None], m.rope_sin[pos][:, None]
        cache.filled = max(cache.filled, int(pos.max()) + 1)
        rows = torch.arange(B, device=self.device)[:, None]
        x = m.tok_emb(tokens)
        for i, layer in enumerate(m.layers):
            a = layer.attn
            h = layer.attn_norm(x)
            q = a.wq(h).view(B, T, a.n_heads, a.head_dim).transpose(1, 2)
            k = a.wk(h).view(B, T, a.n_kv, a.head_dim).transpose(1, 2)
            v = a.wv(h).view(B, T, a.n_kv, a.head_dim).transpose(1, 2)
            q, k = _rope_at(q, cos, sin), _rope_at(k, cos, sin)
            if cache.k[i] is None:  # in the dtype the forward gives them (autocast's on CUDA)
                cache.k[i], cache.v[i] = (t.new_zeros(B, t.shape[1], cache.total, t.shape[3]) for t in (k, v))
                if cache.q is not None:
                    cache.q[i] = q.new_zeros(B, q.shape[1], cache.total, q.shape[3])
            # slot = position: (B, slots, heads, D) views of the caches, written at each row's positions
            cache.k[i].transpose(1, 2)[rows, pos] = k.transpose(1, 2)
            cache.v[i].transpose(1, 2)[rows, pos] = v.transpose(1, 2)
            y = self._attend(cache, i, q, pos, rows)
            x = x + a.wo(y.transpose(1, 2).reshape(B, T, -1))
            x = x + layer.ffn(layer.ffn_norm(x))
        return m.head(m.norm(x))

    def _attend(self, cache: _Cache, i: int, q: torch.Tensor, pos: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        L = cache.filled
        k, v = cache.k[i][:, :, :L], cache.v[i][:, :, :L]
        if bi.cpu_active(q):
            return rowwise.attention(q, k, v, pos)
        if cache.q is not None and attn_kernel.attention_active(q):
            # the training kernel over every cached query up to L; each request's rows at its positions.  A query's
            # result there depends on its own keys only (key blocks from position 0, later keys masked)
            cache.q[i].transpose(1, 2)[rows, pos] = q.transpose(1, 2)
            o = attn_kernel.attention(cache.q[i][:, :, :L], k, v)
            return o.transpose(1, 2)[rows, pos].transpose(1, 2)
        # not training-equal (labelled): torch's attention with a causal mask by position
        G = q.shape[1] // k.shape[1]
        mask = torch.arange(L, device=q.device)[None, None, :] <= pos[:, :, None]
        return F.scaled_dot_product_attention(q, k.repeat_interleave(G, 1), v.repeat_interleave(G, 1),
                                              attn_mask=mask[:, None])
