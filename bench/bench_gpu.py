"""GPU benchmarks behind BENCHMARKS.md's "GPU (H200)" section.  Needs CUDA and Triton.

    python bench/bench_gpu.py fp          fingerprint kernel vs torch path vs a device copy / read, 1 GiB per dtype
    python bench/bench_gpu.py ops         attention / matmul / RMSNorm / loss kernels vs torch, at the model shapes
    python bench/bench_gpu.py invariance  which ops are batch-invariant, with det.batch_invariant on and off
    python bench/bench_gpu.py tiers --model 125m --tiers 0 2 3 4   step time and peak memory per tier, fingerprints
                                          on/off, tier >= 2 rerun and compared bit for bit
    python bench/bench_gpu.py llm7b --layers 2 4   the 7B shape with fewer layers at tier 3, extrapolated to 32
    python bench/bench_gpu.py attn-det    cuDNN SDPA under deterministic mode; dettrain's attention backward variants
    python bench/bench_gpu.py attn-cmp    attention backward: cuDNN vs the two-pass kernel vs the default, interleaved

Every subcommand prints a table and, with --json PATH, appends one JSON line per measurement.  Trainer-driven runs
build ``dettrain.loop.trainer.Trainer`` directly (world 1, no process group) and time ``train_step`` with
torch.cuda.synchronize around each step; CUBLAS_WORKSPACE_CONFIG is whatever the process was started with (it must
be set before CUDA initialises), so compare workspace settings with two processes.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dettrain.kernels import attention as attn  # noqa: E402
from dettrain.kernels import batch_invariant as bi  # noqa: E402

GiB = 1 << 30
OUT_JSON: Path | None = None


def emit(rec: dict) -> None:
    if OUT_JSON is not None:
        with OUT_JSON.open("a") as f:
            f.write(json.dumps(rec, default=str) + "\n")


def bench_ms(fn, warmup: int = 3, rep: int = 20) -> float:
    """Median of ``rep`` CUDA-event timings of fn() after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(rep):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def header() -> dict:
    import triton

    p = torch.cuda.get_device_properties(0)
    return {"torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton.__version__,
            "device": p.name, "sms": p.multi_processor_count, "date": time.strftime("%Y-%m-%d"),
            "cublas_workspace": os.environ.get("CUBLAS_WORKSPACE_CONFIG", "")}


