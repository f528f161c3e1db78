"""Causal flash attention, forward and backward, deterministic, and batch-invariant in batch-invariant mode (Triton on
CUDA).

One program per (batch, head, query block) walks the key blocks in a fixed order (online softmax in log2 units;
outside batch-invariant mode, on Hopper, cuDNN's forward, which has the same structure: ``cudnn_forward``);
the backward computes dK/dV per key block, looping over the query blocks and the query heads of a GQA group in a
fixed order, and dQ per query block, with no atomics.  The dQ pass either recomputes S, P and dP (three products a
step) or, at head size 128, reads the dS that the dK/dV pass stored (one product a step; same bits; 16-bit dS for
the causal half, B*H*T*T/2 values held during the call, slice by slice past ``DS_MAX_BYTES``).  Block sizes are a
function of the head size and the GQA group only (``_attn_blocks``), never of the batch, so a sample's arithmetic
never changes with what else is in the batch.

Two switches route models/llama.py's attention here (``attention_active``): batch-invariant mode
(``batch_invariant.set_enabled``, ``det.batch_invariant``), or ``set_attention``, which the trainer sets from
det.attention (dettrain/models/attention.py routes Hugging Face models and F.scaled_dot_product_attention callers by the
same switch).  ``attention`` is the torch custom op ``torch.ops.dettrain.bi_attention`` (its backward
``bi_attention_bwd``), registered like batch_invariant.py's ops: a CPU reference, the Triton kernels on CUDA, a fake
for tracing (see "custom ops" there).
"""

from __future__ import annotations

import functools
import math
import os
import struct

import torch
import torch.nn.functional as F

from dettrain.errors import UserError
from dettrain.kernels import batch_invariant as bi
from dettrain.kernels._triton import HAVE_TRITON, tl, triton, unavailable_reason
from dettrain.kernels._triton import acc as _f
from dettrain.kernels._triton import custom_op as _custom_op
from dettrain.kernels._triton import on_device as _on

_MODE = "off"
_STRICT = False
MODES = ("off", "cuda", "always", "never")
"""set_attention's modes: ``off`` (the kernel only under batch-invariant mode, on CUDA), ``cuda`` (every CUDA call:
det.attention=auto at det.tier >= 2), ``always`` (every call, the CPU reference on CPU: det.attention=dettrain),
``never`` (torch's attention, even under batch-invariant mode: det.attention=torch)."""


def set_attention(mode: bool | str, strict: bool = False) -> None:
    """Route models/llama.py's attention (and models/attention.py's SDPA/HF entry points) here; True means
    ``cuda``, False ``off``.  ``strict``: a call the kernel cannot serve is an error instead of going to torch
    (det.attention=dettrain).  The trainer sets both from det.attention (models/attention.py): ``cuda`` at
    det.tier >= 2 on CUDA by default, because the kernel is deterministic by construction (no atomics) and faster
    than SDPA's deterministic backward (BENCHMARKS.md: 1b 1.28 vs 1.61 ms, 7B shape 1.70 vs 2.96 ms per layer,
    forward + backward); cuDNN's SDPA does not run at all under torch's deterministic mode (torch 2.11: "No
    available kernel"), and at the 7B shape this backward takes 0.93x the time of cuDNN's non-deterministic one."""
    global _MODE, _STRICT
    mode = {True: "cuda", False: "off"}[mode] if isinstance(mode, bool) else str(mode)
    if mode not in MODES:
        raise ValueError(f"set_attention({mode!r}): use one of {MODES}")
    if mode == "cuda" and not HAVE_TRITON:
        raise RuntimeError(f"dettrain's attention kernel needs Triton on a CUDA machine: {unavailable_reason()}")
    _MODE, _STRICT = mode, bool(strict)


def attention_mode() -> str:
    """The mode set by ``set_attention``."""
    return _MODE


def attention_strict() -> bool:
    """Whether a call the kernel cannot serve is an error (det.attention=dettrain)."""
    return _STRICT


def attention_active(q: torch.Tensor) -> bool:
    """Whether the attention of ``q`` runs here: mode ``always``; or ``cuda`` / batch-invariant mode with q on CUDA;
    never in mode ``never``."""
    if _MODE in ("always", "never"):
        return _MODE == "always"
    return (bi.enabled() or _MODE == "cuda") and q.is_cuda


LOG2E = 1.4426950408889634

