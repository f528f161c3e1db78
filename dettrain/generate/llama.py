"""The KV-cache forward of dettrain's LLaMA: the training forward's modules and arithmetic, one position set at a time.

Each block runs its own submodules' arithmetic (norms, projections, feed-forward: batch-invariant under
det.batch_invariant), the same RoPE arithmetic as ``apply_rope`` at each request's own positions, and the attention
the training forward runs (``rowwise.attention`` on CPU; on CUDA the training kernel, restricted to the query blocks
that hold the step's rows: ``attention_rows``), so a position's logits are the training forward's.  The cache has one
slot per position (slot j holds position j of that request), so requests of different lengths need no padding
inside it.

On CUDA with the training kernel (the exact path), a decode step has static shapes and takes its positions as a
device tensor, so it is captured once per batch as a CUDA graph and replayed for every new token
(``cuda_graphs``): the same kernels on the same buffers, launched by the graph instead of from Python.  Its
projections read the weights cast to autocast's dtype once per batch (the cast ``bi.linear`` makes on every call
otherwise: the same bits), inside ``bi.few_rows`` (the matmul tile for a few rows, ``bi.FEW_ROWS_TILE``: more programs
and a deeper pipeline over K than the training tile, the same bits).  The step takes its tokens and positions as
device tensors, so greedy decoding never waits for the host between steps (``generate.DRAIN_EVERY``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from dettrain.errors import UserError
from dettrain.kernels import attention as attn_kernel
from dettrain.kernels import batch_invariant as bi
from dettrain.kernels import rowwise
from dettrain.kernels.decode import rope_into_caches
from dettrain.models.llama import Transformer


@dataclass
class _Cache:
    k: list[torch.Tensor]
    v: list[torch.Tensor]
    q: list[torch.Tensor] | None  # the training kernel's path: every query is kept (a block's rows are read)
    total: int  # slots: the longest prompt + new tokens
    filled: int = 0  # slots written so far (an upper bound of every request's length; host-side)
    weights: dict[int, torch.Tensor] = field(default_factory=dict)  # id(param) -> its autocast-dtype copy
    graph: object = None  # torch.cuda.CUDAGraph of the decode step, once captured
    static: dict[str, torch.Tensor] = field(default_factory=dict)  # the graph's input and output buffers


def _rope_at(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``apply_rope``'s arithmetic with per-row tables: x (B, H, T, D), cos/sin (B, 1, T, D/2)."""
    x1, x2 = x.float()[..., 0::2], x.float()[..., 1::2]
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    return out.type_as(x)