# ---- the canonical reduce-scatter's row sum -------------------------------------------------------------------------
def _rowsum_case(numel: int, w: int, rec: dict) -> dict:
    from dettrain.kernels import rowsum
    from dettrain.sync.collectives import tree_sum_rows_torch

    x = torch.randn(w, numel // w, device="cuda")
    src = x.clone()
    out = torch.empty(numel // w, device="cuda")

    def torch_tree():
        x.copy_(src)
        out.copy_(tree_sum_rows_torch(x))

    def kernel():
        x.copy_(src)
        rowsum.tree_sum_rows_into(x, out)

    t_torch, t_kernel, t_copy = bench_ms(torch_tree), bench_ms(kernel), bench_ms(lambda: x.copy_(src))
    x.copy_(src)
    want = tree_sum_rows_torch(x).clone()
    x.copy_(src)
    rowsum.tree_sum_rows_into(x, out)
    gb = numel * 4 * (1 + 1 / w) / 1e9  # read every row once, write one row
    return rec | {"numel": numel, "world": w, "torch_ms": t_torch - t_copy, "kernel_ms": t_kernel - t_copy,
                  "refill_ms": t_copy, "kernel_GBps": gb / max(t_kernel - t_copy, 1e-6) * 1e3,
                  "bitwise": bool(torch.equal(out, want))}


def cmd_rowsum(args) -> None:
    """The tree over W rows of a reduce-scatter input: the level-by-level torch path vs kernels/rowsum.py (each timed
    with a refill of the input, whose time is subtracted).  Shapes: one 7B transformer block's fp32 gradient (202 M
    elements) over W ranks, and the embedding's (131 M)."""
    rec = header() | {"bench": "rowsum"}
    for numel in (202_375_168, 131_072_000):
        for w in args.worlds:
            r = _rowsum_case(numel, w, rec)
            print(f"rowsum numel {numel:,} W {w}: torch tree {r['torch_ms']:.3f} ms, kernel {r['kernel_ms']:.3f} ms "
                  f"({r['kernel_GBps']:.0f} GB/s), bitwise {r['bitwise']}")
            emit(r)
            torch.cuda.empty_cache()


# ---- fingerprints ------------------------------------------------------------------------------------------------
def cmd_fp(args) -> None:
    from dettrain.kernels import fingerprint as ft
    from dettrain.record import fingerprint as fpm

    print(header())
    n_bytes = GiB
    src = torch.randint(-(2**31), 2**31 - 1, (n_bytes // 4,), dtype=torch.int32, device="cuda")
    dst = torch.empty_like(src)
    t_copy = bench_ms(lambda: dst.copy_(src))
    t_read = bench_ms(lambda: src.view(torch.float32).sum())  # torch's own read-bound reduction
    # ms -> TB/s: bytes / (ms * 1e-3) / 1e12
    copy_bw, read_bw = 2 * n_bytes / t_copy / 1e9, n_bytes / t_read / 1e9
    print(f"device copy 1 GiB: {t_copy:.3f} ms = {copy_bw:.2f} TB/s (read+write); fp32 sum: {t_read:.3f} ms = "
          f"{read_bw:.2f} TB/s read")
    emit({"bench": "fp", "what": "copy", "ms": t_copy, "TBps": copy_bw, **header()})
    emit({"bench": "fp", "what": "sum_read", "ms": t_read, "TBps": read_bw})
    rows = []
    configs = [(ft.BLOCK, ft.PER_PROG, ft.NUM_WARPS)]
    if args.sweep:
        configs += [(2048, 4, 4), (4096, 8, 8), (8192, 2, 8), (2048, 8, 8), (4096, 2, 8), (4096, 4, 4)]
    dtypes = [torch.float32, torch.bfloat16, torch.uint8, torch.int64]
    for dt in dtypes:
        x = src.view(dt) if dt != torch.uint8 else src.view(torch.uint8)
        for blk, pp, nw in configs:
            ft.BLOCK, ft.PER_PROG, ft.NUM_WARPS = blk, pp, nw
            t = bench_ms(lambda x=x: ft.piece_sums([x], [0], [(0, 0, x.numel())]))
            bw = n_bytes / t / 1e9
            rows.append((str(dt), blk, pp, nw, t, bw))
            emit({"bench": "fp", "what": "triton", "dtype": str(dt), "BLOCK": blk, "PER_PROG": pp, "warps": nw,
                  "ms": t, "TBps": bw, "frac_read": bw / read_bw})
        ft.BLOCK, ft.PER_PROG, ft.NUM_WARPS = configs[0]
    # the whole call the trainer makes (table upload, launch, sum, host sync) and the torch reference
    x = src.view(torch.float32)
    t_call = bench_ms(lambda: fpm.fingerprint(x, 12345), rep=10)
    t_torch = bench_ms(lambda: fpm.fingerprint_torch(x, 12345), warmup=1, rep=3)
    same = fpm.fingerprint(x, 12345) == fpm.fingerprint_torch(x, 12345)
    emit({"bench": "fp", "what": "call", "ms_triton_call": t_call, "ms_torch": t_torch, "equal": same})
    print(f"{'dtype':16} {'BLOCK':>6} {'PER':>4} {'warps':>5} {'ms/GiB':>8} {'TB/s':>7} {'% read':>7}")
    for dt, blk, pp, nw, t, bw in rows:
        print(f"{dt:16} {blk:>6} {pp:>4} {nw:>5} {t:8.3f} {bw:7.2f} {100 * bw / read_bw:6.1f}%")
    print(f"fingerprint(fp32 1 GiB) full call {t_call:.3f} ms; torch path {t_torch:.2f} ms; equal={same}")


# ---- op kernels ------------------------------------------------------------------------------------------------
def _attn_case(B: int, H: int, HKV: int, T: int, D: int):
    q = torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(B, HKV, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(B, HKV, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    return q, k, v


def cmd_ops(args) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    print(header())
    torch.backends.cuda.matmul.allow_tf32 = False
    # attention: fwd and fwd+bwd, ms; TFLOP/s counts the causal half (fwd 2 matmuls, bwd 5 (FA2's count))
    cases = {"125m": (8, 12, 12, 1024, 64), "1b": (4, 32, 4, 2048, 64), "7b": (1, 32, 32, 4096, 128)}
    parts = args.parts.split(",")
    if "attn" not in parts:
        cases = {}
    print(f"{'attention':30} {'fwd ms':>8} {'f+b ms':>8} {'bwd TF/s':>9}")
    for name, (B, H, HKV, T, D) in cases.items():
        q, k, v = _attn_case(B, H, HKV, T, D)
        do = torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16)
        flops_f = 4 * B * H * T * T * D / 2
        rep = H // HKV

        def sdpa(q=q, k=k, v=v, rep=rep):
            kk = k.repeat_interleave(rep, 1) if rep > 1 else k
            vv = v.repeat_interleave(rep, 1) if rep > 1 else v
            return F.scaled_dot_product_attention(q, kk, vv, is_causal=True)

        variants = {
            "sdpa default": (sdpa, None, False),
            "sdpa cudnn": (sdpa, SDPBackend.CUDNN_ATTENTION, False),
            "sdpa flash": (sdpa, SDPBackend.FLASH_ATTENTION, False),
            "sdpa deterministic": (sdpa, None, True),
            "dettrain triton": (lambda q=q, k=k, v=v: attn.attention(q, k, v), None, False),
        }
        for vname, (fn, backend, det) in variants.items():
            try:
                torch.use_deterministic_algorithms(det)
                ctx = sdpa_kernel([backend]) if backend is not None else _null()
                with ctx:
                    tf = bench_ms(lambda fn=fn: fn())

                    def fb(fn=fn, ins=(q, k, v), do=do):
                        torch.autograd.grad(fn(), ins, do)

                    tfb = bench_ms(fb)
                tb = tfb - tf
                print(f"{name + ' ' + vname:30} {tf:8.3f} {tfb:8.3f} {2.5 * flops_f / tb / 1e9:9.0f}")
                emit({"bench": "attn", "shape": name, "variant": vname, "fwd_ms": tf, "fwdbwd_ms": tfb})
            except Exception as e:  # noqa: BLE001 - report and go on
                print(f"{name + ' ' + vname:30} failed: {type(e).__name__}: {str(e)[:120]}")
            finally:
                torch.use_deterministic_algorithms(False)
        # correctness against fp32 math, and bitwise rerun equality of our backward
        qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
        ref = F.scaled_dot_product_attention(qf, kf.repeat_interleave(rep, 1), vf.repeat_interleave(rep, 1),
                                             is_causal=True)
        rg = torch.autograd.grad(ref, (qf, kf, vf), do.float())
        o = attn.attention(q, k, v)
        g1 = torch.autograd.grad(o, (q, k, v), do)
        g2 = torch.autograd.grad(attn.attention(q, k, v), (q, k, v), do)
        err = [float((a.float() - b).norm() / b.norm()) for a, b in zip((o, *g1), (ref, *rg))]
        same = all(torch.equal(a, b) for a, b in zip(g1, g2))
        errs = ", ".join(f"{e:.1e}" for e in err)
        print(f"  {name}: rel err o/dq/dk/dv {errs}; backward rerun bitwise equal: {same}")
        emit({"bench": "attn_check", "shape": name, "rel_err": err, "rerun_equal": same})
        del q, k, v, do, qf, kf, vf, ref, rg, o, g1, g2
        torch.cuda.empty_cache()

    # matmul at the model shapes: (M tokens, K in, N out)
    shapes = {"125m qkv/o": (8192, 768, 768), "125m ffn up": (8192, 768, 2048), "125m ffn down": (8192, 2048, 768),
              "125m logits": (8192, 768, 32000), "1b ffn up": (8192, 2048, 5632), "1b logits": (8192, 2048, 32000),
              "7b qkv": (4096, 4096, 4096), "7b ffn up": (4096, 4096, 11008), "7b ffn down": (4096, 11008, 4096)}
    if "mm" not in parts:
        shapes = {}
    configs = [None]
    if args.sweep:
        configs += [{"BM": 128, "BN": 256, "BK": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 3},
                    {"BM": 128, "BN": 128, "BK": 64, "GROUP_M": 8, "num_warps": 4, "num_stages": 4},
                    {"BM": 64, "BN": 128, "BK": 64, "GROUP_M": 8, "num_warps": 4, "num_stages": 4}]
    print(f"{'matmul (M,K,N)':34} {'cuBLAS':>8} " + " ".join(f"{'cfg' + str(i):>8}" for i in range(len(configs)))
          + "   (TFLOP/s; fwd, dX, dW)")
    for name, (M, K, N) in shapes.items():
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        fl = 2 * M * N * K
        ops = {op: (lambda a=a, b=b: a @ b, lambda a=a, b=b: bi.mm(a, b))
               for op, (a, b) in (("fwd", (x, w.t())), ("dX", (dy, w)), ("dW", (dy.t(), x)))}
        for op, (ref_fn, our_fn) in ops.items():
            t_ref = bench_ms(ref_fn)
            ts = []
            for cfg in configs:
                bi.MM_CONFIG_OVERRIDE = cfg
                ts.append(bench_ms(our_fn))
            bi.MM_CONFIG_OVERRIDE = None
            err = float((bi.mm(*_mm_args(op, x, w, dy)).float() - ref_fn().float()).norm() / ref_fn().float().norm())
            print(f"{name + ' ' + op + ' ' + str((M, K, N)):34} {fl / t_ref / 1e9:8.0f} "
                  + " ".join(f"{fl / t / 1e9:8.0f}" for t in ts) + f"   err {err:.1e}")
            emit({"bench": "mm", "shape": name, "op": op, "MKN": (M, K, N), "cublas_ms": t_ref, "ours_ms": ts,
                  "configs": configs, "rel_err": err})
        del x, w, dy
    # RMSNorm and loss
    for rows, D in ((8192, 768), (8192, 2048), (4096, 4096)) if "norm" in parts else ():
        x = torch.randn(rows, D, device="cuda", requires_grad=True)
        w = torch.ones(D, device="cuda", requires_grad=True)
        dy = torch.randn(rows, D, device="cuda")

        def ref(x=x, w=w):
            xf = x.float()
            return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5) * w

        t_ref = bench_ms(lambda ref=ref, x=x, w=w, dy=dy: torch.autograd.grad(ref(), (x, w), dy))
        t_bi = bench_ms(lambda x=x, w=w, dy=dy: torch.autograd.grad(bi.rms_norm(x, w, 1e-5), (x, w), dy))
        print(f"rmsnorm fwd+bwd {rows}x{D}: torch {t_ref:.3f} ms, ours {t_bi:.3f} ms")
        emit({"bench": "rmsnorm", "shape": (rows, D), "torch_ms": t_ref, "ours_ms": t_bi})
    for rows in (8192, 16384) if "norm" in parts else ():
        lg = torch.randn(rows, 32000, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        tg = torch.randint(0, 32000, (rows,), device="cuda")
        t_ref = bench_ms(lambda lg=lg, tg=tg: torch.autograd.grad(F.cross_entropy(lg.float(), tg), lg))
        t_bi = bench_ms(lambda lg=lg, tg=tg: torch.autograd.grad(bi.cross_entropy_rows(lg, tg).mean(), lg))
        err = float((bi.cross_entropy_rows(lg, tg).mean() - F.cross_entropy(lg.float(), tg)).abs())
        print(f"cross-entropy fwd+bwd {rows}x32000: torch(fp32 copy) {t_ref:.3f} ms, ours {t_bi:.3f} ms, "
              f"|dloss| {err:.1e}")
        emit({"bench": "ce", "rows": rows, "torch_ms": t_ref, "ours_ms": t_bi, "abs_err": err})


def cmd_attn_sweep(args) -> None:
    """Block sizes of dettrain's attention kernels at the model shapes (fixed per head size in the library)."""
    print(header())
    fwd_cfgs = [(128, 64, 4, 3), (128, 128, 8, 3), (128, 64, 8, 3), (64, 64, 4, 3), (128, 32, 4, 4), (64, 128, 4, 3),
                (64, 64, 4, 4), (64, 32, 4, 4), (128, 64, 8, 2), (64, 128, 8, 3)]
    bwd_cfgs = [(64, 64, 4, 2), (64, 64, 4, 3), (32, 64, 4, 2), (64, 128, 8, 2), (128, 64, 8, 2), (64, 64, 8, 2),
                (32, 128, 4, 2), (128, 128, 8, 2)]
    cases = {"125m": (8, 12, 12, 1024, 64), "1b": (4, 32, 4, 2048, 64), "7b": (1, 32, 32, 4096, 128)}
    for name, (B, H, HKV, T, D) in cases.items():
        if name not in args.shapes:
            continue
        q, k, v = _attn_case(B, H, HKV, T, D)
        do = torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16)
        base = attn._attn_blocks(D, H // HKV)
        fwd_t = {}
        for c in fwd_cfgs:
            attn.ATTN_BLOCK_OVERRIDE = {**base, "fwd": c}
            try:
                fwd_t[c] = bench_ms(lambda ins=(q, k, v): attn.attention(*ins))
            except Exception as e:  # noqa: BLE001 - out of shared memory etc.
                print(f"  {name} fwd {c}: {type(e).__name__}")
        bwd_t = {}
        for c in bwd_cfgs:
            attn.ATTN_BLOCK_OVERRIDE = {"fwd": base["fwd"], "bwd": c}
            try:
                o = attn.attention(q, k, v)
                bwd_t[c] = bench_ms(lambda o=o, ins=(q, k, v), do=do: torch.autograd.grad(o, ins, do,
                                                                                             retain_graph=True))
            except Exception as e:  # noqa: BLE001
                print(f"  {name} bwd {c}: {type(e).__name__}")
        attn.ATTN_BLOCK_OVERRIDE = None
        bf = min(fwd_t, key=fwd_t.get)
        bb = min(bwd_t, key=bwd_t.get)
        print(f"{name}: fwd " + " ".join(f"{c}:{t:.3f}" for c, t in fwd_t.items()) + f"  best {bf}")
        print(f"{name}: bwd " + " ".join(f"{c}:{t:.3f}" for c, t in bwd_t.items()) + f"  best {bb}")
        emit({"bench": "attn_sweep", "shape": name, "fwd": {str(c): t for c, t in fwd_t.items()},
              "bwd": {str(c): t for c, t in bwd_t.items()}, "best_fwd": bf, "best_bwd": bb})
        del q, k, v, do
        torch.cuda.empty_cache()


DKDV_CFGS = [(128, 128, 8, 2), (64, 128, 8, 2), (64, 128, 8, 3), (32, 128, 4, 3), (32, 128, 4, 4), (32, 128, 8, 3),
             (64, 64, 4, 3), (32, 64, 4, 4), (64, 128, 4, 3), (128, 64, 8, 2), (64, 64, 8, 3), (128, 128, 8, 3)]
DQ_CFGS = [(128, 128, 8, 2), (128, 64, 8, 2), (128, 64, 8, 3), (128, 32, 4, 4), (128, 32, 4, 5), (128, 32, 8, 4),
           (64, 64, 4, 3), (128, 64, 4, 3), (64, 32, 4, 4), (64, 64, 4, 2), (64, 32, 4, 3), (128, 128, 8, 3)]


def _attn_bwd_case(name: str, B: int, H: int, HKV: int, T: int, D: int) -> None:
    import triton

    q, k, v = _attn_case(B, H, HKV, T, D)
    do = torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16)
    G = H // HKV
    o, lse = attn._attn_fwd_cuda(q, k, v)
    sm = 1.0 / (D ** 0.5)
    delta = torch.empty((B * H, T), dtype=torch.float32, device="cuda")
    attn._attn_delta_kernel[(triton.cdiv(T, 128), B * H)](
        o, do, delta, H, T, o.stride(0), o.stride(1), o.stride(2), do.stride(0), do.stride(1), do.stride(2),
        D=D, BM=128, num_warps=4)
    common = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
              v.stride(0), v.stride(1), v.stride(2), do.stride(0), do.stride(1), do.stride(2))
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    def dkdv(c):
        BM, BN, nw, ns = c
        grid, blk = attn._launch(triton.cdiv(T, BN), B * HKV, {}, q.device)
        attn._attn_bwd_dkdv_kernel[grid](
            q, k, v, do, lse, delta, dk, dv, sm * attn.LOG2E, sm, *common, dk.stride(0), dk.stride(1),
            dk.stride(2), dv.stride(0), dv.stride(1), dv.stride(2), H, HKV, G, T, dk, 0, D=D, BM=BM, BN=BN,
            EVEN=T % BM == 0 and T % BN == 0, STORE_DS=False, BLK=blk, num_warps=nw, num_stages=ns)

    def dqk(c):
        BM, BN, nw, ns = c
        grid, blk = attn._launch(triton.cdiv(T, BM), B * H, {}, q.device)
        attn._attn_bwd_dq_kernel[grid](
            q, k, v, do, lse, delta, dq, sm * attn.LOG2E, sm, *common, dq.stride(0), dq.stride(1), dq.stride(2),
            H, G, T, D=D, BM=BM, BN=BN, EVEN=T % BM == 0 and T % BN == 0, BLK=blk, num_warps=nw, num_stages=ns)

    base = attn._attn_blocks_two_pass(D, G)  # the two-pass kernels, each alone (dS not stored)
    dkdv(base["dkdv"])
    dqk(base["dq"])
    outs = {"dq": dq, "dk": dk, "dv": dv}
    ref = {n: t.float().clone() for n, t in outs.items()}
    for label, fn, cfgs, names in (("dkdv", dkdv, DKDV_CFGS, ("dk", "dv")), ("dq", dqk, DQ_CFGS, ("dq",))):
        cur = base[label]
        res = {}
        for c in cfgs:
            try:
                fn(c)
                err = max(float((outs[n].float() - ref[n]).abs().max() / ref[n].abs().max()) for n in names)
                res[c] = (bench_ms(functools.partial(fn, c), warmup=3, rep=20), err)
            except Exception as e:  # noqa: BLE001 - out of shared memory etc.
                print(f"  {name} {label} {c}: {type(e).__name__} {str(e)[:80]}")
        best = min(res, key=lambda c: res[c][0])
        print(f"{name} {label} (current {cur}: {res.get(cur, (float('nan'),))[0]:.3f} ms): " +
              " ".join(f"{c}:{t:.3f}/{e:.1e}" for c, (t, e) in res.items()) + f"  best {best}", flush=True)
        emit({"bench": "attn_bwd_sweep", "shape": name, "kernel": label, "current": cur,
              "ms": {str(c): t for c, (t, _) in res.items()}, "rel_err": {str(c): e for c, (_, e) in res.items()},
              "best": best})


def cmd_attn_bwd_sweep(args) -> None:
    """The two backward kernels timed one at a time, each over its own block sizes (the library shares one
    (BLOCK_M, BLOCK_N, warps, stages) between them), at the micro-batch shapes the trainer runs."""
    print(header())
    cases = {"125m": (32, 12, 12, 1024, 64), "1b": (4, 32, 4, 2048, 64), "7b": (1, 32, 32, 4096, 128)}
    for name, shape in cases.items():
        if name not in args.shapes:
            continue
        _attn_bwd_case(name, *shape)
        torch.cuda.empty_cache()


ATTN_SHAPES = {"125m": (32, 12, 12, 1024, 64), "1b": (4, 32, 4, 2048, 64), "7b": (1, 32, 32, 4096, 128),
               "7b2": (2, 32, 32, 4096, 128), "1b1": (1, 32, 4, 2048, 64), "1b2": (2, 32, 4, 2048, 64),
               "1b8": (8, 32, 4, 2048, 64)}
"""The trainer's micro-batch shapes (B, H, HKV, T, D) of the three models, causal, bf16 (7b2: the 7B model with two
sequences a micro-batch, whose 1.04 GiB of dS runs in two slices; 1b1, 1b2, 1b8: the 1b model at micro-batches 1,
2 and 8, "1b" being 4)."""
DS_CFGS = {
    64: [((32, 64, 4, 4), (64, 64, 4, 3)), ((64, 64, 4, 3), (64, 64, 4, 3)), ((32, 64, 4, 4), (128, 64, 8, 3)),
         ((64, 64, 4, 3), (128, 64, 4, 3)), ((64, 128, 8, 2), (128, 128, 8, 2)), ((32, 64, 4, 4), (64, 64, 4, 4))],
    128: [((32, 64, 4, 4), (64, 64, 4, 3)), ((32, 64, 4, 4), (128, 64, 8, 3)), ((32, 64, 4, 4), (64, 64, 4, 4)),
          ((64, 64, 8, 2), (64, 64, 4, 3)), ((32, 128, 8, 2), (64, 128, 8, 2))]}
"""The dS-storing backward's candidate (dK/dV, dQ) blocks per head size."""


def _grads_equal(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


def _cudnn_case(name, q, k, v, do, det: bool, reps: int) -> dict:
    """cuDNN SDPA (k/v already expanded to every query head) with torch's deterministic mode on or off: does it
    run, what does it warn, which kernels ran, the forward and backward time, and whether reruns and a batch of
    one give the same bits."""
    import warnings

    from torch.nn.attention import SDPBackend, sdpa_kernel

    rec = {"bench": "attn_det", "shape": name, "impl": "cudnn", "deterministic": det}
    torch.use_deterministic_algorithms(det)
    try:
        with warnings.catch_warnings(record=True) as caught, sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            warnings.simplefilter("always")

            def fwd(q=q, k=k, v=v):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)

            o = fwd()
            runs = [torch.autograd.grad(o, (q, k, v), do, retain_graph=True) for _ in range(reps)]
            rec["rerun_equal"] = all(_grads_equal(runs[0], r) for r in runs[1:])
            rec["fwd_ms"] = bench_ms(fwd)
            rec["bwd_ms"] = bench_ms(lambda o=o: torch.autograd.grad(o, (q, k, v), do, retain_graph=True))
            if q.shape[0] > 1:
                o1 = F.scaled_dot_product_attention(q[:1], k[:1], v[:1], is_causal=True)
                g1 = torch.autograd.grad(o1, (q, k, v), do[:1])
                rec["batch_invariant"] = (torch.equal(o1, o[:1]) and
                                          _grads_equal([g[:1] for g in g1], [g[:1] for g in runs[0]]))
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                torch.autograd.grad(fwd(), (q, k, v), do)
                torch.cuda.synchronize()
            rec["kernels"] = sorted({e.key[:90] for e in prof.key_averages()})[:12]
        rec["ran"] = True
        rec["warnings"] = sorted({str(w.message)[:200] for w in caught})
    except Exception as e:  # noqa: BLE001 - the finding is that it does not run
        rec["ran"] = False
        rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    finally:
        torch.use_deterministic_algorithms(False)
    print(json.dumps(rec, default=str), flush=True)
    emit(rec)
    return rec


def cmd_attn_det(args) -> None:
    """Issue 26's measurement, one call: (a) cuDNN SDPA's backward with and without torch's deterministic mode
    (runs? warns? which kernels? rerun- and batch-stable? how fast?) and (b) dettrain's kernel, forward and
    backward: the two-pass backward (dK/dV, then dQ recomputing S, P and dP) and the backward whose dK/dV pass
    stores dS for a one-product dQ pass, over its block sizes (``DS_CFGS``), each checked for rerun identity
    (``--reps`` runs), batch invariance, equality with the two-pass bits and error against a float64 reference."""
    print(header())
    torch.backends.cuda.matmul.allow_tf32 = False
    for name in args.shapes:
        _attn_det_shape(name, args.reps)
        torch.cuda.empty_cache()


def _attn_inputs(name: str):
    """One shape's backward inputs: (B, H, T, D, G, q, k, v, dO, and k, v expanded to every query head for cuDNN)."""
    B, H, HKV, T, D = ATTN_SHAPES[name]
    G = H // HKV
    q, k, v = _attn_case(B, H, HKV, T, D)
    do = torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16)
    kx, vx = (t.detach().repeat_interleave(G, 1).requires_grad_() for t in (k, v))
    return B, H, T, D, G, q, k, v, do, kx, vx


def _attn_det_shape(name: str, reps: int) -> None:
    B, H, T, D, G, q, k, v, do, kx, vx = _attn_inputs(name)
    for det in (False, True):
        _cudnn_case(name, q, kx, vx, do, det, reps)
    del kx, vx
    # float64 reference (dettrain's CPU reference math, on the GPU)
    q64, k64, v64, do64 = (t.detach().double() for t in (q, k, v, do))
    o64, lse64 = attn._attn_fwd_ref(q64, k64, v64)
    ref = attn._attn_bwd_ref(q64, k64, v64, o64, lse64, do64)
    del q64, k64, v64, o64, lse64, do64
    torch.cuda.empty_cache()
    o, lse = attn._attn_fwd_cuda(q, k, v)
    t_fwd = bench_ms(lambda: attn._attn_fwd_cuda(q, k, v))
    base = attn._attn_blocks(D, G)
    two = attn._attn_blocks_two_pass(D, G)
    variants = {"two-pass " + str((two["dkdv"], two["dq"])): two}
    for c in [(base["dkdv"], base["dq"])] + [c for c in DS_CFGS[D] if c != (base["dkdv"], base["dq"])]:
        variants["dS stored " + str(c)] = {"fwd": base["fwd"], "dkdv": c[0], "dq": c[1], "ds": True}
    first = None
    for vname, cfg in variants.items():
        rec = {"bench": "attn_det", "shape": name, "impl": "dettrain " + vname, "fwd_ms": t_fwd}
        attn.ATTN_BLOCK_OVERRIDE = cfg
        try:
            runs = [attn._attn_bwd_cuda(q, k, v, o, lse, do) for _ in range(reps)]
            rec["rerun_equal"] = all(_grads_equal(runs[0], r) for r in runs[1:])
            rec["rel_err_dq_dk_dv"] = [float((a.double() - r).norm() / r.norm()) for a, r in zip(runs[0], ref)]
            rec["bwd_ms"] = bench_ms(lambda: attn._attn_bwd_cuda(q, k, v, o, lse, do))
            if first is None:
                first = runs[0]
            else:
                rec["equal_to_two_pass"] = [torch.equal(a, b) for a, b in zip(runs[0], first)]
                rec["ds_mib"] = B * H * attn._ds_per_head(T, cfg["dkdv"][1]) * 2 / 2**20
            # batch invariance: the first sample alone (7b: a batch of two built from it)
            if B > 1:
                sl = [t[:1] for t in (q, k, v, o, do)]
                g1 = attn._attn_bwd_cuda(*sl[:4], lse.view(B, H, T)[:1].reshape(H, T), sl[4])
                rec["batch_invariant"] = _grads_equal(g1, [g[:1] for g in runs[0]])
            else:
                two_b = [torch.cat([t, t.flip(2)]) for t in (q, k, v, do)]
                o2, lse2 = attn._attn_fwd_cuda(*two_b[:3])
                g2 = attn._attn_bwd_cuda(*two_b[:3], o2, lse2, two_b[3])
                rec["batch_invariant"] = _grads_equal([g[:1] for g in g2], runs[0])
                del two_b, o2, lse2, g2
        except Exception as e:  # noqa: BLE001 - out of shared memory etc.
            rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        finally:
            attn.ATTN_BLOCK_OVERRIDE = None
        print(json.dumps(rec, default=str), flush=True)
        emit(rec)


def cmd_attn_cmp(args) -> None:
    """The attention backward against cuDNN's (non-deterministic) in one process, interleaved ``--rounds`` times
    per shape: cuDNN SDPA (k/v expanded to every query head), dettrain's two-pass backward as it was, and the
    library's default (dS stored where ``_attn_blocks`` says so).  Backward only (the forward's outputs saved), and
    the forwards once; bits: the default against the two-pass backward and against its own rerun."""
    print(header())
    torch.backends.cuda.matmul.allow_tf32 = False
    for name in args.shapes:
        _attn_cmp_shape(name, args.rounds, args.extra)
        torch.cuda.empty_cache()


def _extra_blocks(lib: dict, specs: list[str]) -> dict[str, dict]:
    """``--extra`` variants: "KIND:BM,BN,WARPS,STAGES" (KIND fwd, dkdv or dq) replaces that kernel's blocks in the
    library's choice, and several joined by "+" ("dkdv:64,128,8,3+dq:64,128,8,3") replace each; "ds" / "nods"
    stores dS or not; "split:N" splits each GQA group's query heads over N dK/dV programs; "cap:GIB" runs the
    library's choice with ``DS_MAX_BYTES`` at GIB GiB (how many slices the dS backward takes)."""
    out = {}
    for spec in specs:
        if spec in ("ds", "nods"):
            out[spec] = {**lib, "ds": spec == "ds"}
            continue
        if spec.startswith("split:"):  # the dK/dV pass with each GQA group split into N parts (attention.kv_split)
            out[spec] = {**lib, "split": int(spec[6:])}
            continue
        if spec.startswith("cap:"):
            out[spec] = {**lib, "_cap": int(float(spec[4:]) * 2**30)}
            continue
        cfg = dict(lib)
        for part in spec.split("+"):
            kind, _, nums = part.partition(":")
            cfg[kind] = tuple(int(x) for x in nums.split(","))
        if cfg.get("ds") and (cfg["dkdv"][1] % cfg["dkdv"][0] or cfg["dq"][1] != cfg["dkdv"][1]):
            print(f"  --extra {spec}: not valid with dS stored, skipped")
            continue
        out[spec] = cfg
    return out


def _attn_cmp_shape(name: str, rounds: int, extra: list[str] | None = None) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    B, H, T, D, G, q, k, v, do, kx, vx = _attn_inputs(name)
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        oc = F.scaled_dot_product_attention(q, kx, vx, is_causal=True)
        t_cf = bench_ms(lambda: F.scaled_dot_product_attention(q, kx, vx, is_causal=True))
    o, lse = attn._attn_fwd_cuda(q, k, v)
    t_f = bench_ms(lambda: attn._attn_fwd_cuda(q, k, v))
    two, lib = attn._attn_blocks_two_pass(D, G), attn._attn_blocks(D, G)
    # "per-head" / "longest-first": the library's blocks launched in either order (kernels/attention.py ``_launch``;
    # the default picks one by the head count), the same bits
    cfgs = {"two-pass": two, "default": lib, "per-head": {**lib, "launch": "per-head"},
            "longest-first": {**lib, "launch": "longest-first"}}
    if not lib.get("ds"):
        cfgs["dS stored"] = {**lib, "ds": True}
    cfgs.update(_extra_blocks(lib, extra or []))

    def ours(cfg):
        cap = attn.DS_MAX_BYTES
        attn.ATTN_BLOCK_OVERRIDE = {n: x for n, x in cfg.items() if n != "_cap"}
        attn.DS_MAX_BYTES = cfg.get("_cap", cap)
        try:
            return attn._attn_bwd_cuda(q, k, v, o, lse, do)
        finally:
            attn.ATTN_BLOCK_OVERRIDE = None
            attn.DS_MAX_BYTES = cap

    def cudnn():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            torch.autograd.grad(oc, (q, kx, vx), do, retain_graph=True)

    failed = {}
    for n, c in list(cfgs.items()):  # a variant that does not compile (shared memory, registers) is reported and
        try:                         # left out
            ours(c)
        except Exception as e:  # noqa: BLE001
            failed[n] = f"{type(e).__name__}: {str(e)[:300]}"
            print(f"  {name} {n}: {failed[n]}", flush=True)
            del cfgs[n]
    times: dict[str, list[float]] = {"cudnn": [], **{n: [] for n in cfgs}}
    for _ in range(rounds):
        times["cudnn"].append(bench_ms(cudnn))
        for n, c in cfgs.items():
            times[n].append(bench_ms(functools.partial(ours, c)))
    a, b, b2 = ours(lib), ours(two), ours(lib)
    rec = {"bench": "attn_cmp", "shape": name, "fwd_ms": {"cudnn": t_cf, "dettrain": t_f}, "bwd_ms": times,
           "default": lib, "two_pass": two, "default_equals_two_pass": [torch.equal(x, y) for x, y in zip(a, b)],
           "default_rerun_equal": _grads_equal(a, b2),
           "equals_default": {n: [torch.equal(x, y) for x, y in zip(a, ours(c))] for n, c in cfgs.items()
                              if n not in ("two-pass", "default")},
           "ds_mib": B * H * attn._ds_per_head(T, lib["dkdv"][1]) * 2 / 2**20 if lib.get("ds") else 0,
           "failed": failed}
    med = {n: statistics.median(t) for n, t in times.items()}
    print(f"{name}: fwd cudnn {t_cf:.3f} dettrain {t_f:.3f} ms; bwd " +
          ", ".join(f"{n} {' '.join(f'{x:.3f}' for x in t)}" for n, t in times.items()) +
          f"; default/cudnn {med['default'] / med['cudnn']:.3f}"
          f", two-pass/cudnn {med['two-pass'] / med['cudnn']:.3f}"
          f"; bits default==two-pass {rec['default_equals_two_pass']}, rerun {rec['default_rerun_equal']}"
          f"; == default {rec['equals_default']}", flush=True)
    emit(rec)


def cmd_attn_cudnn_fwd(args) -> None:
    """Could cuDNN's attention forward pair with dettrain's deterministic backward?  Per shape: does the aten op
    run under torch's deterministic mode, are its output and log-sum-exp the same bits over ``--reps`` reruns and
    for a batch of one, how far its log-sum-exp (natural log) is from dettrain's (log2 units) and its output from
    dettrain's, the backward's error against float64 when it is fed cuDNN's output and log-sum-exp, and both
    forwards' times.  The forward has no cross-block accumulation to order, which is what this checks."""
    print(header())
    torch.backends.cuda.matmul.allow_tf32 = False
    for name in args.shapes:
        B, H, T, D, G, q, k, v, do, kx, vx = _attn_inputs(name)
        rec = {"bench": "attn_cudnn_fwd", "shape": name}

        def cudnn(q=q, kx=kx, vx=vx):
            out = torch.ops.aten._scaled_dot_product_cudnn_attention(q, kx, vx, None, True, 0.0, True, False)
            return out[0], out[1]

        torch.use_deterministic_algorithms(True)
        try:
            o_c, l_c = cudnn()
            rec["ran_deterministic_mode"] = True
            runs = [cudnn() for _ in range(args.reps)]
            rec["rerun_equal"] = all(torch.equal(o_c, a) and torch.equal(l_c, b) for a, b in runs)
            rec["lse_shape"] = list(l_c.shape)
            if B > 1:
                o1, l1 = cudnn(q[:1], kx[:1], vx[:1])
                rec["batch_invariant"] = torch.equal(o1, o_c[:1]) and torch.equal(l1, l_c[:1])
            o, lse = attn._attn_fwd_cuda(q, k, v)
            l2 = (l_c.reshape(B * H, T).float() * attn.LOG2E)
            rec["lse_max_abs_diff_log2"] = float((l2 - lse).abs().max())
            rec["o_max_abs_diff"] = float((o_c.float() - o.float()).abs().max())
            q64, k64, v64, do64 = (t.detach().double() for t in (q, k, v, do))
            o64, lse64 = attn._attn_fwd_ref(q64, k64, v64)
            ref = attn._attn_bwd_ref(q64, k64, v64, o64, lse64, do64)
            del q64, k64, v64, o64, lse64, do64
            ours = attn._attn_bwd_cuda(q, k, v, o, lse, do)
            mixed = attn._attn_bwd_cuda(q, k, v, o_c, l2.contiguous(), do)
            rec["rel_err_ours"] = [float((a.double() - r).norm() / r.norm()) for a, r in zip(ours, ref)]
            rec["rel_err_cudnn_fwd"] = [float((a.double() - r).norm() / r.norm()) for a, r in zip(mixed, ref)]
            rec["fwd_ms"] = {"cudnn": bench_ms(cudnn),
                             "dettrain": bench_ms(functools.partial(attn._attn_fwd_cuda, q, k, v))}
        except Exception as e:  # noqa: BLE001 - the finding may be that it does not run
            rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        finally:
            torch.use_deterministic_algorithms(False)
        print(json.dumps(rec, default=str), flush=True)
        emit(rec)
        torch.cuda.empty_cache()


def _mm_args(op, x, w, dy):
    return {"fwd": (x, w.t()), "dX": (dy, w), "dW": (dy.t(), x)}[op]


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


# ---- batch invariance ---------------------------------------------------------------------------------------------
def cmd_invariance(args) -> None:
    """Row 0 (sample 0) computed alone and inside batches of other sizes / at other positions: bitwise equal?"""
    print(header())
    torch.manual_seed(0)
    sizes = [1, 2, 3, 4, 5, 7, 8, 16, 31, 64, 128]
    D, V, T = 768, 32000, 256

    def linear_op(xb):
        return (bi.linear(xb, W) if bi.enabled() else F.linear(xb, W))

    def rms_op(xb):
        if bi.enabled():
            return bi.rms_norm(xb, g, 1e-5)
        xf = xb.float()
        return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5) * g

    def ce_op(xb):
        tg = torch.zeros(xb.shape[0], dtype=torch.long, device="cuda")
        if bi.enabled():
            return bi.cross_entropy_rows(xb, tg)
        return F.cross_entropy(xb.float(), tg, reduction="none")

    def attn_fwd(xb):
        return attn.attention(xb, xb, xb) if bi.enabled() else F.scaled_dot_product_attention(xb, xb, xb,
                                                                                           is_causal=True)

    def attn_bwd(xb):
        xb = xb.detach().requires_grad_()
        o = attn_fwd(xb)
        return torch.autograd.grad(o, xb, torch.ones_like(o))[0]

    W = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) * 0.02
    g = torch.randn(D, device="cuda")
    pool = {"linear bf16 (rows x 4096)": (linear_op, torch.randn(128, 4096, device="cuda", dtype=torch.bfloat16)),
            "rmsnorm fp32 (rows x 768)": (rms_op, torch.randn(128, D, device="cuda")),
            "cross-entropy bf16 (rows x 32000)": (ce_op, torch.randn(128, V, device="cuda", dtype=torch.bfloat16)),
            "attention fwd (B x 12 x 256 x 64)": (attn_fwd, torch.randn(128, 12, T, 64, device="cuda",
                                                                         dtype=torch.bfloat16)),
            "attention bwd dX": (attn_bwd, torch.randn(128, 12, T, 64, device="cuda", dtype=torch.bfloat16))}
    print(f"{'op':36} {'batch_invariant':>16} {'batch sizes differing from B=1 (row 0)':>40} {'position':>9}")
    for name, (fn, data) in pool.items():
        for on in (False, True):
            bi.set_enabled(on)
            ref = fn(data[:1])[0]
            diff_sizes = [b for b in sizes if not torch.equal(fn(data[:b])[0], ref)]
            # the same sample at another position of a batch of 8
            batch = data[:8].clone()
            batch[5] = data[0]
            pos_ok = torch.equal(fn(batch)[5], fn(batch)[0])
            verdict = "invariant" if not diff_sizes and pos_ok else "VARIANT"
            print(f"{name:36} {str(on):>16} {str(diff_sizes) if diff_sizes else 'none':>40} "
                  f"{'same' if pos_ok else 'differs':>9}  {verdict}")
            emit({"bench": "invariance", "op": name, "batch_invariant": on, "differing_sizes": diff_sizes,
                  "position_equal": pos_ok})
    bi.set_enabled(False)