if HAVE_TRITON:
    # ---------------------------------------------------------------------------------------------------------
    # causal attention: q (B, H, T, D), k/v (B, HKV, T, D); scores in log2 units (exp2)
    # ---------------------------------------------------------------------------------------------------------
    @triton.jit
    def _attn_fwd_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, qk_scale,
                         sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sob, soh, sot,
                         H, GROUP, T, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BLK: tl.constexpr,
                         lo_ptr=None, N_ROWS=0, ROWS: tl.constexpr = False):
        # BLK: the grid axis of the query block (the other one is batch x head); see _launch.
        # ROWS (attention_rows): only the query blocks holding rows lo[b] .. lo[b] + N_ROWS - 1 of each batch row
        # b run (grid axis 0: those blocks, axis 1: batch x head); each block's arithmetic is the training one's
        if ROWS:
            bh = tl.program_id(1)
            b = (bh // H).to(tl.int64)
            lo = tl.load(lo_ptr + b).to(tl.int32)
            # a program past the last block redoes it (the same bits stored twice): no block past the rows runs
            start_m = tl.minimum(lo // BM + tl.program_id(0), (lo + N_ROWS - 1) // BM)
        else:
            start_m = tl.num_programs(BLK) - 1 - tl.program_id(BLK)  # last query blocks (the longest loops) first
            bh = tl.program_id(1 - BLK)
            b = (bh // H).to(tl.int64)
        h = bh % H
        hk = (h // GROUP).to(tl.int64)
        offs_m = start_m * BM + tl.arange(0, BM)
        offs_n = tl.arange(0, BN)
        offs_d = tl.arange(0, D)
        q = tl.load(q_ptr + b * sqb + h.to(tl.int64) * sqh + offs_m[:, None] * sqt + offs_d[None, :],
                    mask=offs_m[:, None] < T, other=0.0)
        k_base = k_ptr + b * skb + hk * skh
        v_base = v_ptr + b * svb + hk * svh
        m_i = tl.full((BM,), float("-inf"), tl.float32)
        l_i = tl.zeros((BM,), tl.float32)
        acc = tl.zeros((BM, D), tl.float32)
        lo_diag = start_m * BM
        # key blocks entirely below the diagonal: no mask
        for start_n in range(0, lo_diag, BN):
            kt = tl.load(k_base + (start_n + offs_n)[None, :] * skt + offs_d[:, None])
            s = tl.dot(q, kt) * qk_scale
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            p = tl.exp2(s - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(v_base + (start_n + offs_n)[:, None] * svt + offs_d[None, :])
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        # the diagonal band: causal and length masks
        for start_n in range(lo_diag, tl.minimum(lo_diag + BM, T), BN):
            cols = start_n + offs_n
            kt = tl.load(k_base + cols[None, :] * skt + offs_d[:, None], mask=cols[None, :] < T, other=0.0)
            s = tl.dot(q, kt) * qk_scale
            s = tl.where((cols[None, :] <= offs_m[:, None]) & (cols[None, :] < T), s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            p = tl.exp2(s - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(v_base + cols[:, None] * svt + offs_d[None, :], mask=cols[:, None] < T, other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        acc = acc / l_i[:, None]
        if ROWS:  # output row r holds query row lo + r
            r = offs_m - lo
            rmask = (r >= 0) & (r < N_ROWS) & (offs_m < T)
            tl.store(o_ptr + b * sob + h.to(tl.int64) * soh + r[:, None] * sot + offs_d[None, :],
                     acc.to(o_ptr.dtype.element_ty), mask=rmask[:, None])
        else:
            rmask = offs_m < T
            tl.store(o_ptr + b * sob + h.to(tl.int64) * soh + offs_m[:, None] * sot + offs_d[None, :],
                     acc.to(o_ptr.dtype.element_ty), mask=rmask[:, None])
            tl.store(lse_ptr + bh.to(tl.int64) * T + offs_m, m_i + tl.log2(l_i), mask=rmask)

    @triton.jit
    def _attn_delta_kernel(o_ptr, do_ptr, delta_ptr, H, T, sob, soh, sot, sdb, sdh, sdt,
                           D: tl.constexpr, BM: tl.constexpr):
        start_m = tl.program_id(0)
        bh = tl.program_id(1)
        b = (bh // H).to(tl.int64)
        h = (bh % H).to(tl.int64)
        offs_m = start_m * BM + tl.arange(0, BM)
        offs_d = tl.arange(0, D)
        mask = offs_m[:, None] < T
        o = tl.load(o_ptr + b * sob + h * soh + offs_m[:, None] * sot + offs_d[None, :], mask=mask, other=0.0)
        do = tl.load(do_ptr + b * sdb + h * sdh + offs_m[:, None] * sdt + offs_d[None, :], mask=mask, other=0.0)
        delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
        tl.store(delta_ptr + bh.to(tl.int64) * T + offs_m, delta, mask=offs_m < T)

    @triton.jit
    def _dkdv_blocks(dk, dv, k, v, q_base, do_base, lse_row, delta_row, offs_n, offs_m0, offs_d, lo, hi, sqt, sdt,
                     qk_scale, T, ds_base, start_n, BM: tl.constexpr, BN: tl.constexpr, CAUSAL: tl.constexpr,
                     EVEN: tl.constexpr, STORE_DS: tl.constexpr):
        # query blocks [lo, hi) in order, added into dk, dv; CAUSAL: the band that straddles the diagonal (mask
        # needed); EVEN: T is a multiple of the blocks (no length mask).  The masks only zero what the band and
        # the tail would otherwise add, so splitting the loop changes no value.  STORE_DS: also write dS (as the
        # 16-bit value the dK product uses) to this key block's column of the dS buffer (``_ds_per_head``), for the
        # dQ pass
        for start_m in range(lo, hi, BM):
            offs_m = start_m + offs_m0
            if EVEN:
                qt = tl.load(q_base + offs_m[None, :] * sqt + offs_d[:, None])
                lse = tl.load(lse_row + offs_m)
                do = tl.load(do_base + offs_m[:, None] * sdt + offs_d[None, :])
                delta = tl.load(delta_row + offs_m)
            else:
                mmask = offs_m < T
                qt = tl.load(q_base + offs_m[None, :] * sqt + offs_d[:, None], mask=mmask[None, :], other=0.0)
                lse = tl.load(lse_row + offs_m, mask=mmask, other=0.0)
                do = tl.load(do_base + offs_m[:, None] * sdt + offs_d[None, :], mask=mmask[:, None], other=0.0)
                delta = tl.load(delta_row + offs_m, mask=mmask, other=0.0)
            st = tl.dot(k, qt) * qk_scale  # (BN, BM) = scores transposed
            pt = tl.exp2(st - lse[None, :])
            if CAUSAL:
                pt = tl.where(offs_m[None, :] >= offs_n[:, None], pt, 0.0)
            if not EVEN:
                pt = tl.where(mmask[None, :], pt, 0.0)
            dv += tl.dot(pt.to(do.dtype), do)
            dpt = tl.dot(v, tl.trans(do))
            dst = pt * (dpt - delta[None, :])
            dk += tl.dot(dst.to(qt.dtype), tl.trans(qt))
            if STORE_DS:
                ds_ptrs = ds_base + (offs_m - start_n)[None, :] * BN + (offs_n - start_n)[:, None]
                if EVEN:
                    tl.store(ds_ptrs, dst.to(ds_base.dtype.element_ty))
                else:
                    tl.store(ds_ptrs, dst.to(ds_base.dtype.element_ty), mask=mmask[None, :])
        return dk, dv

    @triton.jit
    def _attn_bwd_dkdv_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, qk_scale, sm_scale,
                              sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sdb, sdh, sdt,
                              sdkb, sdkh, sdkt, sdvb, sdvh, sdvt,
                              H, HKV, GROUP, T, ds_ptr, ds_per_head, part_ptr, D: tl.constexpr, BM: tl.constexpr,
                              BN: tl.constexpr, EVEN: tl.constexpr, STORE_DS: tl.constexpr, BLK: tl.constexpr,
                              SPLIT: tl.constexpr):
        # one program per (batch, kv head, key block) and, with SPLIT > 1, per SPLIT-th of the GQA group: loops over
        # its query heads, then over query blocks from the diagonal down, in a fixed order: dK and dV are sums with
        # one order, no atomics.  SPLIT > 1: the program's sums are partial, written unscaled in fp32 to part_ptr
        # (2 x SPLIT x pairs x T x D: dK's, then dV's) for _attn_bwd_kv_sum_kernel to add in group order.  Key
        # block 0 has the longest loop; BLK as in the forward
        nblk = tl.program_id(BLK)
        start_n = nblk * BN
        bhs = tl.program_id(1 - BLK)
        bhk = bhs // SPLIT
        part = bhs % SPLIT
        b = (bhk // HKV).to(tl.int64)
        hk = (bhk % HKV).to(tl.int64)
        offs_n = start_n + tl.arange(0, BN)
        offs_m0 = tl.arange(0, BM)
        offs_d = tl.arange(0, D)
        nmask = offs_n[:, None] < T
        k = tl.load(k_ptr + b * skb + hk * skh + offs_n[:, None] * skt + offs_d[None, :], mask=nmask, other=0.0)
        v = tl.load(v_ptr + b * svb + hk * svh + offs_n[:, None] * svt + offs_d[None, :], mask=nmask, other=0.0)
        dk = tl.zeros((BN, D), tl.float32)
        dv = tl.zeros((BN, D), tl.float32)
        # first query block that sees this key block (BM divides BN or vice versa: the band start is aligned), and
        # the first one entirely below the diagonal
        lo = (start_n // BM) * BM
        band_hi = tl.cdiv(start_n + BN, BM) * BM
        # this key block's column of the dS buffer: rows start_n .. T-1 (above them dS is 0) of BN values each
        ds_col = BN * (nblk * T - start_n * (nblk - 1) // 2)
        heads = GROUP // SPLIT
        for g in range(part * heads, part * heads + heads):
            h = hk * GROUP + g
            bh = b * H + h
            q_base = q_ptr + b * sqb + h * sqh
            do_base = do_ptr + b * sdb + h * sdh
            lse_row = lse_ptr + bh * T
            delta_row = delta_ptr + bh * T
            ds_base = ds_ptr + bh * ds_per_head + ds_col
            dk, dv = _dkdv_blocks(dk, dv, k, v, q_base, do_base, lse_row, delta_row, offs_n, offs_m0, offs_d, lo,
                                  tl.minimum(band_hi, T), sqt, sdt, qk_scale, T, ds_base, start_n, BM=BM, BN=BN,
                                  CAUSAL=True, EVEN=EVEN, STORE_DS=STORE_DS)
            dk, dv = _dkdv_blocks(dk, dv, k, v, q_base, do_base, lse_row, delta_row, offs_n, offs_m0, offs_d,
                                  band_hi, T, sqt, sdt, qk_scale, T, ds_base, start_n, BM=BM, BN=BN,
                                  CAUSAL=False, EVEN=EVEN, STORE_DS=STORE_DS)
        if SPLIT == 1:
            dk = dk * sm_scale
            tl.store(dk_ptr + b * sdkb + hk * sdkh + offs_n[:, None] * sdkt + offs_d[None, :],
                     dk.to(dk_ptr.dtype.element_ty), mask=nmask)
            tl.store(dv_ptr + b * sdvb + hk * sdvh + offs_n[:, None] * sdvt + offs_d[None, :],
                     dv.to(dv_ptr.dtype.element_ty), mask=nmask)
        else:
            pairs = tl.num_programs(1 - BLK) // SPLIT
            rows = (part * pairs + bhk).to(tl.int64) * T + offs_n[:, None]
            tl.store(part_ptr + rows * D + offs_d[None, :], dk, mask=nmask)
            tl.store(part_ptr + (SPLIT * pairs * T + rows) * D + offs_d[None, :], dv, mask=nmask)

    @triton.jit
    def _attn_bwd_kv_sum_kernel(part_ptr, dk_ptr, dv_ptr, sm_scale, HKV, T, sdkb, sdkh, sdkt, sdvb, sdvh, sdvt,
                                D: tl.constexpr, BT: tl.constexpr, SPLIT: tl.constexpr):
        # dK and dV of one (batch, kv head) pair, BT rows a program: the dK/dV pass's SPLIT partial sums added in
        # the order of their query-head groups, ((p_0 + p_1) + p_2) + ..., then dK scaled, as the unsplit pass
        # does with its one sum
        bhk = tl.program_id(1)
        pairs = tl.num_programs(1)
        b = (bhk // HKV).to(tl.int64)
        hk = (bhk % HKV).to(tl.int64)
        offs_t = tl.program_id(0) * BT + tl.arange(0, BT)
        offs_d = tl.arange(0, D)
        mask = offs_t[:, None] < T
        rows = bhk.to(tl.int64) * T + offs_t[:, None]
        per = pairs.to(tl.int64) * T
        dk = tl.load(part_ptr + rows * D + offs_d[None, :], mask=mask, other=0.0)
        dv = tl.load(part_ptr + (SPLIT * per + rows) * D + offs_d[None, :], mask=mask, other=0.0)
        for p in tl.static_range(1, SPLIT):
            dk += tl.load(part_ptr + (p * per + rows) * D + offs_d[None, :], mask=mask, other=0.0)
            dv += tl.load(part_ptr + ((SPLIT + p) * per + rows) * D + offs_d[None, :], mask=mask, other=0.0)
        dk = dk * sm_scale
        tl.store(dk_ptr + b * sdkb + hk * sdkh + offs_t[:, None] * sdkt + offs_d[None, :],
                 dk.to(dk_ptr.dtype.element_ty), mask=mask)
        tl.store(dv_ptr + b * sdvb + hk * sdvh + offs_t[:, None] * sdvt + offs_d[None, :],
                 dv.to(dv_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _dq_blocks(dq, q, do, lse, delta, k_base, v_base, offs_m, offs_n0, offs_d, lo, hi, skt, svt, qk_scale, T,
                   BN: tl.constexpr, CAUSAL: tl.constexpr, EVEN: tl.constexpr):
        # key blocks [lo, hi) in order, added into dq; CAUSAL / EVEN as in _dkdv_blocks
        for start_n in range(lo, hi, BN):
            offs_n = start_n + offs_n0
            if EVEN:
                kt = tl.load(k_base + offs_n[None, :] * skt + offs_d[:, None])
                vt = tl.load(v_base + offs_n[None, :] * svt + offs_d[:, None])
            else:
                nmask = offs_n < T
                kt = tl.load(k_base + offs_n[None, :] * skt + offs_d[:, None], mask=nmask[None, :], other=0.0)
                vt = tl.load(v_base + offs_n[None, :] * svt + offs_d[:, None], mask=nmask[None, :], other=0.0)
            s = tl.dot(q, kt) * qk_scale
            p = tl.exp2(s - lse[:, None])
            if CAUSAL:
                p = tl.where(offs_n[None, :] <= offs_m[:, None], p, 0.0)
            if not EVEN:
                p = tl.where(nmask[None, :], p, 0.0)
            dp = tl.dot(do, vt)
            ds = p * (dp - delta[:, None])
            dq += tl.dot(ds.to(kt.dtype), tl.trans(kt))
        return dq

    @triton.jit
    def _attn_bwd_dq_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, qk_scale, sm_scale,
                            sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sdb, sdh, sdt, sdqb, sdqh, sdqt,
                            H, GROUP, T, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, EVEN: tl.constexpr,
                            BLK: tl.constexpr):
        # query blocks launched last-first: the longest loops start first (the causal triangle's tail is short);
        # BLK as in the forward
        start_m = (tl.num_programs(BLK) - 1 - tl.program_id(BLK)) * BM
        bh = tl.program_id(1 - BLK)
        b = (bh // H).to(tl.int64)
        h = (bh % H).to(tl.int64)
        hk = h // GROUP
        offs_m = start_m + tl.arange(0, BM)
        offs_n0 = tl.arange(0, BN)
        offs_d = tl.arange(0, D)
        mmask = offs_m < T
        q = tl.load(q_ptr + b * sqb + h * sqh + offs_m[:, None] * sqt + offs_d[None, :], mask=mmask[:, None],
                    other=0.0)
        do = tl.load(do_ptr + b * sdb + h * sdh + offs_m[:, None] * sdt + offs_d[None, :], mask=mmask[:, None],
                     other=0.0)
        lse = tl.load(lse_ptr + bh.to(tl.int64) * T + offs_m, mask=mmask, other=0.0)
        delta = tl.load(delta_ptr + bh.to(tl.int64) * T + offs_m, mask=mmask, other=0.0)
        k_base = k_ptr + b * skb + hk * skh
        v_base = v_ptr + b * svb + hk * svh
        dq = tl.zeros((BM, D), tl.float32)
        # key blocks entirely left of the diagonal (every column < start_m <= every row: no mask, and inside T),
        # then the band that straddles it
        band_lo = (start_m // BN) * BN
        dq = _dq_blocks(dq, q, do, lse, delta, k_base, v_base, offs_m, offs_n0, offs_d, 0, band_lo, skt, svt,
                        qk_scale, T, BN=BN, CAUSAL=False, EVEN=True)
        dq = _dq_blocks(dq, q, do, lse, delta, k_base, v_base, offs_m, offs_n0, offs_d, band_lo,
                        tl.minimum(start_m + BM, T), skt, svt, qk_scale, T, BN=BN, CAUSAL=True, EVEN=EVEN)
        dq = dq * sm_scale
        tl.store(dq_ptr + b * sdqb + h * sdqh + offs_m[:, None] * sdqt + offs_d[None, :],
                 dq.to(dq_ptr.dtype.element_ty), mask=mmask[:, None])


    @triton.jit
    def _attn_bwd_dq_ds_kernel(ds_ptr, k_ptr, dq_ptr, sm_scale, skb, skh, skt, sdqb, sdqh, sdqt, ds_per_head,
                               H, GROUP, T, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                               EVEN: tl.constexpr, BLK: tl.constexpr):
        # dQ of one query block from the dS the dK/dV pass stored: dQ = sum over key blocks, in order, of dS K (one
        # product a step instead of recomputing S, P and dP); the longest loops start first (BLK as in the forward)
        start_m = (tl.num_programs(BLK) - 1 - tl.program_id(BLK)) * BM
        bh = tl.program_id(1 - BLK).to(tl.int64)
        b = bh // H
        hk = (bh % H) // GROUP
        offs_m = start_m + tl.arange(0, BM)
        offs_j = tl.arange(0, BN)
        offs_d = tl.arange(0, D)
        mmask = offs_m < T
        k_base = k_ptr + b * skb + hk * skh
        ds_head = ds_ptr + bh * ds_per_head
        dq = tl.zeros((BM, D), tl.float32)
        # key blocks entirely left of this query block (every row of it is stored in their columns), then the
        # ones that reach into it (rows above a column's first row are not stored: dS is 0 there)
        n_full = start_m // BN
        for n in range(0, n_full):
            col = ds_head + BN * (n * T - n * BN * (n - 1) // 2)  # < 2^31 within one head
            r = offs_m - n * BN
            if EVEN:
                ds = tl.load(col + r[:, None] * BN + offs_j[None, :])
            else:
                ds = tl.load(col + r[:, None] * BN + offs_j[None, :], mask=mmask[:, None], other=0.0)
            kk = tl.load(k_base + (n * BN + offs_j)[:, None] * skt + offs_d[None, :])
            dq += tl.dot(ds, kk)
        for n in range(n_full, tl.cdiv(tl.minimum(start_m + BM, T), BN)):
            col = ds_head + BN * (n * T - n * BN * (n - 1) // 2)
            r = offs_m - n * BN
            ds = tl.load(col + r[:, None] * BN + offs_j[None, :], mask=((r >= 0) & mmask)[:, None], other=0.0)
            kk = tl.load(k_base + (n * BN + offs_j)[:, None] * skt + offs_d[None, :],
                         mask=(n * BN + offs_j)[:, None] < T, other=0.0)
            dq += tl.dot(ds, kk)
        dq = dq * sm_scale
        tl.store(dq_ptr + b * sdqb + (bh % H) * sdqh + offs_m[:, None] * sdqt + offs_d[None, :],
                 dq.to(dq_ptr.dtype.element_ty), mask=mmask[:, None])


# ---- host side --------------------------------------------------------------------------------------------------
def _attn_blocks(D: int, group: int = 1) -> dict:
    """(BLOCK_M, BLOCK_N, warps, stages) of the forward kernel and of each backward kernel (dK/dV, dQ), and whether
    the dK/dV pass stores dS for the dQ pass (``ds``: the dQ pass then does one product a step instead of three).
    A function of the head size and the GQA group only (model properties), never of batch size, so a sample's
    arithmetic never changes with the batch.  Chosen by the sweeps in BENCHMARKS.md (H200, bf16: `bench/bench_gpu.py
    attn-sweep` for the forward, `attn-bwd-sweep` and `attn-det` for the backward, at the trainer's micro-batch
    shapes).  Storing dS gives the same bits as recomputing it (the GPU tests check it); it costs B*H*T*T/2 16-bit
    values for the length of one backward call, so it is used where it was clearly faster: head size 128 (the 7B
    shape: 0.93x cuDNN's backward time against 1.13x recomputing; at head size 64 it gained nothing measurable)."""
    split = {"split": kv_split(group, D)}
    if D <= 64:
        if group > 1:
            return {"fwd": (128, 64, 8, 3), "dkdv": (64, 64, 4, 3), "dq": (64, 64, 4, 3), **split}
        return {"fwd": (128, 64, 8, 3), "dkdv": (32, 64, 4, 4), "dq": (64, 64, 4, 3), **split}
    return {"fwd": (64, 64, 4, 3), "dkdv": (32, 64, 4, 4), "dq": (64, 64, 4, 4), "ds": True, **split}


KV_SPLIT_ENV = "DETTRAIN_ATTN_KV_SPLIT"
"""Into how many parts the dK/dV pass splits each GQA group's query heads (``kv_split``); unset: the default."""
KV_SPLIT_DEFAULT = 4
"""The parts a GQA group is split into at head sizes up to 64 (none above): chosen on one H100 (torch 2.11,
2026-12-07; BENCHMARKS.md, "The dK/dV pass split"): at the 1b shape's batch of one, 4 parts took the backward from
0.588 to 0.490 ms (medians of three) and tier 3 through the CLI from 0.963x to 1.026x tier 0, while micro-batch 8
stayed level."""


def kv_split(group: int, D: int = 64) -> int:
    """Into how many parts the dK/dV pass splits a GQA group of ``group`` query heads at head size ``D``: each
    part's heads run in a program of their own, which writes its partial dK and dV in fp32, and
    ``_attn_bwd_kv_sum_kernel`` adds the parts in group order.  One part is one program per (batch, kv head, key
    block) looping over the whole group; with few such programs (a batch of one at the 1b shape: 4 kv heads x 32 key
    blocks for 132 SMs) the longest causal loop, 8 heads x 32 query blocks, sets the kernel's time, and more parts
    shorten it.  A function of the group and the head size only (model properties, never the batch), so a sample's
    bits are the same in every batch and on every rerun; the parts' sum is another order of the same additions than
    one program's, so the bits differ from the unsplit pass's.  Default: ``KV_SPLIT_DEFAULT`` parts at head sizes up
    to 64, one above (head size 128 is unmeasured split).  ``DETTRAIN_ATTN_KV_SPLIT=N`` asks for N parts at every
    head size (1: never split).  The group takes the largest divisor of its size that divides the parts asked for (a
    group of one is never split)."""
    value = os.environ.get(KV_SPLIT_ENV, "").strip()
    if not value:
        return math.gcd(KV_SPLIT_DEFAULT, group) if D <= 64 else 1
    if not value.isdigit() or int(value) < 1:
        raise UserError(f"{KV_SPLIT_ENV}={value!r}: expected a positive integer (the parts each GQA group's query "
                         "heads are split into in the attention backward; 1 never splits), or unset it for the "
                         f"default ({KV_SPLIT_DEFAULT} at head sizes up to 64)")
    return math.gcd(int(value), group)


def _attn_blocks_two_pass(D: int, group: int = 1) -> dict:
    """The blocks of the backward that recomputes S, P and dP in its dQ pass, as chosen before dS was stored
    (kept for comparison; `bench_gpu.py attn-bwd-sweep` sweeps them)."""
    lib = _attn_blocks(D, group)
    fwd, split = lib["fwd"], {"split": lib.get("split", 1)}
    if D <= 64:
        if group > 1:
            return {"fwd": fwd, "dkdv": (64, 64, 4, 3), "dq": (64, 64, 4, 3), **split}
        return {"fwd": fwd, "dkdv": (32, 64, 4, 4), "dq": (64, 64, 4, 3), **split}
    return {"fwd": fwd, "dkdv": (32, 64, 4, 4), "dq": (128, 64, 8, 3), **split}


ATTN_BLOCK_OVERRIDE: dict | None = None  # benchmarks only


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _launch(n_blocks: int, n_heads: int, cfg: dict,
            device: torch.device | None = None) -> tuple[tuple[int, int], int]:
    """(grid, BLK) of a causal kernel with ``n_blocks`` blocks of the sequence for each of ``n_heads`` (batch, head)
    pairs.  The CUDA scheduler starts programs in the order of their linear index, grid axis 0 fastest, and each
    kernel maps its first block index to the block with the longest loop (the first key block, the last query
    block).  Two orders:

    - "per-head" (BLK = 0, the block on the fast axis; the first order the kernel had): the
      programs of one head start together and share its rows in L2.
    - "longest-first" (BLK = 1, the block on the slow axis): every head's longest program starts in the first
      wave and the short ones fill the tail.

    With many programs for the SMs there are many waves, the tail is short either way, and per-head was faster
    (H200, backward ms: 125m 0.565 against 0.655, 7B 0.90 against 1.14).  With few, long programs (the 1b
    shape's dK/dV pass: 16 (batch, kv head) pairs x 32 key blocks, each looping over 8 query heads) per-head
    started the last pairs' longest programs last and the tail ran on a few SMs: 0.76-0.86 ms against 0.60-0.67
    (BENCHMARKS.md).  ``cfg["launch"]`` picks one; "auto" (the default) takes longest-first when the kernel has at
    most 8 programs per SM.  Only the order in which programs start changes: each program's arithmetic, and so
    every bit, is the same in either order, on any device (``tests/test_attention_bwd_gpu.py``), so the choice may
    depend on the batch.  The block's axis is limited to 65,535 programs, a bound T / BLOCK never nears."""
    order = cfg.get("launch", "auto")
    if order == "auto":
        on_gpu = device is not None and device.type == "cuda"
        sms = _sm_count(torch.cuda.current_device() if device.index is None else device.index) if on_gpu else 0
        order = "longest-first" if n_heads * n_blocks <= 8 * sms else "per-head"
    if order == "per-head":
        return (n_blocks, n_heads), 0
    if order != "longest-first":
        raise ValueError(f"attention launch order {order!r}: expected 'auto', 'longest-first' or 'per-head'")
    return (n_heads, n_blocks), 1


def _head_contiguous(*ts: torch.Tensor) -> list[torch.Tensor]:
    # the kernels take any batch/head/token strides but need the head dim contiguous (Inductor may hand over
    # another layout than eager did; a copy is exact)
    return [t if t.stride(-1) == 1 else t.contiguous() for t in ts]


def _out_like(x: torch.Tensor) -> torch.Tensor:
    """The buffer of the output that pairs with input x (O and dQ with q, dK with k, dV with v): x's layout (its dims
    ordered by stride, the head dim last), dense, as cuDNN's attention lays out its outputs; contiguous when x's
    head dim is not (the kernels' inputs are then contiguous copies).  A model hands over q, k, v as transposed
    views of (B, T, heads, D) projections, so the transpose + reshape after the op, and the projection's backward
    after the gradient, are views instead of copies.  The CUDA kernels, the CPU reference and the fakes all use
    this, so a compiled graph's strides are the ones the op returns."""
    return torch.empty_strided(x.shape, _out_strides(x), dtype=x.dtype, device=x.device)


def _out_strides(x: torch.Tensor) -> tuple[int, ...]:
    """``_out_like(x)``'s strides."""
    if x.stride(-1) != 1:  # contiguous
        order = list(range(x.dim()))
    else:  # stable: ties keep dim order
        order = sorted(range(x.dim() - 1), key=lambda d: -x.stride(d)) + [x.dim() - 1]
    strides, step = [0] * x.dim(), 1
    for d in reversed(order):
        strides[d] = step
        step *= torch.sym_max(x.shape[d], 1)  # as torch's own dense strides count an empty dim
    return tuple(strides)


def _in_layout(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """y (x's shape) in ``_out_like(x)``'s layout: y itself when it already is (no allocation), else an exact
    copy."""
    return y if y.stride() == _out_strides(x) else _out_like(x).copy_(y)


def _sm_scale(D: int, scale: float | None) -> float:
    # None: 1/sqrt(D), computed as it always was (dettrain's LLaMA passes None: its bits do not move).  The kernels
    # take the scale as an fp32 scalar; for D = 16 ... 128, HF's head_dim**-0.5 rounds to the same fp32 value
    return 1.0 / math.sqrt(D) if scale is None else float(scale)


CUDNN_FWD_HEAD_SIZES = (64, 128)
"""Head sizes at which the forward may run cuDNN's kernel (``cudnn_forward``): the ones measured (BENCHMARKS.md)."""


@functools.lru_cache(maxsize=8)
def _cudnn_fwd_device(index: int) -> bool:
    """cuDNN 9 or later and a Hopper GPU (sm_90, where cuDNN's forward was checked and measured)."""
    return (torch.backends.cudnn.is_available() and (torch.backends.cudnn.version() or 0) >= 90000
            and torch.cuda.get_device_capability(index)[0] == 9)


def cudnn_forward(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether the forward of this call runs cuDNN's fused attention instead of the Triton kernel: outside
    batch-invariant mode, at a head size of ``CUDNN_FWD_HEAD_SIZES``, 16-bit, on a Hopper GPU with cuDNN >= 9,
    unless DETTRAIN_ATTN_FWD=triton.  GQA goes in as it is (cuDNN reads k and v per group, as the Triton kernel does).

    A flash-attention forward has no sum across programs: each program owns its query rows and walks the key
    blocks in a fixed order, so it is deterministic with no atomics to order (checked on an H200: the same bits
    over 10 reruns under torch's deterministic mode, and for a batch of one at the 125m and 1b shapes; BENCHMARKS.md).
    Its log-sum-exp (natural log) is rescaled to the log2 units the backward reads.  Batch invariance is not
    cuDNN's promise, so batch-invariant mode keeps the Triton forward, whose blocks depend on the head size only.
    On an H200 cuDNN's forward takes 0.81x (125m), 0.86x (1b) and 0.79x (7B) of the Triton kernel's time."""
    return (os.environ.get("DETTRAIN_ATTN_FWD", "auto") != "triton" and not bi.enabled()
            and q.shape[-1] in CUDNN_FWD_HEAD_SIZES
            and q.dtype in (torch.bfloat16, torch.float16) and _cudnn_fwd_device(q.device.index or 0))


def _fp32(x: float) -> float:
    """x rounded to the nearest fp32 value (to nearest, ties to even)."""
    return struct.unpack("f", struct.pack("f", x))[0]


def _attn_fwd_cuda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None):
    q, k, v = _head_contiguous(q, k, v)
    B, H, T, D = q.shape
    HKV = k.shape[1]
    sm_scale = _sm_scale(D, scale)
    if cudnn_forward(q, k):
        # the scale rounded to fp32 first, as the Triton kernels take it: 1/sqrt(D) and HF's D**-0.5 may differ in
        # fp64 but not in fp32, so dettrain's LLaMA and HF models keep giving each other's bits
        out = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True, False,
                                                                 scale=_fp32(sm_scale))
        o = _in_layout(q, out[0])  # the layout the op's fake promises (cuDNN's own: q's)
        return o, out[1].reshape(B * H, T).float() * LOG2E  # natural log -> the backward's log2 units
    o = _out_like(q)
    lse = torch.empty((B * H, T), dtype=torch.float32, device=q.device)
    cfg = ATTN_BLOCK_OVERRIDE or _attn_blocks(D, H // HKV)
    BM, BN, nw, ns = cfg["fwd"]
    grid, blk = _launch(triton.cdiv(T, BM), B * H, cfg, q.device)
    with _on(q):
        _attn_fwd_kernel[grid](
            q, k, v, o, lse, sm_scale * LOG2E, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1),
            k.stride(2), v.stride(0), v.stride(1), v.stride(2), o.stride(0), o.stride(1), o.stride(2),
            H, H // HKV, T, D=D, BM=BM, BN=BN, BLK=blk, num_warps=nw, num_stages=ns)
    return o, lse


def attention_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lo: torch.Tensor, n_rows: int,
                   scale: float | None = None) -> torch.Tensor:
    """Rows ``lo[b] .. lo[b] + n_rows - 1`` of each batch row b of ``attention(q, k, v, scale)``'s output, as
    (B, H, n_rows, D), bit for bit, at the cost of those rows' query blocks only (a KV-cache decode step:
    ``n_rows`` 1).  q (B, H, T, D), k/v (B, HKV, T, D) with T the positions held (a cache's slots; keys after a
    row's position are masked, so what later slots hold never reaches it); ``lo`` (B,) int64 on q's device, so a
    step with per-row positions needs no host sync and can be replayed as a CUDA graph.  The forward kernel runs
    with its training blocks (``_attn_blocks``): each (batch, head, query block) program computes what it computes
    in the whole-sequence call, which depends on its own rows and keys only.  Head size: a power of two of
    ``HEAD_SIZES`` (a cache of another head size is kept zero-padded to ``padded_head_size``, and ``scale`` given
    as the real size's, as ``attention`` pads).  CUDA with Triton, batch-invariant mode (the forward ``attention``
    then runs is this kernel, never cuDNN's)."""
    B, H, T, D = q.shape
    HKV = k.shape[1]
    if not (q.is_cuda and HAVE_TRITON):
        raise RuntimeError(f"attention_rows needs CUDA and Triton ({unavailable_reason() or q.device})")
    if D != padded_head_size(D) or head_size_problem(D) is not None:
        raise ValueError(f"attention_rows: head size {D}; pad the cache to padded_head_size (see attention)")
    if n_rows < 1:
        raise ValueError(f"attention_rows: n_rows={n_rows} must be >= 1 (and lo + n_rows <= T, the caller's)")
    q, k, v = _head_contiguous(q, k, v)
    o = torch.empty((B, H, n_rows, D), dtype=q.dtype, device=q.device)
    cfg = ATTN_BLOCK_OVERRIDE or _attn_blocks(D, H // HKV)
    BM, BN, nw, ns = cfg["fwd"]
    grid = ((n_rows - 1) // BM + 2 if n_rows > 1 else 1, B * H)  # the blocks rows lo .. lo + n_rows - 1 can span
    with _on(q):
        _attn_fwd_kernel[grid](
            q, k, v, o, o, _sm_scale(D, scale) * LOG2E, q.stride(0), q.stride(1), q.stride(2), k.stride(0),
            k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2), o.stride(0), o.stride(1), o.stride(2),
            H, H // HKV, T, D=D, BM=BM, BN=BN, BLK=0, lo_ptr=lo, N_ROWS=n_rows, ROWS=True, num_warps=nw,
            num_stages=ns)
    return o


DS_MAX_BYTES = 2 << 30
"""The largest dS buffer the backward allocates (bytes, for one call).  When the whole batch's dS is larger, the
backward runs over slices of the batch (or, for one sample, of its kv-head groups) whose dS fits, reusing one
buffer (``_ds_slices``); when one kv head's alone is larger, the dQ pass recomputes dS instead.  Either way the
bits are the same: every program's arithmetic depends on its own (batch, head, block) only.  2 GiB lets the 7B
model's micro-batch of two sequences (T 4096, 32 heads, 1.02 GiB) run in one launch (timings: BENCHMARKS.md)."""


def _ds_per_head(T: int, BN: int) -> int:
    """Elements of one head's dS buffer: key block n (columns n*BN ... n*BN+BN-1) keeps rows n*BN ... T-1, the
    causal ones, row-major (BN values a row) at offset BN * (n*T - BN*n*(n-1)/2); ``_attn_bwd_dq_ds_kernel`` reads
    it."""
    n = triton.cdiv(T, BN)
    return BN * (n * T - BN * n * (n - 1) // 2)


def _ds_slices(B: int, HKV: int, kv_bytes: int, cap: int) -> list[tuple[int, int, int, int]] | None:
    """(b0, b1, g0, g1): the slices of batch x kv heads the dS backward runs one after another, each with at most
    ``cap`` bytes of dS (``kv_bytes`` for one kv head and its query heads); whole samples when one fits, else the
    kv heads of one sample in groups.  None: one kv head's dS alone is over the cap (recompute instead).  Each
    slice's lse and delta rows are contiguous: a range of samples, or a range of heads of one sample."""
    if kv_bytes > cap:
        return None
    per_sample = HKV * kv_bytes
    if per_sample <= cap:
        n = max(1, cap // per_sample)
        return [(b, min(b + n, B), 0, HKV) for b in range(0, B, n)]
    n = cap // kv_bytes
    return [(b, b + 1, g, min(g + n, HKV)) for b in range(B) for g in range(0, HKV, n)]


def _attn_bwd_cuda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
                   do: torch.Tensor, scale: float | None = None):
    q, k, v, o, do = _head_contiguous(q, k, v, o, do)
    B, H, T, D = q.shape
    HKV = k.shape[1]
    G = H // HKV
    sm_scale = _sm_scale(D, scale)
    cfg = ATTN_BLOCK_OVERRIDE or _attn_blocks(D, G)
    BM, BN, nw, ns = cfg.get("dkdv", cfg.get("bwd"))
    BMq, BNq, nwq, nsq = cfg.get("dq", cfg.get("bwd"))
    split = cfg.get("split", 1)
    if split < 1 or G % split:
        raise ValueError(f"attention backward blocks {cfg}: split {split} must divide the GQA group ({G} query heads "
                         "a kv head)")
    per_head = _ds_per_head(T, BN)
    # dS stored: the whole batch's at once up to DS_MAX_BYTES (T = 4096, 32 heads: 520 MiB a sample), else slice
    # by slice; recomputed when one kv head's is over it.  The same bits either way (the GPU tests check it)
    slices = _ds_slices(B, HKV, G * per_head * q.element_size(), DS_MAX_BYTES) if cfg.get("ds") else None
    if slices is not None and (BN % BM or BNq != BN):
        raise ValueError(f"attention backward blocks {cfg}: with dS stored, dK/dV's BLOCK_M must divide its BLOCK_N "
                         "and dQ's BLOCK_N must equal it")
    delta = torch.empty((B * H, T), dtype=torch.float32, device=q.device)
    dq, dk, dv = _out_like(q), _out_like(k), _out_like(v)
    # dS in the inputs' dtype, the value the dK product uses: the largest slice's (b1-b0) x heads x per_head
    # elements, reused by every slice, freed on return
    ds = torch.empty(1 if slices is None else max((b1 - b0) * (g1 - g0) * G for b0, b1, g0, g1 in slices) * per_head,
                     dtype=q.dtype, device=q.device)
    # the split dK/dV pass's fp32 partial sums (dK's, then dV's) of the largest slice's (batch, kv head) pairs
    pairs = max((b1 - b0) * (g1 - g0) for b0, b1, g0, g1 in slices or [(0, B, 0, HKV)])
    part = torch.empty(2 * split * pairs * T * D if split > 1 else 1, dtype=torch.float32, device=q.device)
    with _on(q):
        _attn_delta_kernel[(triton.cdiv(T, 128), B * H)](
            o, do, delta, H, T, o.stride(0), o.stride(1), o.stride(2), do.stride(0), do.stride(1), do.stride(2),
            D=D, BM=128, num_warps=4)
        lse3, delta3 = lse.view(B, H, T), delta.view(B, H, T)
        for b0, b1, g0, g1 in slices or [(0, B, 0, HKV)]:
            hs, ks = slice(g0 * G, g1 * G), slice(g0, g1)
            sq, sk, sv, sdo = q[b0:b1, hs], k[b0:b1, ks], v[b0:b1, ks], do[b0:b1, hs]
            sdq, sdk, sdv = dq[b0:b1, hs], dk[b0:b1, ks], dv[b0:b1, ks]
            # a range of samples, or a range of heads of one sample: contiguous rows either way
            slse, sdelta = lse3[b0:b1, hs].reshape(-1, T), delta3[b0:b1, hs].reshape(-1, T)
            nh, nkv = (b1 - b0) * (g1 - g0) * G, (b1 - b0) * (g1 - g0)
            common = (sq.stride(0), sq.stride(1), sq.stride(2), sk.stride(0), sk.stride(1), sk.stride(2),
                      sv.stride(0), sv.stride(1), sv.stride(2), sdo.stride(0), sdo.stride(1), sdo.stride(2))
            grid, blk = _launch(triton.cdiv(T, BN), nkv * split, cfg, q.device)
            _attn_bwd_dkdv_kernel[grid](
                sq, sk, sv, sdo, slse, sdelta, sdk, sdv, sm_scale * LOG2E, sm_scale, *common,
                sdk.stride(0), sdk.stride(1), sdk.stride(2), sdv.stride(0), sdv.stride(1), sdv.stride(2),
                (g1 - g0) * G, g1 - g0, G, T, ds, per_head, part, D=D, BM=BM, BN=BN,
                EVEN=T % BM == 0 and T % BN == 0, STORE_DS=slices is not None, BLK=blk, SPLIT=split, num_warps=nw,
                num_stages=ns)
            if split > 1:  # rows a program: two fp32 tiles of at most 4096 values (32 registers a thread each)
                BT = min(64, 4096 // D)
                _attn_bwd_kv_sum_kernel[(triton.cdiv(T, BT), nkv)](
                    part, sdk, sdv, sm_scale, g1 - g0, T, sdk.stride(0), sdk.stride(1), sdk.stride(2),
                    sdv.stride(0), sdv.stride(1), sdv.stride(2), D=D, BT=BT, SPLIT=split, num_warps=4)
            grid, blk = _launch(triton.cdiv(T, BMq), nh, cfg, q.device)
            if slices is not None:
                _attn_bwd_dq_ds_kernel[grid](
                    ds, sk, sdq, sm_scale, sk.stride(0), sk.stride(1), sk.stride(2), sdq.stride(0), sdq.stride(1),
                    sdq.stride(2), per_head, (g1 - g0) * G, G, T, D=D, BM=BMq, BN=BN,
                    EVEN=T % BMq == 0 and T % BN == 0, BLK=blk, num_warps=nwq, num_stages=nsq)
            else:
                _attn_bwd_dq_kernel[grid](
                    sq, sk, sv, sdo, slse, sdelta, sdq, sm_scale * LOG2E, sm_scale, *common,
                    sdq.stride(0), sdq.stride(1), sdq.stride(2), (g1 - g0) * G, G, T, D=D, BM=BMq, BN=BNq,
                    EVEN=T % BMq == 0 and T % BNq == 0, BLK=blk, num_warps=nwq, num_stages=nsq)
    return dq, dk, dv


def _scaled(s: torch.Tensor, D: int, scale: float | None) -> torch.Tensor:
    # the default divides by sqrt(D), as the reference always did; an explicit scale multiplies
    return s / math.sqrt(D) if scale is None else s * scale


def _attn_scores_ref(q: torch.Tensor, k: torch.Tensor, scale: float | None = None):
    """fp32 causal scores (B, H, T, T) with k repeated over each GQA group; -inf above the diagonal."""
    G = q.shape[1] // k.shape[1]
    T = q.shape[2]
    s = _scaled(_f(q) @ _f(k).repeat_interleave(G, 1).transpose(-1, -2), q.shape[-1], scale)
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    return s.masked_fill(~causal, float("-inf")), G


def _attn_fwd_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None):
    # lse in natural-log units here, log2 units in the Triton kernel: each forward pairs with its own backward
    s, G = _attn_scores_ref(q, k, scale)
    lse = torch.logsumexp(s, -1)
    o = torch.exp(s - lse[..., None]) @ _f(v).repeat_interleave(G, 1)
    return o.to(q.dtype), lse.reshape(-1, q.shape[2]).float()


def _attn_bwd_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
                  do: torch.Tensor, scale: float | None = None):
    B, H, T, D = q.shape
    HKV = k.shape[1]
    s, G = _attn_scores_ref(q, k, scale)
    p = torch.exp(s - lse.view(B, H, T)[..., None])
    dof = _f(do)
    dp = dof @ _f(v).repeat_interleave(G, 1).transpose(-1, -2)
    ds = _scaled(p * (dp - (dof * _f(o)).sum(-1, keepdim=True)), D, scale)
    dq = ds @ _f(k).repeat_interleave(G, 1)
    dk = (ds.transpose(-1, -2) @ _f(q)).view(B, HKV, G, T, D).sum(2)
    dv = (p.transpose(-1, -2) @ dof).view(B, HKV, G, T, D).sum(2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _attn_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None):
    B, H, T, _ = q.shape
    return _out_like(q), q.new_empty((B * H, T), dtype=torch.float32)


def _attn_fwd_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None):
    o, lse = _attn_fwd_ref(q, k, v, scale)
    return _in_layout(q, o), lse


def _attn_bwd_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
                  do: torch.Tensor, scale: float | None = None):
    return tuple(_in_layout(x, g) for x, g in zip((q, k, v), _attn_bwd_ref(q, k, v, o, lse, do, scale)))


attention_op = _custom_op("bi_attention", "(Tensor q, Tensor k, Tensor v, float? scale=None) -> (Tensor, Tensor)",
                          _attn_fwd_cpu, _attn_fwd_cuda, _attn_fake)
attention_bwd_op = _custom_op(
    "bi_attention_bwd",
    "(Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, Tensor do, float? scale=None) -> (Tensor, Tensor, Tensor)",
    _attn_bwd_cpu, _attn_bwd_cuda,
    lambda q, k, v, o, lse, do, scale=None: (_out_like(q), _out_like(k), _out_like(v)))


def _attn_setup(ctx, inputs, output) -> None:
    q, k, v, scale = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.scale = scale


def _attn_backward(ctx, do: torch.Tensor, _dlse):
    q, k, v, o, lse = ctx.saved_tensors
    return (*attention_bwd_op(q, k, v, o, lse, do, ctx.scale), None)


attention_op.register_autograd(_attn_backward, setup_context=_attn_setup)


HEAD_SIZES = (16, 32, 48, 64, 80, 96, 112, 128)
"""Head sizes the kernel serves: powers of two natively, the other multiples of 16 zero-padded to the next power of
two (``attention``)."""


def head_size_problem(D: int) -> str | None:
    """None when ``attention`` serves head size D; otherwise why not."""
    if D not in HEAD_SIZES:
        return f"head size {D} (dettrain's attention kernel serves {', '.join(map(str, HEAD_SIZES))})"
    return None


def padded_head_size(D: int) -> int:
    """The head size the kernel runs for D: D itself for a power of two, else the next power of two."""
    return 1 << (D - 1).bit_length()


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Causal softmax attention, q (B, H, T, D), k/v (B, HKV, T, D) with HKV dividing H (grouped-query attention
    without repeating k/v), scores scaled by ``scale`` (None: 1/sqrt(D), the bits dettrain's LLaMA always had);
    deterministic, forward and backward; batch-invariant in batch-invariant mode (outside it the forward may be
    cuDNN's, ``cudnn_forward``, whose bits do not depend on the run either, but whose batch invariance is not
    promised).

    Head sizes 48, 80, 96, 112 run zero-padded to the next power of two with the real scale: the padded columns of
    q and k add exact zeros to every score and those of v give output columns that are sliced off, so the result
    is the attention of the unpadded tensors, computed with the wider kernel (and its summation blocks)."""
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"attention: {k.shape[1]} kv heads do not divide {q.shape[1]} query heads")
    D = q.shape[-1]
    problem = head_size_problem(D)
    if problem is not None:
        raise ValueError(f"dettrain's attention kernel cannot serve {problem}; change the model shape, or set "
                         "det.attention=torch (and det.batch_invariant=false)")
    P = padded_head_size(D)
    if P == D:
        return attention_op(q, k, v, scale)[0]
    pad = (0, P - D)  # autograd of pad/slice: the gradients of the real columns, exactly
    o = attention_op(F.pad(q, pad), F.pad(k, pad), F.pad(v, pad), 1.0 / math.sqrt(D) if scale is None else scale)[0]
    return o[..., :D]


CUSTOM_OPS = ("bi_attention", "bi_attention_bwd")
"""The ops this module registers under ``torch.ops.dettrain``."""