class LlamaStepper:
    """prefill / decode steps over a cache for one batch of requests."""

    FUSED = True
    """On the CUDA kernel path: q|k|v and w1|w3 as one matmul each, RoPE and the cache writes as one kernel
    (``kernels.decode.rope_into_caches``), about 13 kernels a layer instead of 37, the same bits
    (``tests/test_generate_gpu.py`` runs every training-equality test with it on and off: 26 passed on an H200,
    2026-12-05).  False runs the training forward's modules one by one (the reference the tests compare)."""

    def __init__(self, model: Transformer, exact: bool, cuda_graphs: bool = True) -> None:
        self.model = model
        self.exact = exact
        self.device = model.tok_emb.weight.device
        self.cuda_graphs = cuda_graphs

    def start(self, prompts: list[list[int]], total: int) -> _Cache:
        cfg = self.model.cfg
        if total > cfg.seq_len:
            raise UserError(f"generate: prompt + max_new_tokens = {total} positions exceed model.seq_len="
                            f"{cfg.seq_len} (the RoPE table and the training context); shorten the prompt or "
                            "max_new_tokens")
        n = len(self.model.layers)
        kernel = self.device.type == "cuda" and self.exact
        return _Cache([None] * n, [None] * n, [None] * n if kernel else None, total)

    def _kernel(self, cache: _Cache, q: torch.Tensor) -> bool:
        """Whether attention runs the training kernel over the cached queries (decided once per batch)."""
        return cache.q is not None and attn_kernel.attention_active(q)

    def prefill(self, cache: _Cache, prompts: list[list[int]], chunk: int | None) -> torch.Tensor:
        """Run every prompt position (right-padded to the longest; a padded position is never a real query's key:
        it lies after the request's last position, and decode overwrites its slot before reaching it)."""
        B, n = len(prompts), max(map(len, prompts))
        toks = torch.zeros(B, n, dtype=torch.long)
        for b, p in enumerate(prompts):
            toks[b, :len(p)] = torch.tensor(p, dtype=torch.long)
        toks = toks.to(self.device)
        last_pos = torch.tensor([len(p) - 1 for p in prompts], device=self.device)
        out = None
        c = chunk or n
        for c0 in range(0, n, c):
            c1 = min(n, c0 + c)
            pos = torch.arange(c0, c1, device=self.device).expand(B, c1 - c0)
            cache.filled = max(cache.filled, c1)
            # only the row at each request's last prompt position (or the chunk's last) reaches the norm and the
            # head: both are row-wise, so a row's logits are those of the whole chunk's call
            at = (last_pos - c0).clamp(0, c1 - c0 - 1)
            logits = self._forward(cache, toks[:, c0:c1], pos, torch.full((B,), c0, device=self.device), c1, at)[:, 0]
            if out is None:
                out = logits.new_zeros(B, logits.shape[-1])
            here = (last_pos >= c0) & (last_pos < c1)  # the chunk holding each request's last prompt position
            out = torch.where(here[:, None], logits, out)
        return out

    def decode(self, cache: _Cache, tokens: torch.Tensor, positions: torch.Tensor, top: int) -> torch.Tensor:
        """Logits (B, V) of one new token per request (``tokens`` (B,)) at its own position (``positions`` (B,),
        each < ``top``); writes its key and value.  The inputs may be on the device: nothing here reads them on the
        host.  On the graph path the result is the graph's output buffer, overwritten by the next step."""
        toks = tokens.to(self.device, torch.long).view(-1, 1)
        pos = positions.to(self.device, torch.long).view(-1, 1)
        cache.filled = max(cache.filled, top)
        if cache.q is None or not self.cuda_graphs:
            L = cache.total if cache.q is not None else cache.filled
            with bi.few_rows(cache.q is not None):
                return self._forward(cache, toks, pos, pos[:, 0], L)[:, 0]
        s = cache.static
        if cache.graph is not None:
            s["toks"].copy_(toks, non_blocking=True)
            s["pos"].copy_(pos, non_blocking=True)
            cache.graph.replay()
            return s["out"]
        # first step: run it (Triton compiles what it has not yet), then capture the same step on the same buffers
        # (capture records the kernels without running them); every later step replays it.  Static shapes: the
        # attention reads all cache.total slots (keys after a row's position are masked: the same bits)
        s["toks"], s["pos"] = toks.clone(), pos.clone()
        with bi.few_rows():
            out = self._forward(cache, s["toks"], s["pos"], s["pos"][:, 0], cache.total)[:, 0].clone()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                s["out"] = self._forward(cache, s["toks"], s["pos"], s["pos"][:, 0], cache.total)[:, 0]
        cache.graph = graph
        return out

    def _weight(self, cache: _Cache, w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """w in the dtype ``bi.linear`` casts it to, cast once per batch on the kernel path."""
        if cache.q is None:
            return w
        dt = bi._autocast_dtype(x)
        if w.dtype == dt:
            return w
        got = cache.weights.get(id(w))
        if got is None or got.dtype != dt:
            got = cache.weights[id(w)] = w.to(dt)
        return got

    def _linear(self, cache: _Cache, mod, x: torch.Tensor) -> torch.Tensor:
        if cache.q is not None and bi.active(x) and mod.bias is None:  # Linear.forward's own route, its cast hoisted
            return bi.linear(x, self._weight(cache, mod.weight, x))
        return mod(x)

    def _fused(self, cache: _Cache, mods: tuple, x: torch.Tensor) -> torch.Tensor | None:
        """x times the weights of ``mods`` stacked along N, as one batch-invariant matmul (None where the
        projections do not take ``bi.linear``).  Each output column is its own weight row's product with x over K
        in the tile's fixed order, so the stacked product's columns are the separate products' bits."""
        if cache.q is None or not bi.active(x) or any(m.bias is not None for m in mods):
            return None
        dt = bi._autocast_dtype(x)
        key = ("stacked", id(mods[0].weight))
        got = cache.weights.get(key)
        if got is None or got.dtype != dt:
            got = cache.weights[key] = torch.cat([m.weight.to(dt) for m in mods])
        return bi.linear(x, got)

    def _ffn(self, cache: _Cache, ffn, x: torch.Tensor) -> torch.Tensor:
        if cache.q is None:
            return ffn(x)
        # FeedForward.forward on the CUDA route: w2(F.silu(w1(x)) * w3(x)), w1 and w3 as one matmul
        both = self._fused(cache, (ffn.w1, ffn.w3), x) if self.FUSED else None
        if both is None:
            return self._linear(cache, ffn.w2, F.silu(self._linear(cache, ffn.w1, x)) * self._linear(cache, ffn.w3, x))
        a, b = both.split(ffn.w1.weight.shape[0], dim=-1)
        return self._linear(cache, ffn.w2, F.silu(a) * b)

    def _attention_fused(self, cache: _Cache, i: int, a, h: torch.Tensor, pos: torch.Tensor, lo: torch.Tensor,
                         L: int) -> torch.Tensor | None:
        """The attention block's q, k, v projections as one matmul, RoPE and the cache writes as one kernel
        (``kernels.decode.rope_into_caches``, the eager arithmetic's bits), then the training kernel over the query
        blocks of this step's rows; None off the CUDA kernel path."""
        if not self.FUSED or cache.q is None or not self._kernel(cache, h):
            return None
        qkv = self._fused(cache, (a.wq, a.wk, a.wv), h)
        if qkv is None:
            return None
        m, (B, T) = self.model, pos.shape
        H, KV, D = a.n_heads, a.n_kv, a.head_dim
        if cache.k[i] is None:
            P = attn_kernel.padded_head_size(D)
            cache.k[i], cache.v[i] = (qkv.new_zeros(B, KV, cache.total, P) for _ in range(2))
            cache.q[i] = qkv.new_zeros(B, H, cache.total, P)
        rope_into_caches(qkv.view(B * T, -1), pos, m.rope_cos, m.rope_sin, cache.q[i], cache.k[i], cache.v[i], H, KV,
                         D)
        o = attn_kernel.attention_rows(cache.q[i][:, :, :L], cache.k[i][:, :, :L], cache.v[i][:, :, :L], lo, T,
                                       1.0 / math.sqrt(D))
        return o[..., :D]

    def _forward(self, cache: _Cache, tokens: torch.Tensor, pos: torch.Tensor, lo: torch.Tensor, L: int,
                 last: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, T, V) of ``tokens`` (B, T) at positions ``pos`` (B, T), ``pos[b] = lo[b] .. lo[b] + T - 1``;
        writes their keys and values.  Attention reads slots 0 .. L-1 (L > every position).  ``last`` (B,): only
        row ``last[b]`` of each request reaches the final norm and the head, (B, 1, V)."""
        m = self.model
        B, T = tokens.shape
        cos, sin = m.rope_cos[pos][:, None], m.rope_sin[pos][:, None]
        rows = torch.arange(B, device=self.device)[:, None]
        x = m.tok_emb(tokens)
        for i, layer in enumerate(m.layers):
            a = layer.attn
            h = layer.attn_norm(x)
            y = self._attention_fused(cache, i, a, h, pos, lo, L)
            if y is not None:
                x = x + self._linear(cache, a.wo, y.transpose(1, 2).reshape(B, T, -1))
                x = x + self._ffn(cache, layer.ffn, layer.ffn_norm(x))
                continue
            q = self._linear(cache, a.wq, h).view(B, T, a.n_heads, a.head_dim).transpose(1, 2)
            k = self._linear(cache, a.wk, h).view(B, T, a.n_kv, a.head_dim).transpose(1, 2)
            v = self._linear(cache, a.wv, h).view(B, T, a.n_kv, a.head_dim).transpose(1, 2)
            q, k = _rope_at(q, cos, sin), _rope_at(k, cos, sin)
            if cache.k[i] is None:  # in the dtype the forward gives them (autocast's on CUDA)
                self._allocate(cache, i, q, k, v)
            D = a.head_dim
            # slot = position: (B, slots, heads, D) views of the caches, written at each row's positions
            cache.k[i][..., :D].transpose(1, 2)[rows, pos] = k.transpose(1, 2)
            cache.v[i][..., :D].transpose(1, 2)[rows, pos] = v.transpose(1, 2)
            y = self._attend(cache, i, q, pos, lo, L)
            x = x + self._linear(cache, a.wo, y.transpose(1, 2).reshape(B, T, -1))
            x = x + self._ffn(cache, layer.ffn, layer.ffn_norm(x))
        if last is not None:  # one row per request, (B, 1, dim): the logits of position lo[b] + last[b] only
            x = x[torch.arange(B, device=x.device), last][:, None]
        h = m.norm(x)
        w = m.tok_emb.weight if m.output is None else m.output.weight
        if cache.q is not None and bi.active(h):
            return bi.linear(h, self._weight(cache, w, h))
        return m.head(h)

    def _allocate(self, cache: _Cache, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Zeroed caches of every slot; on the kernel path at the kernel's head size (zero columns past the model's,
        as ``attention`` pads them)."""
        D = q.shape[-1]
        P = attn_kernel.padded_head_size(D) if self._kernel(cache, q) else D
        if cache.q is not None and not self._kernel(cache, q):
            cache.q = None  # no training kernel here (det.attention=torch): the labelled fallback below
        cache.k[i], cache.v[i] = (t.new_zeros(t.shape[0], t.shape[1], cache.total, P) for t in (k, v))
        if cache.q is not None:
            cache.q[i] = q.new_zeros(q.shape[0], q.shape[1], cache.total, P)

    def _attend(self, cache: _Cache, i: int, q: torch.Tensor, pos: torch.Tensor, lo: torch.Tensor,
                L: int) -> torch.Tensor:
        D = q.shape[-1]
        k, v = cache.k[i][:, :, :L, :D], cache.v[i][:, :, :L, :D]
        if bi.cpu_active(q):
            return rowwise.attention(q, k, v, pos)
        if cache.q is not None:
            # the training kernel over the query blocks holding this step's rows (the cached queries before them
            # in their blocks are read too; a query's result depends on its own keys only: key blocks from
            # position 0, later keys masked)
            B = q.shape[0]
            cache.q[i][..., :D].transpose(1, 2)[torch.arange(B, device=q.device)[:, None], pos] = q.transpose(1, 2)
            o = attn_kernel.attention_rows(cache.q[i][:, :, :L], cache.k[i][:, :, :L], cache.v[i][:, :, :L], lo,
                                           q.shape[2], 1.0 / math.sqrt(D))
            return o[..., :D]
        # not training-equal (labelled): torch's attention with a causal mask by position
        G = q.shape[1] // k.shape[1]
        mask = torch.arange(L, device=q.device)[None, None, :] <= pos[:, :, None]
        return F.scaled_dot_product_attention(q, k.repeat_interleave(G, 1), v.repeat_interleave(G, 1),
                                              attn_mask=mask[:, None])