# ---- training steps per tier --------------------------------------------------------------------------------------
MODELS = {
    # name: (model preset overrides, seq_len, micro_batch, global_batch)
    # micro-batches of 32 x 1024 tokens keep the GPU busier than the CPU that launches its ~1500 kernels
    "125m": ({"name": "125m", "dim": 768, "n_layers": 12, "n_heads": 12, "n_kv_heads": 12, "ffn_dim": 2048,
              "vocab_size": 32000}, 1024, 32, 128),
    "125m_anchor": ({"name": "125m", "dim": 768, "n_layers": 12, "n_heads": 12, "n_kv_heads": 12, "ffn_dim": 2048,
                     "vocab_size": 32000}, 1024, 8, 8),
    "1b": ({"name": "1b", "dim": 2048, "n_layers": 22, "n_heads": 32, "n_kv_heads": 4, "ffn_dim": 5632,
            "vocab_size": 32000}, 2048, 4, 16),
    "7b": ({"name": "7b", "dim": 4096, "n_layers": 32, "n_heads": 32, "n_kv_heads": 32, "ffn_dim": 11008,
            "vocab_size": 32000}, 4096, 1, 4),
}


COMPILE = "auto"  # --compile: train.compile of Trainer-driven runs (auto: the trainer's default, on for CUDA)


