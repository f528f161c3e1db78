"""Hugging Face models on the GPU with det.attention (issue 22): BENCHMARKS.md's "Hugging Face models" section.

    python bench/bench_hf.py attn     attention implementations at the HF model shapes: dettrain's kernel (through
                                      transformers' attention interface, as HF models call it), torch's SDPA under
                                      use_deterministic_algorithms, cuDNN and flash (non-deterministic); forward and
                                      forward + backward ms, and whether two reruns give the same bits
    python bench/bench_hf.py models   HF LlamaForCausalLM at the 125m shape (12 x 768, T 1024, 4 x 32 sequences per
                                      step) through dettrain's Trainer, compiled, at tiers 0 / 3 / 4, against the same
                                      model compiled by hand (stock-fast, stock-det: torch's deterministic recipe)

Both print a table and, with --json PATH, append one JSON line per measurement.  Trainer runs and stock runs come
from bench_gpu.py (``run_trainer``: world 1, CUDA-event-free wall time around ``train_step`` with a synchronize;
``run_stock``); tokens/s = 128 x 1024 tokens per step / the median step time.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import bench_gpu as G  # noqa: E402

from dettrain.kernels import attention as kernel  # noqa: E402
from dettrain.models import attention as route  # noqa: E402

SHAPES = {
    # name: (B, H, HKV, T, D): the micro-batch shapes of HF configs
    "llama-125m d64": (32, 12, 12, 1024, 64),
    "llama-1b gqa d64": (4, 32, 4, 2048, 64),
    "qwen2/mistral-like gqa d128": (4, 32, 8, 2048, 128),
    "7b d128": (1, 32, 32, 4096, 128),
    "d80 (padded to 128)": (16, 16, 16, 1024, 80),
    "d96 (padded to 128)": (16, 16, 16, 1024, 96),
}


class _Module(torch.nn.Module):
    """What transformers' attention interface reads from the attention module."""

    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True


