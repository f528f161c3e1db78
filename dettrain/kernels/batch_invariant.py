"""Batch-invariant GPU kernels (``det.batch_invariant``; on by default at tier 4 on CUDA).

A kernel is *batch-invariant* when the result for one sample (one row, one sequence) has the same bits whatever else
is in the batch: batch size, the sample's position, padding.  Stock GPU libraries are not: cuBLAS picks a different
kernel (tile shape, split-K, stream-K) for each matrix shape, reductions split rows differently as the row count
changes, and FlashAttention splits the key axis when batch x heads is small.  Each of those changes the order of a
floating-point sum, so the same sample gets different bits in a batch of 1 and a batch of 8 (measured: bf16
F.linear on an H200 differs in 10 of 19 batch sizes).

The kernels here fix every sum order by construction:
  * ``linear`` / ``mm``: one tile configuration per (N, K), never dependent on M (the batch x tokens axis), and
    no split-K: each output element is one sequential fp32 accumulation over K in BLOCK_K steps.
  * ``rms_norm``: one row per reduction, a fixed tree over the row.
  * ``cross_entropy``: per-row log-sum-exp over fixed BLOCK_V chunks of the vocabulary (online max/sum), per-row
    losses; the batch mean is a plain torch reduction over the per-row values (deterministic).
  * attention: causal flash attention forward and backward with fixed loops and no atomics, in attention.py.
Weight gradients (dW of a linear, dweight of RMSNorm) are sums over the batch and so cannot be batch-invariant; they
are deterministic (fixed order) for a fixed micro-batch size, which is all tier 4 needs.

Wiring: models/llama.py calls ``linear`` and ``rms_norm`` (and ``attention.attention``) and loop/trainer.py
``cross_entropy`` when ``active(x)`` (enabled and x on CUDA); ``set_enabled`` is called by the trainer from
``det.batch_invariant``. Every entry point is a torch custom op (``torch.ops.dettrain.bi_*``, see "custom ops" below),
so under ``train.compile`` Dynamo traces them without graph breaks and Inductor runs them unchanged.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from dettrain.kernels import rowwise
from dettrain.kernels._triton import HAVE_TRITON, tl, triton, unavailable_reason
from dettrain.kernels._triton import acc as _f
from dettrain.kernels._triton import custom_op as _custom_op
from dettrain.kernels._triton import on_device as _on
from dettrain.kernels._triton import rows_like as _rows_like

_ENABLED = False


def set_enabled(on: bool) -> None:
    """Route models/llama.py's linear/RMSNorm/attention and loop/trainer.py's loss through the batch-invariant
    kernels."""
    global _ENABLED
    if on and not HAVE_TRITON and torch.cuda.is_available():  # a CPU-only machine runs kernels/rowwise.py instead
        raise RuntimeError(f"det.batch_invariant=true needs Triton on a CUDA machine ({unavailable_reason()}); "
                           "set det.batch_invariant=false")
    _ENABLED = bool(on)


def enabled() -> bool:
    return _ENABLED


def active(x: torch.Tensor) -> bool:
    """Whether ``x`` goes through the batch-invariant kernels (enabled, and on CUDA; CPU keeps torch's ops)."""
    return _ENABLED and x.is_cuda


def cpu_active(x: torch.Tensor) -> bool:
    """Whether ``x`` goes through the batch-invariant CPU ops of kernels/rowwise.py (enabled, and on the CPU)."""
    return _ENABLED and x.device.type == "cpu"


def _autocast_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype autocast would run a matmul in (x's dtype outside autocast)."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


if HAVE_TRITON:
    _TL = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}

    # ---------------------------------------------------------------------------------------------------------
    # matmul: C[M, N] = A[M, K] @ B[K, N], any strides, fp32 accumulation, no split-K
    # ---------------------------------------------------------------------------------------------------------
    @triton.jit
    def _mm_kernel(a_ptr, b_ptr, c_ptr, M, N, K, sam, sak, sbk, sbn, scm, scn,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                   EVEN_K: tl.constexpr, PRECISION: tl.constexpr):
        pid = tl.program_id(0)
        num_m = tl.cdiv(M, BM)
        num_n = tl.cdiv(N, BN)
        # grouped tile order (L2 reuse of B); the order of tiles never changes a tile's arithmetic
        in_group = GROUP_M * num_n
        first_m = (pid // in_group) * GROUP_M
        size_m = min(num_m - first_m, GROUP_M)
        pid_m = first_m + (pid % in_group) % size_m
        pid_n = (pid % in_group) // size_m
        rm = (pid_m * BM + tl.arange(0, BM)) % M  # wrapped rows/cols load real data; their results are not stored
        rn = (pid_n * BN + tl.arange(0, BN)) % N
        rk = tl.arange(0, BK)
        a_ptrs = a_ptr + rm[:, None].to(tl.int64) * sam + rk[None, :] * sak
        b_ptrs = b_ptr + rk[:, None] * sbk + rn[None, :].to(tl.int64) * sbn
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BK)):
            if EVEN_K:
                a = tl.load(a_ptrs)
                b = tl.load(b_ptrs)
            else:  # zero padding past K adds exact zeros to the accumulators
                a = tl.load(a_ptrs, mask=rk[None, :] < K - k * BK, other=0.0)
                b = tl.load(b_ptrs, mask=rk[:, None] < K - k * BK, other=0.0)
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
            a_ptrs += BK * sak
            b_ptrs += BK * sbk
        om = pid_m * BM + tl.arange(0, BM)
        on = pid_n * BN + tl.arange(0, BN)
        c_ptrs = c_ptr + om[:, None].to(tl.int64) * scm + on[None, :] * scn
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(om[:, None] < M) & (on[None, :] < N))

    # ---------------------------------------------------------------------------------------------------------
    # RMSNorm: y = x * rsqrt(mean(x^2) + eps) * w, one row per reduction
    # ---------------------------------------------------------------------------------------------------------
    @triton.jit
    def _rms_fwd_kernel(x_ptr, w_ptr, y_ptr, r_ptr, n_rows, D, eps, ROWS: tl.constexpr, BD: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BD)
        mask = (rows[:, None] < n_rows) & (cols[None, :] < D)
        x = tl.load(x_ptr + rows[:, None] * D + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
        r = 1.0 / tl.sqrt_rn(tl.sum(x * x, axis=1) / D + eps)
        y = (x * r[:, None]) * w[None, :]
        tl.store(y_ptr + rows[:, None] * D + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
        tl.store(r_ptr + rows, r, mask=rows < n_rows)

    @triton.jit
    def _rms_bwd_kernel(dy_ptr, x_ptr, w_ptr, r_ptr, dx_ptr, dwp_ptr, n_rows, D, ROWS: tl.constexpr,
                        BD: tl.constexpr):
        # dx = r * (g - xh * mean(g * xh)), g = dy * w, xh = x * r; dw partial = sum over this block's rows
        pid = tl.program_id(0)
        rows = pid.to(tl.int64) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BD)
        mask = (rows[:, None] < n_rows) & (cols[None, :] < D)
        offs = rows[:, None] * D + cols[None, :]
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
        r = tl.load(r_ptr + rows, mask=rows < n_rows, other=0.0)
        xh = x * r[:, None]
        g = dy * w[None, :]
        c = tl.sum(g * xh, axis=1) / D
        dx = r[:, None] * (g - xh * c[:, None])
        tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        tl.store(dwp_ptr + pid.to(tl.int64) * D + cols, tl.sum(dy * xh, axis=0), mask=cols < D)

    # ---------------------------------------------------------------------------------------------------------
    # cross-entropy: per-row loss = logsumexp(x) - x[target], fixed BLOCK_V chunks
    # ---------------------------------------------------------------------------------------------------------
    @triton.jit
    def _ce_fwd_kernel(x_ptr, t_ptr, loss_ptr, lse_ptr, V, sx, BV: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = x_ptr + row * sx
        cols = tl.arange(0, BV)
        m = tl.full((BV,), float("-inf"), tl.float32)
        s = tl.zeros((BV,), tl.float32)
        for v0 in range(0, V, BV):  # lane-wise online max/sum, combined once at the end: a fixed order
            x = tl.load(base + v0 + cols, mask=v0 + cols < V, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, x)
            s = s * tl.exp(m - m_new) + tl.exp(x - m_new)
            s = tl.where(m_new == float("-inf"), 0.0, s)
            m = m_new
        mx = tl.max(m, axis=0)
        lse = mx + tl.log(tl.sum(s * tl.exp(m - mx), axis=0))
        tgt = tl.load(t_ptr + row)
        xt = tl.load(base + tgt).to(tl.float32)
        tl.store(loss_ptr + row, lse - xt)
        tl.store(lse_ptr + row, lse)

    @triton.jit
    def _ce_bwd_kernel(x_ptr, t_ptr, lse_ptr, dl_ptr, dx_ptr, V, sx, sdx, BV: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        v0 = tl.program_id(1) * BV
        cols = v0 + tl.arange(0, BV)
        mask = cols < V
        x = tl.load(x_ptr + row * sx + cols, mask=mask, other=0.0).to(tl.float32)
        lse = tl.load(lse_ptr + row)
        dl = tl.load(dl_ptr + row)
        tgt = tl.load(t_ptr + row)
        g = (tl.exp(x - lse) - tl.where(cols == tgt, 1.0, 0.0)) * dl
        tl.store(dx_ptr + row * sdx + cols, g.to(dx_ptr.dtype.element_ty), mask=mask)


# ---- host side --------------------------------------------------------------------------------------------------
def _mm_config(N: int, K: int, dtype: torch.dtype) -> dict:
    """Tile configuration: a function of (N, K, dtype) only, never of M, so every row of A is computed by the
    same instruction sequence whatever the batch."""
    if dtype == torch.float32:
        return {"BM": 64, "BN": 64, "BK": 32, "GROUP_M": 8, "num_warps": 4, "num_stages": 3}
    return {"BM": 128, "BN": 128, "BK": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 4}


MM_CONFIG_OVERRIDE: dict | None = None  # benchmarks only: try another (fixed) tile configuration

FEW_ROWS_TILE: dict | None = {"BM": 16, "BN": 32, "BK": 128, "GROUP_M": 8, "num_warps": 4, "num_stages": 6}
"""The 16-bit tile of ``few_rows`` (None: the training tile).  A decode step multiplies one row per request by each
weight; with no split over K (batch invariance forbids one) the training tile gives that matmul N / 128 programs,
each a chain of K / 64 dependent loads.  This tile gives N / 32 programs, each streaming K in steps of 128 with six
stages in flight: the same tensor-core steps over K into one fp32 accumulator, so every output bit is the training
tile's.  Chosen by ``bench/bench_generate.py --mm-sweep`` on one H200 (2026-12-05) among 13 tiles, all of which gave
the training tile's bits at the 1b model's five projection shapes and 1, 8 and 64 rows: the 22 layers' projections
and the head took 1.53 ms at one row against the training tile's 4.52 ms (CUDA-graph device time), 1.27 against
2.90 at 8 rows, 2.02 against 2.91 at 64; ``tests/test_generate_gpu.py`` passes with it (docs/generate.md)."""

_few_rows = False


@contextlib.contextmanager
def few_rows(on: bool = True):
    """Within: 16-bit ``mm`` calls use ``FEW_ROWS_TILE`` (generation's decode step, generate/llama.py)."""
    global _few_rows
    was, _few_rows = _few_rows, on
    try:
        yield
    finally:
        _few_rows = was


def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a (M, K) @ b (K, N) with batch-invariant rows; any strides; output in a's dtype."""
    M, K = a.shape
    K2, N = b.shape
    if K != K2 or a.dtype != b.dtype:
        raise ValueError(f"mm: shapes {tuple(a.shape)} @ {tuple(b.shape)}, dtypes {a.dtype} {b.dtype}")
    c = torch.empty((M, N), dtype=a.dtype, device=a.device)
    if M == 0 or N == 0:
        return c
    if K == 0:
        return c.zero_()
    few = _few_rows and FEW_ROWS_TILE is not None and a.dtype != torch.float32
    cfg = dict(MM_CONFIG_OVERRIDE or (FEW_ROWS_TILE if few else _mm_config(N, K, a.dtype)))
    grid = (triton.cdiv(M, cfg["BM"]) * triton.cdiv(N, cfg["BN"]),)
    prec = "ieee" if a.dtype == torch.float32 else "tf32"  # tf32 is ignored for 16-bit inputs
    with _on(a):
        _mm_kernel[grid](a, b, c, M, N, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0),
                         c.stride(1), EVEN_K=K % cfg["BK"] == 0, PRECISION=prec, **cfg)
    return c


# ---- custom ops ---------------------------------------------------------------------------------------------------
# Every kernel entry point is a torch custom op (``torch.library.custom_op``, torch >= 2.4; the same API on the GPU's
# torch 2.11 and this CPU's 2.13), so torch.compile keeps it whole: Dynamo records each op as one graph node (no graph
# break), AOTAutograd traces its registered backward (itself custom ops), and Inductor calls the op as it is.  A
# compiled step therefore runs exactly the kernels an eager step runs for these ops.  Each op has
#   * a fake implementation: shapes, dtypes and strides for tracing on FakeTensors and the meta device;
#   * the Triton kernels on CUDA (only when Triton is importable);
#   * a torch reference on CPU computing the same math (fp32 accumulation) *without* the batch-invariance guarantee:
#     it lets tests check registration, tracing, autograd and compile on machines without a GPU.  The model never
#     routes CPU tensors here (``active``); CPU training uses torch's own ops.
# Outputs never alias inputs (a custom op's contract); what the backward needs beyond the inputs is an extra output
# (the RMSNorm reciprocal, the log-sum-exp of the loss and of attention).  Schemas are written out, so nothing
# depends on how a torch version reads annotations.  The helpers (``custom_op``, ``rows_like``, ``acc``) are in
# _triton.py, shared with attention.py.

# -- matmul and linear --------------------------------------------------------------------------------------------
def _mm_ref(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (_f(a) @ _f(b)).to(a.dtype)


def _mm_fake(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a.new_empty((a.shape[0], b.shape[1]))


mm_op = _custom_op("bi_mm", "(Tensor a, Tensor b) -> Tensor", _mm_ref, lambda a, b: mm(a, b), _mm_fake)


def _mm_backward(ctx, dc: torch.Tensor):
    a, b = ctx.saved_tensors
    return (mm_op(dc, b.t()) if ctx.needs_input_grad[0] else None,
            mm_op(a.t(), dc) if ctx.needs_input_grad[1] else None)


mm_op.register_autograd(_mm_backward, setup_context=lambda ctx, inputs, output: ctx.save_for_backward(*inputs))


def _linear_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return _mm_ref(x, w.t())


def _linear_fake(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0], w.shape[0]))


linear_op = _custom_op("bi_linear", "(Tensor x, Tensor w) -> Tensor", _linear_ref, lambda x, w: mm(x, w.t()),
                       _linear_fake)


def _linear_setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _linear_backward(ctx, dy: torch.Tensor):
    x, w = ctx.saved_tensors
    dx = mm_op(dy, w) if ctx.needs_input_grad[0] else None
    dw = mm_op(dy.t(), x) if ctx.needs_input_grad[1] else None  # fixed-order sum over the batch: deterministic
    return dx, dw


linear_op.register_autograd(_linear_backward, setup_context=_linear_setup)


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T (no bias) in autocast's dtype, batch-invariant; gradients flow to x and w (in their dtypes)."""
    dt = _autocast_dtype(x)
    y = linear_op(x.to(dt).reshape(-1, x.shape[-1]), w.to(dt))
    return y.view(*x.shape[:-1], w.shape[0])


# -- RMSNorm --------------------------------------------------------------------------------------------------------
def _rms_rows(D: int) -> tuple[int, int, int]:
    BD = triton.next_power_of_2(D)
    rows = max(1, min(16, 4096 // BD))
    return BD, rows, 4 if BD <= 2048 else 8


def _rms_fwd_cuda(x: torch.Tensor, w: torch.Tensor, eps: float):
    x2 = x.contiguous()
    n, D = x2.shape
    y = _rows_like(x2)
    r = torch.empty(n, dtype=torch.float32, device=x.device)
    BD, ROWS, nw = _rms_rows(D)
    with _on(x):
        _rms_fwd_kernel[(triton.cdiv(n, ROWS),)](x2, w, y, r, n, D, eps, ROWS=ROWS, BD=BD, num_warps=nw)
    return y, r


def _rms_bwd_cuda(dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, r: torch.Tensor):
    x2 = x.contiguous()
    n, D = x2.shape
    dy2 = dy.contiguous()
    dx = _rows_like(x2)
    BD, ROWS, nw = _rms_rows(D)
    nprog = triton.cdiv(n, ROWS)
    dwp = torch.empty((nprog, D), dtype=torch.float32, device=x2.device)
    with _on(x2):
        _rms_bwd_kernel[(nprog,)](dy2, x2, w, r, dx, dwp, n, D, ROWS=ROWS, BD=BD, num_warps=nw)
    return dx, dwp.sum(0).to(w.dtype)  # the one sum over the batch: torch's fixed-shape reduction, deterministic


def _rms_fwd_ref(x: torch.Tensor, w: torch.Tensor, eps: float):
    xf = _f(x)
    r = 1.0 / torch.sqrt(xf.pow(2).mean(-1) + eps)
    return ((xf * r[:, None]) * _f(w)).to(x.dtype), r.float()


def _rms_bwd_ref(dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, r: torch.Tensor):
    xh = _f(x) * r[:, None]
    g = _f(dy) * _f(w)
    c = (g * xh).sum(1, keepdim=True) / x.shape[1]
    return (r[:, None] * (g - xh * c)).to(x.dtype), (_f(dy) * xh).sum(0).to(w.dtype)


rms_norm_op = _custom_op("bi_rms_norm", "(Tensor x, Tensor w, float eps) -> (Tensor, Tensor)", _rms_fwd_ref,
                         _rms_fwd_cuda,
                         lambda x, w, eps: (_rows_like(x), x.new_empty(x.shape[0], dtype=torch.float32)))
rms_norm_bwd_op = _custom_op("bi_rms_norm_bwd", "(Tensor dy, Tensor x, Tensor w, Tensor r) -> (Tensor, Tensor)",
                             _rms_bwd_ref, _rms_bwd_cuda, lambda dy, x, w, r: (_rows_like(x), _rows_like(w)))


def _rms_setup(ctx, inputs, output) -> None:
    x, w, _ = inputs
    ctx.save_for_backward(x, w, output[1])


def _rms_backward(ctx, dy: torch.Tensor, _dr):
    x, w, r = ctx.saved_tensors
    dx, dw = rms_norm_bwd_op(dy, x, w, r)
    return dx, dw, None


rms_norm_op.register_autograd(_rms_backward, setup_context=_rms_setup)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim in x's dtype (fp32 math), one fixed reduction per row."""
    y, _ = rms_norm_op(x.reshape(-1, x.shape[-1]), w, eps)
    return y.view(x.shape)


# -- cross-entropy --------------------------------------------------------------------------------------------------
CE_BLOCK = 4096


def _ce_fwd_cuda(logits: torch.Tensor, target: torch.Tensor):
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    n, V = logits.shape
    loss = torch.empty(n, dtype=torch.float32, device=logits.device)
    lse = torch.empty(n, dtype=torch.float32, device=logits.device)
    with _on(logits):
        _ce_fwd_kernel[(n,)](logits, target.contiguous(), loss, lse, V, logits.stride(0), BV=CE_BLOCK, num_warps=8)
    return loss, lse


def _ce_bwd_cuda(logits: torch.Tensor, target: torch.Tensor, lse: torch.Tensor, dloss: torch.Tensor):
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    n, V = logits.shape
    dx = _rows_like(logits)
    dl = dloss.float().contiguous()
    with _on(logits):
        _ce_bwd_kernel[(n, triton.cdiv(V, CE_BLOCK))](logits, target.contiguous(), lse, dl, dx, V, logits.stride(0),
                                                        dx.stride(0), BV=CE_BLOCK, num_warps=8)
    return dx


def _ce_fwd_ref(logits: torch.Tensor, target: torch.Tensor):
    xf = _f(logits)
    lse = torch.logsumexp(xf, -1)
    return (lse - xf.gather(1, target[:, None].long())[:, 0]).float(), lse.float()


def _ce_bwd_ref(logits: torch.Tensor, target: torch.Tensor, lse: torch.Tensor, dloss: torch.Tensor):
    g = torch.exp(_f(logits) - lse[:, None])
    g[torch.arange(g.shape[0]), target.long()] -= 1.0
    return (g * _f(dloss)[:, None]).to(logits.dtype)


def _ce_fake(logits: torch.Tensor, target: torch.Tensor):
    n = logits.shape[0]
    return logits.new_empty(n, dtype=torch.float32), logits.new_empty(n, dtype=torch.float32)


cross_entropy_op = _custom_op("bi_cross_entropy", "(Tensor logits, Tensor target) -> (Tensor, Tensor)", _ce_fwd_ref,
                              _ce_fwd_cuda, _ce_fake)
cross_entropy_bwd_op = _custom_op("bi_cross_entropy_bwd",
                                  "(Tensor logits, Tensor target, Tensor lse, Tensor dloss) -> Tensor", _ce_bwd_ref,
                                  _ce_bwd_cuda, lambda logits, target, lse, dloss: _rows_like(logits))


def _ce_setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(inputs[0], inputs[1], output[1])


def _ce_backward(ctx, dloss: torch.Tensor, _dlse):
    logits, target, lse = ctx.saved_tensors
    return cross_entropy_bwd_op(logits, target, lse, dloss), None


cross_entropy_op.register_autograd(_ce_backward, setup_context=_ce_setup)


def cross_entropy_rows(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-row fp32 losses of (n, V) logits (any float dtype; the math is fp32) against int targets."""
    return cross_entropy_op(logits, target)[0]


def eager_cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The loss as written (what ``cross_entropy`` runs unless train.compile gave it a compiled version)."""
    V = logits.size(-1)
    if active(logits):
        return cross_entropy_rows(logits.reshape(-1, V), target.reshape(-1)).mean()
    if cpu_active(logits):  # the per-token log-probs generation reports (dettrain.generate.token_logprobs)
        return -rowwise.token_logprobs(logits.reshape(-1, V), target.reshape(-1)).mean()
    return F.cross_entropy(logits.float().reshape(-1, V), target.reshape(-1))


_LOSS_FN = None  # torch.compile(eager_cross_entropy) when train.compile is on (compile.py sets it)


def set_loss_fn(fn) -> None:
    """The function ``cross_entropy`` calls (None: ``eager_cross_entropy``); set by ``compile.compile_model``."""
    global _LOSS_FN
    _LOSS_FN = fn


def cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean token loss, like ``F.cross_entropy(logits.float().reshape(-1, V), target.reshape(-1))``; routes through
    the batch-invariant kernel when ``active(logits)``, and through its compiled version under train.compile."""
    return (_LOSS_FN or eager_cross_entropy)(logits, target)


CUSTOM_OPS = ("bi_mm", "bi_linear", "bi_rms_norm", "bi_rms_norm_bwd", "bi_cross_entropy", "bi_cross_entropy_bwd")
"""The ops this module registers under ``torch.ops.dettrain`` (attention.py registers the attention ops)."""