def make_cfg(model: str, tier: int, *, layers: int | None = None, ckpt: bool = False, bi_mode: bool | None = None,
             seed: int = 0, global_batch: int | None = None, engine: str = "auto",
             compile: bool | str | None = None, offload: bool = False):
    from dettrain.config import Config, LogConfig, TrainConfig, WandbConfig
    from dettrain.data import DataConfig
    from dettrain.determinism import DetConfig
    from dettrain.dist import DistConfig
    from dettrain.models.llama import ModelConfig

    mo, T, mb, gb = MODELS[model]
    mb = int(os.environ.get("BENCH_MB", mb))  # BENCH_MB / BENCH_GB: another micro / global batch for this shape
    gb = int(os.environ.get("BENCH_GB", gb))
    mcfg = ModelConfig(**mo, seq_len=T, activation_checkpointing=ckpt)
    if layers is not None:
        mcfg = replace(mcfg, n_layers=layers)
    return Config(model=mcfg, seed=seed,
                  data=DataConfig(max_bytes=16_000_000),
                  train=TrainConfig(steps=1000, global_batch=global_batch or gb, micro_batch=mb, lr=3e-4,
                                    precision="bf16", compile=COMPILE if compile is None else compile),
                  det=DetConfig(tier=tier, batch_invariant=bi_mode),
                  dist=DistConfig(engine=engine, offload_partials=offload,  # BENCH_RESHARD=1/0: fsdp2 reshard
                                  reshard_after_forward={"1": True, "0": False}.get(os.environ.get("BENCH_RESHARD"),
                                                                                    "auto")),
                  log=LogConfig(wandb=WandbConfig(mode="disabled")))