def cmd_attn(args) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    h = G.header()
    print(h)
    route.register_hf()
    torch.backends.cuda.matmul.allow_tf32 = False
    rows = []
    print(f"{'shape':30} {'variant':26} {'fwd ms':>8} {'f+b ms':>8} {'bits stable':>11}")
    for name, (B, H, HKV, T, D) in SHAPES.items():
        q, k, v = (torch.randn(B, n, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for n in (H, HKV, HKV))
        do = torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16)  # HF's output layout (B, T, H, D)
        mod = _Module(H // HKV)

        def ours(q=q, k=k, v=v, mod=mod, D=D):
            return route.hf_attention(mod, q, k, v, None, scaling=D ** -0.5)[0]

        def torch_sdpa(q=q, k=k, v=v, mod=mod, D=D):  # transformers' own sdpa path, as HF models call it
            return route._HF_FALLBACK["attention"](mod, q, k, v, None, scaling=D ** -0.5)[0]

        variants = {"dettrain kernel": (ours, None, False, "cuda"),
                    "torch SDPA deterministic": (torch_sdpa, None, True, "off"),
                    "torch SDPA default": (torch_sdpa, None, False, "off"),
                    "cuDNN (non-deterministic)": (torch_sdpa, SDPBackend.CUDNN_ATTENTION, False, "off"),
                    "flash (non-deterministic)": (torch_sdpa, SDPBackend.FLASH_ATTENTION, False, "off")}
        for vname, (fn, backend, det, mode) in variants.items():
            try:
                kernel.set_attention(mode)
                torch.use_deterministic_algorithms(det)
                ctx = sdpa_kernel([backend]) if backend is not None else G._null()
                with ctx:
                    tf = G.bench_ms(lambda fn=fn: fn())

                    def fb(fn=fn, ins=(q, k, v), do=do):
                        return torch.autograd.grad(fn(), ins, do)

                    tfb = G.bench_ms(fb)
                    runs = [[t.clone() for t in (fn().detach(), *fb())] for _ in range(3)]
                stable = all(torch.equal(a, b) for r in runs[1:] for a, b in zip(runs[0], r))
                row = {"bench": "hf_attn", "shape": name, "B,H,HKV,T,D": (B, H, HKV, T, D), "variant": vname,
                       "fwd_ms": tf, "fwdbwd_ms": tfb, "bits_stable_3_runs": stable, **h}
                print(f"{name:30} {vname:26} {tf:8.3f} {tfb:8.3f} {stable!s:>11}", flush=True)
            except Exception as e:  # noqa: BLE001 - a refused backend is a row too
                row = {"bench": "hf_attn", "shape": name, "variant": vname, "error": f"{type(e).__name__}: "
                       f"{str(e)[:160]}", **h}
                print(f"{name:30} {vname:26} refused: {type(e).__name__}: {str(e)[:90]}", flush=True)
            finally:
                torch.use_deterministic_algorithms(False)
                kernel.set_attention("off")
            rows.append(row)
            G.emit(row)
        # the kernel against a float64 reference (the padded sizes included)
        kernel.set_attention("cuda")
        o = ours()
        ref = route.reference_attention(q.detach(), k.detach(), v.detach())
        err = float((o.transpose(1, 2).double() - ref).norm() / ref.norm())
        kernel.set_attention("off")
        print(f"  {name}: kernel rel. error vs float64 {err:.2e}")
        G.emit({"bench": "hf_attn_check", "shape": name, "rel_err_fp64": err})
        del q, k, v, do, o, ref
        torch.cuda.empty_cache()
    _table(rows, Path(args.out) / "hf_attn.md")


def _table(rows: list[dict], path: Path) -> None:
    lines = ["| shape (B, H, HKV, T, D) | implementation | fwd ms | fwd+bwd ms | bits stable (3 runs) |",
             "|---|---|---|---|---|"]
    for r in rows:
        shape = f"{r['shape']} {tuple(r['B,H,HKV,T,D'])}" if "B,H,HKV,T,D" in r else r["shape"]
        if "error" in r:
            lines.append(f"| {shape} | {r['variant']} | refused: {r['error'][:70]} | | |")
        else:
            lines.append(f"| {shape} | {r['variant']} | {r['fwd_ms']:.3f} | {r['fwdbwd_ms']:.3f} | "
                         f"{r['bits_stable_3_runs']} |")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    print("\n" + "\n".join(lines))


# model shapes of ``models --shape``: HF config keys, seq_len, global batch, micro-batch (the dettrain presets' shapes)
MODEL_SHAPES = {
    "125m": ({"hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 12, "num_attention_heads": 12,
              "num_key_value_heads": 12}, 1024, 128, 32),
    "1b": ({"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22, "num_attention_heads": 32,
            "num_key_value_heads": 4}, 2048, 16, 4),
}


def hf_cfg(tier: int, *, attn_implementation: str | None = None, model_type: str = "llama", shape: str = "125m"):
    """The issue's HF Llama shapes as a dettrain Config (model=hf_llama with the 125m or 1b keys), compiled."""
    from dettrain.config import Config, LogConfig, TrainConfig, WandbConfig
    from dettrain.data import DataConfig
    from dettrain.determinism import DetConfig
    from dettrain.models.custom import CustomModelConfig

    keys, seq_len, global_batch, micro_batch = MODEL_SHAPES[shape]
    kw = {"model_type": model_type, "attn_implementation": attn_implementation, **keys,
          "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
    model = CustomModelConfig(_target_="dettrain.models.hf.from_config", name="hf_llama", vocab_size=32000,
                              seq_len=seq_len, kwargs=kw)
    return Config(model=model, seed=0, data=DataConfig(max_bytes=16_000_000),
                  train=TrainConfig(steps=1000, global_batch=global_batch, micro_batch=micro_batch, lr=3e-4,
                                    precision="bf16", compile=True),
                  det=DetConfig(tier=tier), log=LogConfig(wandb=WandbConfig(mode="disabled")))


def cmd_models(args) -> None:
    h = G.header()
    print(h, flush=True)
    _, seq_len, global_batch, _ = MODEL_SHAPES[args.shape]
    tok = global_batch * seq_len
    rows: list[dict] = []
    for name in args.variants:
        try:
            if name.startswith("tier"):
                tier = int(name[4])
                r = G.run_trainer(hf_cfg(tier, shape=args.shape), args.steps, args.warmup)
                r2 = (G.run_trainer(hf_cfg(tier, shape=args.shape), args.steps, args.warmup)
                      if tier >= 2 and args.rerun else None)
            else:
                route.uninstall()  # torch's own SDPA, as a user's script has it
                det = name == "stock-det"
                r = G.run_stock(hf_cfg(0, attn_implementation="sdpa", shape=args.shape), args.steps, args.warmup, det)
                r2 = (G.run_stock(hf_cfg(0, attn_implementation="sdpa", shape=args.shape), args.steps, args.warmup, det)
                      if det and args.rerun else None)
        except Exception as e:  # noqa: BLE001 - one failed variant must not end the session
            print(f"{name}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
            rows.append({"bench": "hf_models", "variant": name, "error": f"{type(e).__name__}: {str(e)[:300]}"})
            torch._dynamo.reset()
            continue
        row = {"bench": "hf_models", "shape": args.shape, "variant": name, "ms": r["ms"],
               "tok_s": tok / (r["ms"] / 1e3),
               "first_step_s": r["first_s"], "peak_GiB": r["peak_GiB"],
               "rerun_bitwise_equal": None if r2 is None else r2["recs"] == r["recs"],
               "ms_rerun": None if r2 is None else r2["ms"], "steps": args.steps, "warmup": args.warmup, **h}
        rows.append(row)
        G.emit(row)
        print(f"{name}: {r['ms']:.1f} ms/step, {row['tok_s']:,.0f} tok/s, first step {r['first_s']:.1f} s, peak "
              f"{r['peak_GiB']:.2f} GiB, rerun== {row['rerun_bitwise_equal']}", flush=True)
    base = next((r for r in rows if r["variant"] == "tier0" and "error" not in r), None)
    stock = next((r for r in rows if r["variant"] == "stock-det" and "error" not in r), None)
    lines = ["| variant | ms/step | tokens/s | vs tier 0 | vs stock-det | peak GiB | rerun == |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['variant']} | failed: {r['error'][:80]} | | | | | |")
            continue
        rel = f"{r['tok_s'] / base['tok_s']:.3f}x" if base else "-"
        rs = f"{r['tok_s'] / stock['tok_s']:.3f}x" if stock else "-"
        lines.append(f"| {r['variant']} | {r['ms']:.1f} | {r['tok_s']:,.0f} | {rel} | {rs} | {r['peak_GiB']:.2f} | "
                     f"{r['rerun_bitwise_equal']} |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"hf_models_{args.shape}.md").write_text("\n".join(lines) + "\n")
    (out / f"hf_models_{args.shape}.json").write_text(json.dumps(rows, indent=1, default=str))
    print("\n" + "\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--out", default=".", help="directory for the markdown tables")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("attn")
    p = sub.add_parser("models")
    p.add_argument("--variants", nargs="+", default=["tier0", "tier3", "tier4", "stock-det", "stock-fast"],
                   choices=["tier0", "tier2", "tier3", "tier4", "stock-det", "stock-fast"])
    p.add_argument("--shape", choices=sorted(MODEL_SHAPES), default="125m")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rerun", action="store_true", help="run tiers >= 2 and stock-det twice, compare the bits")
    args = ap.parse_args()
    G.OUT_JSON = args.json
    {"attn": cmd_attn, "models": cmd_models}[args.cmd](args)


if __name__ == "__main__":
    main()
