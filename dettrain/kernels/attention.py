"""Causal flash attention, forward and backward, deterministic and batch-invariant (Triton on CUDA).

One program per (batch, head, query block) walks the key blocks in a fixed order (online softmax in log2 units);
the backward computes dK/dV per key block, looping over the query blocks and the query heads of a GQA group in a
fixed order, and dQ per query block, with no atomics.  Block sizes are a function of the head size and the GQA group
only (``_attn_blocks``), never of the batch, so a sample's arithmetic never changes with what else is in the batch.

Two switches route model.py's attention here (``attention_active``): batch-invariant mode
(``batch_invariant.set_enabled``, ``det.batch_invariant``), or ``set_attention``, which the trainer sets from
det.attention (dettrain/models/attention.py routes Hugging Face models and F.scaled_dot_product_attention callers by the
same switch).  ``attention`` is the torch custom op ``torch.ops.dettrain.bi_attention`` (its backward
``bi_attention_bwd``), registered like batch_invariant.py's ops: a CPU reference, the Triton kernels on CUDA, a fake
for tracing (see "custom ops" there).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from dettrain.kernels import batch_invariant as bi
from dettrain.kernels._triton import HAVE_TRITON, tl, triton, unavailable_reason
from dettrain.kernels._triton import acc as _f
from dettrain.kernels._triton import custom_op as _custom_op
from dettrain.kernels._triton import on_device as _on
from dettrain.kernels._triton import rows_like as _rows_like

_MODE = "off"
_STRICT = False
MODES = ("off", "cuda", "always", "never")
"""set_attention's modes: ``off`` (the kernel only under batch-invariant mode, on CUDA), ``cuda`` (every CUDA call:
det.attention=auto at det.tier >= 2), ``always`` (every call, the CPU reference on CPU: det.attention=dettrain),
``never`` (torch's attention, even under batch-invariant mode: det.attention=torch)."""


def set_attention(mode: bool | str, strict: bool = False) -> None:
    """Route model.py's attention (and models/attention.py's SDPA/HF entry points) here; True means ``cuda``, False
    ``off``.  ``strict``: a call the kernel cannot serve is an error instead of going to torch (det.attention=
    dettrain).  The trainer sets both from det.attention (models/attention.py): ``cuda`` at det.tier >= 2 on CUDA
    by default, because the kernel is deterministic by construction (no atomics) and faster than SDPA's
    deterministic backward (BENCHMARKS.md: 1b 1.28 vs 1.61 ms, 7B shape 1.70 vs 2.96 ms per layer, forward +
    backward)."""
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
                         H, GROUP, T, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
        start_m = tl.num_programs(0) - 1 - tl.program_id(0)  # last query blocks (the longest loops) first
        bh = tl.program_id(1)
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
                     qk_scale, T, BM: tl.constexpr, CAUSAL: tl.constexpr, EVEN: tl.constexpr):
        # query blocks [lo, hi) in order, added into dk, dv; CAUSAL: the band that straddles the diagonal (mask
        # needed); EVEN: T is a multiple of the blocks (no length mask).  The masks only zero what the band and
        # the tail would otherwise add, so splitting the loop changes no value
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
        return dk, dv

    @triton.jit
    def _attn_bwd_dkdv_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, qk_scale, sm_scale,
                              sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sdb, sdh, sdt,
                              sdkb, sdkh, sdkt, sdvb, sdvh, sdvt,
                              H, HKV, GROUP, T, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                              EVEN: tl.constexpr):
        # one program per (batch, kv head, key block); loops over the GROUP query heads, then over query blocks
        # from the diagonal down, in a fixed order: dK and dV are sums with one order, no atomics
        start_n = tl.program_id(0) * BN
        bhk = tl.program_id(1)
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
        for g in range(0, GROUP):
            h = hk * GROUP + g
            bh = b * H + h
            q_base = q_ptr + b * sqb + h * sqh
            do_base = do_ptr + b * sdb + h * sdh
            lse_row = lse_ptr + bh * T
            delta_row = delta_ptr + bh * T
            dk, dv = _dkdv_blocks(dk, dv, k, v, q_base, do_base, lse_row, delta_row, offs_n, offs_m0, offs_d, lo,
                                  tl.minimum(band_hi, T), sqt, sdt, qk_scale, T, BM=BM, CAUSAL=True, EVEN=EVEN)
            dk, dv = _dkdv_blocks(dk, dv, k, v, q_base, do_base, lse_row, delta_row, offs_n, offs_m0, offs_d,
                                  band_hi, T, sqt, sdt, qk_scale, T, BM=BM, CAUSAL=False, EVEN=EVEN)
        dk = dk * sm_scale
        tl.store(dk_ptr + b * sdkb + hk * sdkh + offs_n[:, None] * sdkt + offs_d[None, :],
                 dk.to(dk_ptr.dtype.element_ty), mask=nmask)
        tl.store(dv_ptr + b * sdvb + hk * sdvh + offs_n[:, None] * sdvt + offs_d[None, :],
                 dv.to(dv_ptr.dtype.element_ty), mask=nmask)

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
                            H, GROUP, T, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, EVEN: tl.constexpr):
        # query blocks launched last-first: the longest loops start first (the causal triangle's tail is short)
        start_m = (tl.num_programs(0) - 1 - tl.program_id(0)) * BM
        bh = tl.program_id(1)
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


    # ---------------------------------------------------------------------------------------------------------
    # the one-pass backward: dK/dV per key block as above, and each key block's part of dQ added into an fp32
    # accumulator in a FIXED order (key block 0, 1, 2, ... for every query tile), serialized by one counter per
    # (batch, query head, query tile): the program of key block n waits until the counter reads n, adds, and sets
    # it to n + 1.  The order of every sum is a function of the block sizes only, so the bits never change.
    # ---------------------------------------------------------------------------------------------------------
    @triton.jit
    def _wait_at_least(ptr, target, skip):
        # spin until the int32 at ptr is >= target; skip != 0 returns at once.  Each thread polls, so its own
        # acquire load orders its later memory operations after what the releasing threads wrote.  Declared pure
        # (a side-effecting asm stops Triton's software pipelining of the loop): it reads only the counter, and
        # the callers make their writes depend on its result, so it cannot move after them; it is never elided
        # because that result is used
        return tl.inline_asm_elementwise(
            """{
            .reg .pred %dtw_s, %dtw_l;
            .reg .b32 %dtw_v;
            mov.b32 %dtw_v, $2;
            setp.ne.b32 %dtw_s, $3, 0;
            @%dtw_s bra DTW_DONE;
            DTW_WAIT:
            ld.global.acquire.gpu.b32 %dtw_v, [$1];
            setp.lt.s32 %dtw_l, %dtw_v, $2;
            @%dtw_l bra DTW_WAIT;
            DTW_DONE:
            mov.b32 $0, %dtw_v;
            }""", "=r,l,r,r", [ptr, target, skip], dtype=tl.int32, is_pure=True, pack=1)

    @triton.jit
    def _fused_steps(dk, dv, k, v, q_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, acc_ptr, cnt_ptr,
                     pend_ptr, pend_on, b, hk, n, offs_n, offs_m0, offs_d, top, ntiles,
                     sqb, sqh, sqt, sdb, sdh, sdt, sdqb, sdqh, sdqt, H, GROUP, T, M, qk_scale, sm_scale,
                     D: tl.constexpr, BM: tl.constexpr, LAST: tl.constexpr, EVEN: tl.constexpr,
                     SYNC: tl.constexpr, NT: tl.constexpr):
        # ntiles query tiles from the one starting at `top` downwards, each for the GROUP query heads of kv head
        # hk, as one flat loop (so the pipeliner sees one loop).  LAST: the tiles on the diagonal band, where this
        # key block is the last to add to dQ (BM divides BN), so it writes the finished dQ; otherwise it adds its
        # part and publishes the tile's counter one step later (its writes are then long done, so the release
        # fence waits for nothing)
        for s in range(0, ntiles * GROUP):
            start_m = top - (s // GROUP) * BM
            h = hk * GROUP + s % GROUP
            bh = b * H + h
            offs_m = start_m + offs_m0
            q_base = q_ptr + b * sqb + h * sqh
            do_base = do_ptr + b * sdb + h * sdh
            if EVEN:
                qt = tl.load(q_base + offs_m[None, :] * sqt + offs_d[:, None])
                lse = tl.load(lse_ptr + bh * T + offs_m)
                do = tl.load(do_base + offs_m[:, None] * sdt + offs_d[None, :])
                delta = tl.load(delta_ptr + bh * T + offs_m)
            else:
                mmask = offs_m < T
                qt = tl.load(q_base + offs_m[None, :] * sqt + offs_d[:, None], mask=mmask[None, :], other=0.0)
                lse = tl.load(lse_ptr + bh * T + offs_m, mask=mmask, other=0.0)
                do = tl.load(do_base + offs_m[:, None] * sdt + offs_d[None, :], mask=mmask[:, None], other=0.0)
                delta = tl.load(delta_ptr + bh * T + offs_m, mask=mmask, other=0.0)
            st = tl.dot(k, qt) * qk_scale  # (BN, BM) = scores transposed
            pt = tl.exp2(st - lse[None, :])
            if LAST:
                pt = tl.where(offs_m[None, :] >= offs_n[:, None], pt, 0.0)
            if not EVEN:
                pt = tl.where(mmask[None, :], pt, 0.0)
            dv += tl.dot(pt.to(do.dtype), do)
            dpt = tl.dot(v, tl.trans(do))
            dst = pt * (dpt - delta[None, :])
            dk += tl.dot(dst.to(qt.dtype), tl.trans(qt))
            dqp = tl.dot(tl.trans(dst.to(k.dtype)), k)  # (BM, D): this key block's part of dQ
            cnt = cnt_ptr + bh * M + start_m // BM
            rows = offs_m[:, None] < T
            if SYNC:
                # publish the previous step's tile: every thread adds 1 with release semantics, which orders its
                # own writes of that tile before it (one element per thread: NT = warps x 32), so the counter
                # reads NT x (key blocks added) and no barrier is needed; then wait for this tile's turn
                # (key blocks 0 .. n-1 added)
                tl.atomic_add(pend_ptr + tl.zeros([NT], tl.int32), 1, mask=tl.full([NT], 1, tl.int32) == pend_on,
                              sem="release")
                got = _wait_at_least(cnt, n * NT, (n == 0).to(tl.int32))
                rows = rows & (got >= n * NT)  # the writes below depend on the wait
            acc = acc_ptr + bh * T * D + offs_m[:, None] * D + offs_d[None, :]
            if LAST:
                old = tl.atomic_add(acc, dqp, mask=rows & (n > 0), sem="relaxed")
                tot = tl.where(n > 0, old + dqp, dqp)
                tl.store(dq_ptr + b * sdqb + h * sdqh + offs_m[:, None] * sdqt + offs_d[None, :],
                         (tot * sm_scale).to(dq_ptr.dtype.element_ty), mask=rows)
                pend_on = pend_on * 0
            else:
                tl.store(acc, dqp, mask=rows & (n == 0))
                tl.atomic_add(acc, dqp, mask=rows & (n > 0), sem="relaxed")
                pend_ptr = cnt
                pend_on = pend_on * 0 + 1
        return dk, dv, pend_ptr, pend_on

    @triton.jit
    def _attn_bwd_fused_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, dk_ptr, dv_ptr, acc_ptr,
                               cnt_ptr, ticket_ptr, qk_scale, sm_scale,
                               sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sdb, sdh, sdt, sdqb, sdqh, sdqt,
                               sdkb, sdkh, sdkt, sdvb, sdvh, sdvt, H, HKV, GROUP, T, M, BHK,
                               D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, EVEN: tl.constexpr,
                               SYNC: tl.constexpr, NT: tl.constexpr):
        # work is handed out by a ticket in start order, key block 0 of every (batch, kv head) first: a program
        # only ever waits for one holding an earlier ticket, which is already running, so the waits cannot
        # deadlock whatever order the hardware starts programs in; and the longest programs start first
        t = tl.atomic_add(ticket_ptr, 1, sem="relaxed")
        n = t // BHK
        bhk = t % BHK
        b = (bhk // HKV).to(tl.int64)
        hk = (bhk % HKV).to(tl.int64)
        start_n = n * BN
        offs_n = start_n + tl.arange(0, BN)
        offs_m0 = tl.arange(0, BM)
        offs_d = tl.arange(0, D)
        nmask = offs_n[:, None] < T
        k = tl.load(k_ptr + b * skb + hk * skh + offs_n[:, None] * skt + offs_d[None, :], mask=nmask, other=0.0)
        v = tl.load(v_ptr + b * svb + hk * svh + offs_n[:, None] * svt + offs_d[None, :], mask=nmask, other=0.0)
        dk = tl.zeros((BN, D), tl.float32)
        dv = tl.zeros((BN, D), tl.float32)
        # query tiles below the band (entirely visible), from the last one down, then the band [lo, band_hi)
        lo = (start_n // BM) * BM
        band_hi = tl.minimum(tl.cdiv(start_n + BN, BM) * BM, tl.cdiv(T, BM) * BM)
        n_below = tl.maximum(tl.cdiv(T, BM) * BM - band_hi, 0) // BM
        pend_ptr = cnt_ptr
        pend_on = n * 0
        dk, dv, pend_ptr, pend_on = _fused_steps(
            dk, dv, k, v, q_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, acc_ptr, cnt_ptr, pend_ptr, pend_on,
            b, hk, n, offs_n, offs_m0, offs_d, tl.cdiv(T, BM) * BM - BM, n_below, sqb, sqh, sqt, sdb, sdh, sdt,
            sdqb, sdqh, sdqt, H, GROUP, T, M, qk_scale, sm_scale, D=D, BM=BM, LAST=False, EVEN=EVEN, SYNC=SYNC, NT=NT)
        dk, dv, pend_ptr, pend_on = _fused_steps(
            dk, dv, k, v, q_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, acc_ptr, cnt_ptr, pend_ptr, pend_on,
            b, hk, n, offs_n, offs_m0, offs_d, band_hi - BM, (band_hi - lo) // BM, sqb, sqh, sqt, sdb, sdh, sdt,
            sdqb, sdqh, sdqt, H, GROUP, T, M, qk_scale, sm_scale, D=D, BM=BM, LAST=True, EVEN=EVEN, SYNC=SYNC, NT=NT)
        dk = dk * sm_scale
        tl.store(dk_ptr + b * sdkb + hk * sdkh + offs_n[:, None] * sdkt + offs_d[None, :],
                 dk.to(dk_ptr.dtype.element_ty), mask=nmask)
        tl.store(dv_ptr + b * sdvb + hk * sdvh + offs_n[:, None] * sdvt + offs_d[None, :],
                 dv.to(dv_ptr.dtype.element_ty), mask=nmask)


# ---- host side --------------------------------------------------------------------------------------------------
def _attn_blocks(D: int, group: int = 1) -> dict:
    """(BLOCK_M, BLOCK_N, warps, stages) of the forward kernel and of the one-pass backward (``fused``).  A
    function of the head size and the GQA group only (model properties), never of batch size, so a sample's
    arithmetic never changes with the batch.  Chosen by the sweeps in BENCHMARKS.md (H200, bf16: `bench/bench_gpu.py
    attn-sweep` for the forward, `attn-det` for the backward, at the trainer's micro-batch shapes)."""
    fwd = (128, 64, 8, 3) if D <= 64 else (64, 64, 4, 3)
    return {"fwd": fwd, "fused": (64, 64, 8, 3) if D <= 64 else (64, 64, 8, 2)}


def _attn_blocks_two_pass(D: int, group: int = 1) -> dict:
    """The two-pass backward's blocks (dK/dV per key block, then dQ per query block; the default before the
    one-pass kernel, kept for comparison: `bench_gpu.py attn-bwd-sweep` chose them)."""
    fwd = _attn_blocks(D, group)["fwd"]
    if D <= 64:
        if group > 1:
            return {"fwd": fwd, "dkdv": (64, 64, 4, 3), "dq": (64, 64, 4, 3)}
        return {"fwd": fwd, "dkdv": (32, 64, 4, 4), "dq": (64, 64, 4, 3)}
    return {"fwd": fwd, "dkdv": (32, 64, 4, 4), "dq": (128, 64, 8, 3)}


ATTN_BLOCK_OVERRIDE: dict | None = None  # benchmarks only


def _head_contiguous(*ts: torch.Tensor) -> list[torch.Tensor]:
    # the kernels take any batch/head/token strides but need the head dim contiguous (Inductor may hand over
    # another layout than eager did; a copy is exact)
    return [t if t.stride(-1) == 1 else t.contiguous() for t in ts]


def _sm_scale(D: int, scale: float | None) -> float:
    # None: 1/sqrt(D), computed as it always was (dettrain's LLaMA passes None: its bits do not move).  The kernels
    # take the scale as an fp32 scalar; for D = 16 ... 128, HF's head_dim**-0.5 rounds to the same fp32 value
    return 1.0 / math.sqrt(D) if scale is None else float(scale)


def _attn_fwd_cuda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None):
    q, k, v = _head_contiguous(q, k, v)
    B, H, T, D = q.shape
    HKV = k.shape[1]
    o = _rows_like(q)
    lse = torch.empty((B * H, T), dtype=torch.float32, device=q.device)
    sm_scale = _sm_scale(D, scale)
    BM, BN, nw, ns = (ATTN_BLOCK_OVERRIDE or _attn_blocks(D, H // HKV))["fwd"]
    with _on(q):
        _attn_fwd_kernel[(triton.cdiv(T, BM), B * H)](
            q, k, v, o, lse, sm_scale * LOG2E, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1),
            k.stride(2), v.stride(0), v.stride(1), v.stride(2), o.stride(0), o.stride(1), o.stride(2),
            H, H // HKV, T, D=D, BM=BM, BN=BN, num_warps=nw, num_stages=ns)
    return o, lse


def _attn_bwd_cuda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
                   do: torch.Tensor, scale: float | None = None):
    q, k, v, o, do = _head_contiguous(q, k, v, o, do)
    B, H, T, D = q.shape
    HKV = k.shape[1]
    G = H // HKV
    sm_scale = _sm_scale(D, scale)
    cfg = ATTN_BLOCK_OVERRIDE or _attn_blocks(D, G)
    delta = torch.empty((B * H, T), dtype=torch.float32, device=q.device)
    dq, dk, dv = _rows_like(q), _rows_like(k), _rows_like(v)
    with _on(q):
        _attn_delta_kernel[(triton.cdiv(T, 128), B * H)](
            o, do, delta, H, T, o.stride(0), o.stride(1), o.stride(2), do.stride(0), do.stride(1), do.stride(2),
            D=D, BM=128, num_warps=4)
        common = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                  v.stride(0), v.stride(1), v.stride(2), do.stride(0), do.stride(1), do.stride(2))
        if "fused" in cfg:
            _attn_bwd_fused(q, k, v, do, lse, delta, dq, dk, dv, sm_scale, common, cfg["fused"])
            return dq, dk, dv
        BM, BN, nw, ns = cfg.get("dkdv", cfg.get("bwd"))
        BMq, BNq, nwq, nsq = cfg.get("dq", cfg.get("bwd"))
        _attn_bwd_dkdv_kernel[(triton.cdiv(T, BN), B * HKV)](
            q, k, v, do, lse, delta, dk, dv, sm_scale * LOG2E, sm_scale, *common,
            dk.stride(0), dk.stride(1), dk.stride(2), dv.stride(0), dv.stride(1), dv.stride(2),
            H, HKV, G, T, D=D, BM=BM, BN=BN, EVEN=T % BM == 0 and T % BN == 0, num_warps=nw, num_stages=ns)
        _attn_bwd_dq_kernel[(triton.cdiv(T, BMq), B * H)](
            q, k, v, do, lse, delta, dq, sm_scale * LOG2E, sm_scale, *common,
            dq.stride(0), dq.stride(1), dq.stride(2), H, G, T, D=D, BM=BMq, BN=BNq, EVEN=T % BMq == 0 and T % BNq == 0,
            num_warps=nwq, num_stages=nsq)
    return dq, dk, dv


def _attn_bwd_fused(q, k, v, do, lse, delta, dq, dk, dv, sm_scale: float, common: tuple, blocks: tuple) -> None:
    """The one-pass backward (``_attn_bwd_fused_kernel``): an fp32 dQ accumulator that needs no zeroing (key block
    0 stores, the others add, the last writes dQ), one int32 counter per (batch, head, query tile) and the ticket,
    zeroed per call."""
    B, H, T, D = q.shape
    HKV = k.shape[1]
    BM, BN, nw, ns = blocks
    if BN % BM:
        raise ValueError(f"attention backward blocks {blocks}: BLOCK_M must divide BLOCK_N")
    M = triton.cdiv(T, BM)
    acc = torch.empty((B * H, T, D), dtype=torch.float32, device=q.device)
    cnt = torch.zeros(B * H * M + 1, dtype=torch.int32, device=q.device)
    nblocks = triton.cdiv(T, BN)
    _attn_bwd_fused_kernel[(nblocks * B * HKV,)](
        q, k, v, do, lse, delta, dq, dk, dv, acc, cnt, cnt[B * H * M:], sm_scale * LOG2E, sm_scale, *common,
        dq.stride(0), dq.stride(1), dq.stride(2), dk.stride(0), dk.stride(1), dk.stride(2),
        dv.stride(0), dv.stride(1), dv.stride(2), H, HKV, H // HKV, T, M, B * HKV,
        D=D, BM=BM, BN=BN, EVEN=T % BN == 0, SYNC=q.is_cuda, NT=32 * nw, num_warps=nw, num_stages=ns)


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
    return _rows_like(q), q.new_empty((B * H, T), dtype=torch.float32)


attention_op = _custom_op("bi_attention", "(Tensor q, Tensor k, Tensor v, float? scale=None) -> (Tensor, Tensor)",
                          _attn_fwd_ref, _attn_fwd_cuda, _attn_fake)
attention_bwd_op = _custom_op(
    "bi_attention_bwd",
    "(Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, Tensor do, float? scale=None) -> (Tensor, Tensor, Tensor)",
    _attn_bwd_ref, _attn_bwd_cuda,
    lambda q, k, v, o, lse, do, scale=None: (_rows_like(q), _rows_like(k), _rows_like(v)))


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
    deterministic and batch-invariant, forward and backward.

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