DEVICE = "cuda:0"  # Trainer-driven and stock runs (a CPU smoke run of this script's logic may change it)
ATTENTION = "auto"  # --attention: auto (the trainer's choice), sdpa or triton (forced after the trainer is built)


def run_trainer(cfg, steps: int, warmup: int, fingerprints: bool = True, profile: str | None = None) -> dict:
    from dettrain import dist as D
    from dettrain.determinism import apply_tier, seed_process
    from dettrain.loop.trainer import Trainer
    from dettrain.sync.engines import Partials

    gc.collect()
    torch._dynamo.reset()  # each run traces afresh (tier settings are guarded globals; no recompile limit across runs)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()  # anything still held from an earlier run is not this run's memory
    apply_tier(cfg.det)
    seed_process(cfg.seed, 0)
    info = D.DistInfo(0, 1, 0, torch.device(DEVICE), None)
    with tempfile.TemporaryDirectory() as tmp:
        tr = Trainer(cfg, info, Path(tmp))
        if not fingerprints:  # bench-only: the engine reports zero partials instead of hashing
            tr.engine.partials = lambda keys, per_tensor: Partials(dict.fromkeys(keys, 0), {})
        if ATTENTION != "auto":
            attn.set_attention(ATTENTION == "triton")
        it = iter(tr.sampler)
        recs, times = [], []
        for i in range(warmup + steps):
            micro = next(it)
            if profile and i == warmup + steps - 3:
                prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA,
                                                          torch.profiler.ProfilerActivity.CPU])
                prof.__enter__()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            rec = tr.train_step(micro)
            torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            tr.step += 1
            recs.append({k: rec[k] for k in ("step", "loss_bits", "grad", "param", "opt")})
            if i == 0:
                first_s = dt  # compile (when train.compile is on) + the first step
            if i >= warmup:
                times.append(dt * 1e3)
        if profile:
            prof.__exit__(None, None, None)
            _report_profile(prof, profile, wall_ms=sum(times[-3:]))
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30
        n_params, engine = tr.n_params, tr.engine_name
        compiled = tr.compiled.header()
        tr.close()
        del tr
    gc.collect()
    torch.cuda.empty_cache()
    return {"ms": statistics.median(times), "held_before_GiB": base / 2**30, "ms_min": min(times), "peak_GiB": peak,
            "recs": recs, "n_params": n_params, "bi": bi.enabled(), "engine": engine, "first_s": first_s,
            "compile": compiled}


def _gap_report(prof, name: str) -> None:
    """Where the GPU sat idle: every gap between consecutive GPU operations, charged to the innermost
    ``dettrain.*`` range (loop/trainer.py's step phases) around the host call that launched the operation ending the
    gap."""
    import bisect

    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        ev = json.load(open(f.name))["traceEvents"]
    gpu = sorted((e for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e),
                 key=lambda e: e["ts"])
    launch = {e["args"]["correlation"]: e["ts"] for e in ev if e.get("cat") == "cuda_runtime" and
              "correlation" in e.get("args", {})}
    ranges = sorted(((e["ts"], e["ts"] + e["dur"], e["name"]) for e in ev if e.get("cat") == "user_annotation"
                     and e.get("name", "").startswith("dettrain.")), key=lambda r: r[0])
    starts = [r[0] for r in ranges]
    phase_host: dict[str, float] = {}
    for a, b, n in ranges:
        phase_host[n] = phase_host.get(n, 0.0) + (b - a) / 1e3
    idle: dict[str, float] = {}
    big = []
    for prev, nxt in zip(gpu, gpu[1:]):
        gap = nxt["ts"] - (prev["ts"] + prev["dur"])
        if gap <= 5:
            continue
        t = launch.get(nxt.get("args", {}).get("correlation"), nxt["ts"])
        i = bisect.bisect_right(starts, t) - 1
        where = "(outside dettrain ranges)"
        while i >= 0:
            a, b, n = ranges[i]
            if a <= t <= b:
                where = n
                break
            i -= 1
        idle[where] = idle.get(where, 0.0) + gap / 1e3
        big.append((gap / 1e3, where, nxt["name"][:60]))
    span = (gpu[-1]["ts"] + gpu[-1]["dur"] - gpu[0]["ts"]) / 1e3 if gpu else 0.0
    print(f"  -- GPU idle by step phase ({name}; {span:.1f} ms from first to last GPU op, "
          f"idle {sum(idle.values()):.1f} ms) --")
    for k, v in sorted(idle.items(), key=lambda kv: -kv[1]):
        print(f"  {v:9.2f} ms idle  {k}   (host time in range {phase_host.get(k, 0.0):.1f} ms)")
    print("  -- largest gaps --")
    for g, w, n in sorted(big, reverse=True)[:15]:
        print(f"  {g:8.3f} ms before {n}  [{w}]")


def _report_profile(prof, name: str, wall_ms: float) -> None:
    """Print where the last 3 steps' time went: GPU kernel time vs wall time (the gap is the GPU waiting on the
    host), the top kernels and the top host ops; the kernel table goes to $OUT/profile_<name>.json for diffing."""
    ev = prof.key_averages()
    dev = [(e.key, e.count, e.self_device_time_total / 1e3) for e in ev if e.self_device_time_total > 0]
    dev.sort(key=lambda r: -r[2])
    busy = sum(r[2] for r in dev)
    print(f"--- profile ({name}), last 3 steps: wall {wall_ms:.1f} ms, GPU kernels {busy:.1f} ms "
          f"({100 * busy / wall_ms:.1f} % busy) ---")
    for k, n, ms in dev[:45]:
        print(f"  {ms:9.2f} ms {n:7d}x  {k[:110]}")
    host = sorted(((e.key, e.count, e.cpu_time_total / 1e3) for e in ev if e.cpu_time_total > 0),
                  key=lambda r: -r[2])
    print("  -- host ops (cpu time total) --")
    for k, n, ms in host[:25]:
        print(f"  {ms:9.2f} ms {n:7d}x  {k[:110]}")
    out = os.environ.get("OUT")
    if os.environ.get("BENCH_TRACE") == "1":
        _gap_report(prof, name)
    if out:
        safe = "".join(c if c.isalnum() else "_" for c in name)
        Path(out, f"profile_{safe}.json").write_text(json.dumps({"wall_ms": wall_ms, "kernels": dev,
                                                                 "host": host[:200]}))


def cmd_hostprof(args) -> None:
    """cProfile of the host side of training steps (where the Python time of a step goes), per tier."""
    import cProfile
    import io
    import pstats

    from dettrain import dist as D
    from dettrain.determinism import apply_tier, seed_process
    from dettrain.loop.trainer import Trainer

    print(header())
    for tier in args.tiers:
        torch._dynamo.reset()
        cfg = make_cfg(args.model, tier, compile=True)
        apply_tier(cfg.det)
        seed_process(cfg.seed, 0)
        info = D.DistInfo(0, 1, 0, torch.device(DEVICE), None)
        with tempfile.TemporaryDirectory() as tmp:
            tr = Trainer(cfg, info, Path(tmp))
            it = iter(tr.sampler)
            for _ in range(3):
                tr.train_step(next(it))
                tr.step += 1
            torch.cuda.synchronize()
            prof = cProfile.Profile()
            for _ in range(2):
                micro = next(it)
                prof.enable()
                tr.train_step(micro)
                prof.disable()
                tr.step += 1
            for keys in (("param", "opt"), ("grad",)):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                tr.engine.partials(keys, False)
                print(f"tier {tier}: engine.partials{keys} alone: {1e3 * (time.perf_counter() - t0):.2f} ms")
            buf = io.StringIO()
            st = pstats.Stats(prof, stream=buf).sort_stats("tottime")
            st.print_stats(28)
            buf2 = io.StringIO()
            pstats.Stats(prof, stream=buf2).sort_stats("cumulative").print_stats(40)
            print(f"==== tier {tier}: 2 steps, by tottime\n" + "\n".join(buf.getvalue().splitlines()[:60]))
            print(f"==== tier {tier}: by cumulative\n" + "\n".join(buf2.getvalue().splitlines()[:75]))
            tr.close()
            del tr


def cmd_tiers(args) -> None:
    h = header()
    print(h)
    model = args.model
    results = []
    runs = [(t, e) for e in args.engines for t in args.tiers if not (e == "ddp" and t >= 3)]
    for tier, engine in runs:
        bi_modes = [None] if tier < 4 else ([None, False] if args.bi_both else [None])
        for bim in bi_modes:
            fps = [True, False] if not args.fp_on_only else [True]
            for fp in fps:
                cfg = make_cfg(model, tier, bi_mode=bim, engine=engine)
                prof = f"{model} tier {tier} {engine}" if (args.profile and fp and tier in args.profile) else None
                r = run_trainer(cfg, args.steps, args.warmup, fingerprints=fp, profile=prof)
                rerun = None
                if tier >= 2 and fp and not args.no_rerun:
                    r2 = run_trainer(make_cfg(model, tier, bi_mode=bim, engine=engine), args.steps, args.warmup,
                                     fingerprints=True)
                    rerun = r2["recs"] == r["recs"]
                    r["ms_rerun"] = r2["ms"]
                if tier == 0 and fp and not args.no_rerun:
                    r2 = run_trainer(make_cfg(model, tier, bi_mode=bim, engine=engine), args.steps, args.warmup,
                                     fingerprints=True)
                    rerun = r2["recs"] == r["recs"]
                    r["ms_rerun"] = r2["ms"]
                row = {"bench": "tiers", "model": model, "tier": tier, "engine": r["engine"], "fingerprints": fp,
                       "attention": "triton" if attn.attention_active(torch.empty(0, device="cuda")) else "sdpa",
                       "held_before_GiB": r["held_before_GiB"],
                       "batch_invariant": r["bi"], "ms": r["ms"], "ms_min": r["ms_min"],
                       "ms_rerun": r.get("ms_rerun"), "peak_GiB": r["peak_GiB"], "rerun_bitwise_equal": rerun,
                       "n_params": r["n_params"], "steps": args.steps, "warmup": args.warmup,
                       "first_loss_bits": r["recs"][0]["loss_bits"], **h}
                results.append(row)
                emit(row)
                again = f", rerun {r['ms_rerun']:.2f}" if "ms_rerun" in r else ""
                print(f"  tier {tier} {r['engine']:5} fp={fp!s:5} bi={r['bi']!s:5}: {r['ms']:8.2f} ms "
                      f"(min {r['ms_min']:.2f}{again})"
                      f" peak {r['peak_GiB']:.2f} GiB rerun-equal {rerun}", flush=True)
    base = next((r for r in results if r["tier"] == 0 and not r["fingerprints"]), None) or \
        next((r for r in results if r["tier"] == 0), None)
    print(f"\n{model}: {'tier':>4} {'engine':>6} {'fp':>5} {'bi':>5} {'ms/step':>9} {'vs t0':>7} {'peak GiB':>9} "
          f"{'vs t0':>7} "
          f"{'rerun==':>8}")
    for r in results:
        rel = f"{100 * (r['ms'] / base['ms'] - 1):+6.1f}%" if base else "-"
        relm = f"{100 * (r['peak_GiB'] / base['peak_GiB'] - 1):+6.1f}%" if base else "-"
        print(f"{'':6}{r['tier']:>4} {r['engine']:>6} {r['fingerprints']!s:>5} {r['batch_invariant']!s:>5} "
              f"{r['ms']:9.2f} {rel:>7} "
              f"{r['peak_GiB']:9.2f} {relm:>7} {r['rerun_bitwise_equal']!s:>8}")


def cmd_llm7b(args) -> None:
    h = header()
    print(h)
    out = []
    for ckpt in args.ckpt:
        for L in args.layers:
            cfg = make_cfg("7b", args.tier, layers=L, ckpt=bool(ckpt))
            try:
                r = run_trainer(cfg, args.steps, args.warmup, fingerprints=True)
            except torch.OutOfMemoryError as e:
                print(f"7b L={L} ckpt={ckpt}: out of memory ({str(e)[:100]})")
                torch.cuda.empty_cache()
                continue
            tok = cfg.train.global_batch * cfg.model.seq_len
            row = {"bench": "llm7b", "layers": L, "ckpt": bool(ckpt), "tier": args.tier, "ms": r["ms"],
                   "peak_GiB": r["peak_GiB"], "n_params": r["n_params"], "tokens_per_step": tok,
                   "tok_s": tok / (r["ms"] / 1e3), **h}
            out.append(row)
            emit(row)
            print(f"7b shape, {L} layers, ckpt={bool(ckpt)}: {r['ms']:.1f} ms/step ({tok} tokens), "
                  f"{row['tok_s']:.0f} tok/s, peak {r['peak_GiB']:.2f} GiB, {r['n_params'] / 1e9:.3f} B params")
    # per-layer slope between the two depths, extrapolated to 32 layers
    dim, ffn, V, T = 4096, 11008, 32000, 4096
    per_layer_params = 4 * dim * dim + 3 * dim * ffn + 2 * dim
    n32 = 32 * per_layer_params + 2 * V * dim + dim
    for ckpt in args.ckpt:
        rows = sorted((r for r in out if r["ckpt"] == bool(ckpt)), key=lambda r: r["layers"])
        if len(rows) < 2:
            continue
        a, b = rows[0], rows[-1]
        dL = b["layers"] - a["layers"]
        ms_l = (b["ms"] - a["ms"]) / dL
        mem_l = (b["peak_GiB"] - a["peak_GiB"]) / dL
        ms32 = a["ms"] + (32 - a["layers"]) * ms_l
        mem32 = a["peak_GiB"] + (32 - a["layers"]) * mem_l
        tok = a["tokens_per_step"]
        tok_s = tok / (ms32 / 1e3)
        flops_tok = 6 * n32 + 6 * 32 * T * dim  # + causal attention (12 L T d / 2)
        mfu_peak = flops_tok * tok_s / 989e12
        mfu_meas = flops_tok * tok_s / 790e12
        row = {"bench": "llm7b_extrap", "ckpt": bool(ckpt), "ms_per_layer": ms_l, "GiB_per_layer": mem_l,
               "ms_32": ms32, "peak_GiB_32": mem32, "tok_s_32": tok_s, "mfu_989": mfu_peak, "mfu_790": mfu_meas,
               "n_params_32": n32}
        emit(row)
        print(f"extrapolated 32 layers, ckpt={bool(ckpt)}: {ms_l:.1f} ms and {mem_l:.2f} GiB per layer -> "
              f"{ms32:.0f} ms/step, {tok_s:.0f} tok/s, MFU {100 * mfu_peak:.1f}% of 989 TF/s "
              f"({100 * mfu_meas:.1f}% of measured 790), peak {mem32:.1f} GiB on one GPU")


# ---- torch.compile at every tier (issue 14) ------------------------------------------------------------------------
def run_stock(cfg, steps: int, warmup: int, deterministic: bool) -> dict:
    """The same model and batch trained by hand, as a user would: ``torch.compile`` of model + loss (default
    options), bf16 autocast, left-fold gradient accumulation, torch's fused AdamW; ``deterministic``: torch's stock
    recipe (use_deterministic_algorithms, fill_uninitialized_memory off, TF32 off; CUBLAS_WORKSPACE_CONFIG is the
    process's).  No dettrain kernels, no canonical reducer, no fingerprints in the loop (one at the end)."""
    import torch.utils.deterministic

    from dettrain.models.llama import build_model
    from dettrain.record.fingerprint import fingerprint_many

    gc.collect()
    torch._dynamo.reset()
    bi.set_enabled(False)
    attn.set_attention(False)
    bi.set_loss_fn(None)
    torch.use_deterministic_algorithms(deterministic)  # also sets torch._inductor.config.deterministic (2.11, 2.13)
    torch.utils.deterministic.fill_uninitialized_memory = not deterministic
    torch.set_float32_matmul_precision("highest" if deterministic else "high")
    torch.backends.cudnn.allow_tf32 = not deterministic
    torch.backends.cudnn.benchmark = not deterministic
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, cfg.seed, DEVICE)
    V, T, mb = cfg.model.vocab_size, cfg.model.seq_len, cfg.train.micro_batch
    M = cfg.train.global_batch // mb

    def fwd_loss(x, y):
        with torch.autocast(torch.device(DEVICE).type, dtype=torch.bfloat16):
            logits = model(x)
        return F.cross_entropy(logits.float().reshape(-1, V), y.reshape(-1))

    step_fn = torch.compile(fwd_loss)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr, fused=True)
    gen = torch.Generator().manual_seed(1234)
    data = [torch.randint(0, V, (M, mb, T + 1), generator=gen) for _ in range(warmup + steps)]
    losses, times, first_s = [], [], 0.0
    profile = os.environ.get("BENCH_PROFILE_STOCK") == "1"
    for i, batch in enumerate(data):
        batch = batch.to(DEVICE, non_blocking=True)
        if profile and i == len(data) - 3:
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA,
                                                      torch.profiler.ProfilerActivity.CPU])
            prof.__enter__()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        total = 0.0
        for k in range(M):
            loss = step_fn(batch[k, :, :-1], batch[k, :, 1:]) / M
            loss.backward()
            total = total + loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        losses.append(float(total))
        if i == 0:
            first_s = dt
        if i >= warmup:
            times.append(dt * 1e3)
    if profile:
        prof.__exit__(None, None, None)
        _report_profile(prof, "stock-det" if deterministic else "stock-fast", wall_ms=sum(times[-3:]))
    params = fingerprint_many([(p.detach().reshape(-1), 0) for p in model.parameters()])
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    n_params = sum(p.numel() for p in model.parameters())
    torch.use_deterministic_algorithms(False)
    gc.collect()
    torch.cuda.empty_cache()
    return {"ms": statistics.median(times), "ms_min": min(times), "peak_GiB": peak, "first_s": first_s,
            "recs": {"losses": losses, "params": params}, "n_params": n_params, "bi": False}


def _compile_variant(model: str, name: str, tier: int | None, bim: bool | None, args) -> dict:
    if tier is None:
        return run_stock(make_cfg(model, 0), args.steps, args.warmup, name == "stock-det")
    engine = "fsdp2" if name.endswith("-fsdp2") else "auto"
    return run_trainer(make_cfg(model, tier, bi_mode=bim, compile=name != "tier0-eager", engine=engine,
                                offload=name.endswith("-offload")), args.steps, args.warmup)


def cmd_compile(args) -> None:
    """tokens/s of every tier compiled against dettrain's compiled tier 0 (the baseline) and torch's stock
    deterministic recipe, per model, in one process; compile time and rerun equality for each."""
    h = header()
    print(h, flush=True)
    out_dir = Path(args.out or os.environ.get("OUT") or ".")
    out_dir.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    for model in args.models:
        tok = MODELS[model][3] * MODELS[model][1]  # global batch x seq_len
        variants: list[tuple[str, int | None, bool | None]] = []  # (name, tier or None = stock, batch-invariant)
        recs: dict[str, dict] = {}  # each variant's first run's losses and parameters
        for v in args.variants:
            if v.startswith("tier"):
                t = int(v[4])
                if t == 4 and args.bi_both:
                    variants += [("tier4 bi=on", 4, True), ("tier4 bi=off", 4, False)]
                else:
                    variants.append((v, t, None))
            else:
                variants.append((v, None, None))
        for name, tier, bim in variants:
            stock = tier is None
            rerun_wanted = not args.no_rerun and (stock and name == "stock-det" or (tier or 0) >= 2)
            try:
                r = _compile_variant(model, name, tier, bim, args)
                rerun, r2 = None, None
                if rerun_wanted:
                    r2 = _compile_variant(model, name, tier, bim, args)
                    rerun = r2["recs"] == r["recs"]
                # a variant that must not move a bit (-offload: dist.offload_partials) against its plain form
                base = name.removesuffix("-offload")
                if base != name and base in recs:
                    same = r["recs"] == recs[base]
                    print(f"{model} {name}: losses and parameters == {base}'s: {same}", flush=True)
                recs.setdefault(name, r["recs"])
            except Exception as e:  # noqa: BLE001 - one failed variant must not end the session
                print(f"{model} {name}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
                rows.append({"bench": "compile", "model": model, "variant": name, "error": f"{type(e).__name__}: "
                             f"{str(e)[:300]}", **h})
                emit(rows[-1])
                torch._dynamo.reset()
                gc.collect()
                torch.cuda.empty_cache()
                continue
            row = {"bench": "compile", "model": model, "variant": name, "tier": tier, "batch_invariant": r["bi"],
                   "equals_" + base: same if base != name and base in recs else None,
                   "ms": r["ms"], "ms_min": r["ms_min"], "tok_s": tok / (r["ms"] / 1e3), "tokens_per_step": tok,
                   "first_step_s": r["first_s"], "first_step_s_rerun": None if r2 is None else r2["first_s"],
                   "ms_rerun": None if r2 is None else r2["ms"], "peak_GiB": r["peak_GiB"],
                   "rerun_bitwise_equal": rerun, "n_params": r["n_params"], "steps": args.steps,
                   "warmup": args.warmup, "compile": r.get("compile"), **h}
            rows.append(row)
            emit(row)
            _write_compile_bench(out_dir, h, rows, args.models)  # after every variant: a timeout keeps what ran
            print(f"{model} {name}: {r['ms']:.1f} ms/step, {row['tok_s']:,.0f} tok/s, compile+first step "
                  f"{r['first_s']:.1f} s, peak {r['peak_GiB']:.2f} GiB, rerun== {rerun}", flush=True)
    table = _write_compile_bench(out_dir, h, rows, args.models)
    print("\n" + table)
    print("\ngoals (issue 14): tier 2 and 3 >= 0.97x, tier 4 >= 0.95x of tier0 compiled; tier 3 faster than "
          "stock-det")
    print(f"wrote {out_dir / 'compile_bench.json'} and {out_dir / 'compile_bench.md'}")


def _write_compile_bench(out_dir: Path, h: dict, rows: list[dict], models: list[str]) -> str:
    """The markdown table (tokens/s as a ratio to dettrain's compiled tier 0 of the same model, same process) and
    the JSON of every row, written under ``out_dir``; returns the table."""
    lines = ["| model | variant | ms/step | tokens/s | vs tier0 compiled | compile+first step s (rerun) | peak GiB | "
             "rerun == |", "|---|---|---|---|---|---|---|---|"]
    for model in models:
        base = next((r for r in rows if r["model"] == model and r["variant"] == "tier0" and "error" not in r), None)
        for r in (r for r in rows if r["model"] == model):
            if "error" in r:
                lines.append(f"| {model} | {r['variant']} | failed: {r['error'][:80]} | | | | | |")
                continue
            rel = f"{r['tok_s'] / base['tok_s']:.3f}x" if base else "-"
            again = f" ({r['first_step_s_rerun']:.1f})" if r["first_step_s_rerun"] is not None else ""
            lines.append(f"| {model} | {r['variant']} | {r['ms']:.1f} | {r['tok_s']:,.0f} | {rel} | "
                         f"{r['first_step_s']:.1f}{again} | {r['peak_GiB']:.2f} | {r['rerun_bitwise_equal']} |")
    table = "\n".join(lines)
    (out_dir / "compile_bench.json").write_text(json.dumps({"header": h, "rows": rows, "table": table}, indent=1,
                                                           default=str))
    (out_dir / "compile_bench.md").write_text(table + "\n")
    return table


def main() -> None:
    global OUT_JSON
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, default=None)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("fp")
    p.add_argument("--sweep", action="store_true")
    p = sub.add_parser("ops")
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--parts", default="attn,mm,norm", help="comma-separated: attn, mm, norm")
    sub.add_parser("invariance")
    p = sub.add_parser("rowsum", help="the canonical reduce-scatter's row sum: torch tree vs kernels/rowsum.py")
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8, 16])
    p = sub.add_parser("attn-det", help="cuDNN's deterministic behaviour and dettrain's attention backward kernels")
    p.add_argument("--shapes", nargs="+", default=list(ATTN_SHAPES), choices=list(ATTN_SHAPES))
    p.add_argument("--reps", type=int, default=5)
    p = sub.add_parser("attn-cmp", help="attention backward: cuDNN vs dettrain's two-pass vs the default, interleaved")
    p.add_argument("--shapes", nargs="+", default=list(ATTN_SHAPES), choices=list(ATTN_SHAPES))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--extra", nargs="*", default=[], help='more variants: "dkdv:64,128,8,3", "dq:...", '
                   '"dkdv:...+dq:...", "ds", "nods", "split:4", "cap:2"')
    p = sub.add_parser("attn-cudnn-fwd", help="cuDNN's attention forward with dettrain's backward: bits, error, time")
    p.add_argument("--shapes", nargs="+", default=list(ATTN_SHAPES), choices=list(ATTN_SHAPES))
    p.add_argument("--reps", type=int, default=10)
    for name in ("attn-sweep", "attn-bwd-sweep"):
        p = sub.add_parser(name)
        p.add_argument("--shapes", nargs="+", default=["125m", "1b", "7b"], choices=["125m", "1b", "7b"])
    p = sub.add_parser("hostprof")
    p.add_argument("--model", default="125m", choices=sorted(MODELS))
    p.add_argument("--tiers", type=int, nargs="+", default=[0, 3])
    p = sub.add_parser("tiers")
    p.add_argument("--model", default="125m", choices=sorted(MODELS))
    p.add_argument("--tiers", type=int, nargs="+", default=[0, 2, 3, 4])
    p.add_argument("--engines", nargs="+", default=["auto"],
                   help="auto ddp flat fsdp2 (ddp skipped at tiers >= 3)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--fp-on-only", action="store_true")
    p.add_argument("--no-rerun", action="store_true")
    p.add_argument("--bi-both", action="store_true", help="tier 4 with batch-invariant kernels on and off")
    p.add_argument("--profile", type=int, nargs="*", default=[], help="tiers to profile (last 3 steps)")
    p.add_argument("--attention", choices=["auto", "sdpa", "triton"], default="auto",
                   help="attention without batch-invariant mode (auto: the trainer's choice, triton at tier >= 2)")
    p.add_argument("--compile", choices=["auto", "true", "false"], default="auto",
                   help="train.compile (auto: the trainer's default, on for CUDA)")
    p = sub.add_parser("compile", help="every tier compiled vs tier 0 compiled and stock deterministic compile")
    p.add_argument("--models", nargs="+", default=["125m", "1b"], choices=sorted(MODELS))
    p.add_argument("--variants", nargs="+", default=["tier0", "tier2", "tier3", "tier4", "stock-fast", "stock-det"],
                   choices=["tier0", "tier0-eager", "tier2", "tier3", "tier4", "tier3-fsdp2", "tier4-fsdp2",
                            "tier4-offload",
                            "stock-fast", "stock-det"],
                   help="tierN: dettrain's Trainer at det.tier=N with train.compile=true and fingerprints on "
                        "(-fsdp2: dist.engine=fsdp2, else the default engine); a name given twice runs twice, "
                        "in the order given (interleaved repeats); "
                        "tier0-eager: tier 0 uncompiled; stock-fast / stock-det: torch.compile of the same model by "
                        "hand, fast or with torch's deterministic recipe")
    p.add_argument("--bi-both", action="store_true", help="tier 4 with det.batch_invariant on and off")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--no-rerun", action="store_true", help="skip the second run of tiers >= 2 and stock-det")
    p.add_argument("--out", default=None, help="directory for compile_bench.json/.md (default $OUT, else .)")
    p = sub.add_parser("llm7b")
    p.add_argument("--layers", type=int, nargs="+", default=[2, 4])
    p.add_argument("--ckpt", type=int, nargs="+", default=[1, 0])
    p.add_argument("--tier", type=int, default=3)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--compile", choices=["auto", "true", "false"], default="auto",
                   help="train.compile (auto: the trainer's default, on for CUDA)")
    args = ap.parse_args()
    OUT_JSON = args.json
    global ATTENTION, COMPILE
    ATTENTION = getattr(args, "attention", "auto")
    COMPILE = {"true": True, "false": False}.get(getattr(args, "compile", "auto"), "auto")
    cmds = {"fp": cmd_fp, "ops": cmd_ops, "invariance": cmd_invariance, "attn-sweep": cmd_attn_sweep,
            "attn-bwd-sweep": cmd_attn_bwd_sweep,
            "attn-det": cmd_attn_det, "attn-cmp": cmd_attn_cmp,
            "attn-cudnn-fwd": cmd_attn_cudnn_fwd, "hostprof": cmd_hostprof, "rowsum": cmd_rowsum,
            "tiers": cmd_tiers, "llm7b": cmd_llm7b, "compile": cmd_compile}
    cmds[args.cmd](args)


if __name__ == "__main__":
    main()
