"""Generation speed on one GPU: dettrain.generate (training-equal logits) beside Hugging Face ``generate`` with a
static cache and torch.compile, the alternative a user would pick (docs/generate.md).

    python bench/bench_generate.py [--model 1b] [--prompt 128] [--new 128] [--batches 1,8,64] [--json PATH]

For each batch size: decode tokens/s (new tokens of the whole batch / the decode time) and prefill tokens/s
(prompt tokens / the prefill time) of ``dettrain.generate.generate`` as a user calls it, with det.batch_invariant on
under bf16 autocast (fp32 weights, as the trainer keeps them), with its decode CUDA graphs and without; the
same for ``LlamaForCausalLM.generate(cache_implementation="static")``, whose decode forward ``generate`` compiles
itself (its CompileConfig, ``mode="reduce-overhead"``), at the same shape, random weights, greedy, no end-of-text;
and the training forward's tokens/s at the prompt's shape, eager and with each block compiled as the trainer
runs it (prefill's target: the faster of the two).  Weights are random: speed does not
depend on them.  Prints a table; ``--json`` appends one JSON line per row.  Runs unattended (no prompts, no downloads).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dettrain.config import model_config  # noqa: E402


def _preset(name: str):
    import yaml

    node = yaml.safe_load((Path(__file__).resolve().parent.parent / "conf" / "model" / f"{name}.yaml").read_text())
    return model_config({k: v for k, v in node.items() if k != "defaults"})


def _timed(fn) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t


def _generate_times(model, prompts: list[list[int]], new: int, **kw) -> tuple[float, float]:
    """(prefill s, decode s) of ``dettrain.generate.generate`` as a user calls it, greedy, no end-of-text: prefill is
    the best of three calls with one new token (the prompt's forward and the first pick), decode is a call with
    ``new`` tokens less that."""
    from dettrain.generate import generate

    pre = min(_timed(lambda: generate(model, prompts, max_new_tokens=1, **kw)) for _ in range(3))
    total = _timed(lambda: generate(model, prompts, max_new_tokens=new, **kw))
    return pre, max(total - pre, 1e-9)


def bench_dettrain(cfg, B: int, prompt: int, new: int) -> dict:
    from dettrain.kernels import batch_invariant as bi
    from dettrain.models.llama import build_model

    bi.set_enabled(True)
    model = build_model(cfg, 0, "cuda").eval()
    prompts = torch.randint(0, cfg.vocab_size, (B, prompt)).tolist()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        # warm-up: the very calls timed below.  Triton specializes a kernel on its integer arguments (a cache of
        # 256 slots, a multiple of 16, is another compile than one of 132): a shorter warm-up left a compile inside
        # the first batch's timed decode (batch 1 read 0.26-0.44x of HF before this, 2026-12-05)
        _generate_times(model, prompts, new)
        prefill_s, decode_s = _generate_times(model, prompts, new)
        eager_s, _ = _generate_times(model, prompts, 4, cuda_graphs=False)
        _, eager_decode_s = _generate_times(model, prompts, new, cuda_graphs=False)
        # the training forward at the prompt's shape, eager and compiled as the trainer runs it (each block): what
        # prefill should approach
        toks = torch.tensor(prompts, device="cuda")
        with torch.no_grad():
            model(toks)
            fwd = min(_timed(lambda: model(toks)) for _ in range(3))
            for blk in model.layers:
                blk.compile()
            model(toks)
            fwd_c = min(_timed(lambda: model(toks)) for _ in range(3))
    bi.set_enabled(False)
    return {"prefill_tok_s": B * prompt / prefill_s, "decode_tok_s": B * (new - 1) / decode_s,
            "decode_eager_tok_s": B * (new - 1) / eager_decode_s, "train_fwd_tok_s": B * prompt / fwd,
            "train_fwd_compiled_tok_s": B * prompt / fwd_c}


def bench_hf(cfg, B: int, prompt: int, new: int) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    hc = LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.dim, intermediate_size=cfg.ffn_dim,
                     num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
                     num_key_value_heads=cfg.n_kv_heads or cfg.n_heads, max_position_embeddings=cfg.seq_len,
                     rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta)
    model = LlamaForCausalLM(hc).to("cuda", torch.bfloat16).eval()
    ids = torch.randint(0, cfg.vocab_size, (B, prompt), device="cuda")
    # generate() compiles the decode forward itself with a static cache (CompileConfig: reduce-overhead), and marks
    # each CUDA-graph step; compiling model.forward by hand as well made its graph outputs be overwritten
    kw = {"do_sample": False, "cache_implementation": "static", "pad_token_id": 0, "eos_token_id": None}
    with torch.no_grad():
        for _ in range(2):  # compile and warm up the static-cache graphs
            model.generate(ids, max_new_tokens=new, min_new_tokens=new, **kw)
        pre = min(_timed(lambda: model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)) for _ in range(3))
        total = _timed(lambda: model.generate(ids, max_new_tokens=new, min_new_tokens=new, **kw))
    return {"prefill_tok_s": B * prompt / pre, "decode_tok_s": B * (new - 1) / max(total - pre, 1e-9)}


# Tiles a decode step might use at few rows; the training tile first.  At M = 1 each program's loop over K is a chain
# of dependent loads, so a matmul takes about one program's time, and the weights stream at (programs) x (bytes of
# B a program has in flight) / (load latency): a narrower N tile alone changes nothing (4x the programs, 1/4 of the
# bytes each); what it buys is shared memory for a deeper pipeline (num_stages) or a longer BK.  Whether a tile
# keeps the training tile's bits (the same tensor-core steps over K into one accumulator) is what --mm-sweep checks.
MM_CANDIDATES = {
    "train": None,
    "64x64": {"BM": 64, "BN": 64, "BK": 64, "GROUP_M": 8, "num_warps": 4, "num_stages": 4},
    "64x32": {"BM": 64, "BN": 32, "BK": 64, "GROUP_M": 8, "num_warps": 4, "num_stages": 4},
    "64x32s8": {"BM": 64, "BN": 32, "BK": 64, "GROUP_M": 8, "num_warps": 4, "num_stages": 8},
    "64x16s12": {"BM": 64, "BN": 16, "BK": 64, "GROUP_M": 8, "num_warps": 4, "num_stages": 12},
    "64x32k128s6": {"BM": 64, "BN": 32, "BK": 128, "GROUP_M": 8, "num_warps": 4, "num_stages": 6},
    "128x64s6": {"BM": 128, "BN": 64, "BK": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 6},
    "16x32": {"BM": 16, "BN": 32, "BK": 64, "GROUP_M": 8, "num_warps": 2, "num_stages": 4},
    "16x32s8": {"BM": 16, "BN": 32, "BK": 64, "GROUP_M": 8, "num_warps": 2, "num_stages": 8},
    "16x16s8": {"BM": 16, "BN": 16, "BK": 64, "GROUP_M": 8, "num_warps": 2, "num_stages": 8},
    "16x64s6": {"BM": 16, "BN": 64, "BK": 64, "GROUP_M": 8, "num_warps": 4, "num_stages": 6},
    "16x32k128s6": {"BM": 16, "BN": 32, "BK": 128, "GROUP_M": 8, "num_warps": 4, "num_stages": 6},
    "32x32s6": {"BM": 32, "BN": 32, "BK": 64, "GROUP_M": 8, "num_warps": 4, "num_stages": 6},
}


def _graph_us(fn, calls: int = 20, reps: int = 7) -> float:
    """Device time of one ``fn()`` in microseconds: ``calls`` of it captured in one CUDA graph, the replay timed by
    CUDA events (median of ``reps``), so the host's launch work (which decode's own graph removes) is not counted."""
    fn()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) * 1000 / calls)
    return sorted(ts)[reps // 2]


def mm_sweep(cfg, out: Path | None = None) -> str:
    """bi.mm at the model's (K, N) shapes and 1, 8, 64 rows under each tile of ``MM_CANDIDATES``: whether every
    output bit equals the training tile's, and the device time (a CUDA graph of 20 calls, as decode replays them).
    Returns (and writes to ``out``) the name of the tile with the least time for a decode step at one row
    (``n_layers`` x the block's seven projections, plus the head) among those whose bits all equal the training
    tile's."""
    from dettrain.kernels import batch_invariant as bi

    kv = (cfg.n_kv_heads or cfg.n_heads) * (cfg.dim // cfg.n_heads)
    shapes = {"wq/wo": (cfg.dim, cfg.dim, 2), "wk/wv": (cfg.dim, kv, 2), "w1/w3": (cfg.dim, cfg.ffn_dim, 2),
              "w2": (cfg.ffn_dim, cfg.dim, 1), "head": (cfg.dim, cfg.vocab_size, 0)}
    g = torch.Generator(device="cuda").manual_seed(0)
    names = list(MM_CANDIDATES)
    equal = dict.fromkeys(names, True)
    step_us = {(n, M): 0.0 for n in names for M in (1, 8, 64)}
    head = " ".join(f"{n:>12}" for n in names)
    print(f"{'shape':>6} {'M':>3} {head}   (us on the device; = same bits as train)")
    for name, (K, N, per_layer) in shapes.items():
        w = torch.randn(N, K, device="cuda", generator=g).to(torch.bfloat16)
        times = per_layer * cfg.n_layers if per_layer else 1
        for M in (1, 8, 64):
            x = torch.randn(M, K, device="cuda", generator=g).to(torch.bfloat16)
            ref, cells = None, []
            for cand_name, cand in MM_CANDIDATES.items():
                bi.MM_CONFIG_OVERRIDE = cand
                try:
                    out_ = bi.mm(x, w.t())
                    if ref is None:
                        ref = out_
                    same = torch.equal(out_, ref)
                    us = _graph_us(lambda x=x, w=w: bi.mm(x, w.t()))
                    equal[cand_name] &= same
                    step_us[cand_name, M] += times * us
                    cells.append(f"{us:>10.1f} {'=' if same else 'X'}")
                except Exception as e:  # a tile Triton cannot compile here
                    equal[cand_name] = False
                    cells.append(f"{type(e).__name__[:12]:>12}")
                finally:
                    bi.MM_CONFIG_OVERRIDE = None
            print(f"{name:>6} {M:>3} " + " ".join(cells), flush=True)
    print(f"{'step':>6} {'M':>3} (the {cfg.n_layers} layers' projections and the head, us)")
    for M in (1, 8, 64):
        print(f"{'step':>6} {M:>3} " + " ".join(f"{step_us[n, M]:>10.0f} {'=' if equal[n] else 'X'}" for n in names))
    best = min((n for n in names if equal[n]), key=lambda n: step_us[n, 1])
    print(f"fastest same-bits tile at one row: {best} ({step_us[best, 1]:.0f} us a step against the training tile's "
          f"{step_us['train', 1]:.0f}; at 8 rows {step_us[best, 8]:.0f} vs {step_us['train', 8]:.0f}, at 64 "
          f"{step_us[best, 64]:.0f} vs {step_us['train', 64]:.0f})")
    if out is not None:
        out.write_text(best + "\n")
    return best


def profile(cfg, B: int, prompt: int, new: int, trace_dir: Path | None = None) -> None:
    """torch.profiler over one ``generate`` call (greedy, ``new`` tokens): the top ops by device and by host time."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    from dettrain.generate import generate
    from dettrain.generate.llama import LlamaStepper
    from dettrain.kernels import batch_invariant as bi
    from dettrain.models.llama import build_model

    bi.set_enabled(True)
    model = build_model(cfg, 0, "cuda").eval()
    prompts = torch.randint(0, cfg.vocab_size, (B, prompt)).tolist()
    with torch.autocast("cuda", dtype=torch.bfloat16), torch.no_grad():
        generate(model, prompts, max_new_tokens=new)
        # the decode step's graph alone: its device time (events around back-to-back replays) against the host
        # time it takes to launch the same replays
        st = LlamaStepper(model, exact=True)
        cache = st.start(prompts, prompt + new + 8)
        last = st.prefill(cache, prompts, None)
        pos = torch.full((B,), prompt, device="cuda")
        st.decode(cache, last.argmax(-1), pos, prompt + 1)
        st.decode(cache, last.argmax(-1), pos, prompt + 1)
        n = 50
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        a.record()
        for _ in range(n):
            cache.graph.replay()
        b.record()
        host = time.perf_counter() - t0
        torch.cuda.synchronize()
        print(f"== batch {B}: one decode graph replay: {a.elapsed_time(b) / n:.3f} ms on the device, "
              f"{host / n * 1000:.3f} ms of host time to launch it")
        # each decode call of a generate call as the loop makes it: host time between calls and inside one, and
        # the device time between the events recorded at each call's start
        marks: list[tuple[float, float, torch.cuda.Event]] = []
        plain = LlamaStepper.decode

        def timed_decode(self, *a, **k):
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            t0 = time.perf_counter()
            out = plain(self, *a, **k)
            marks.append((t0, time.perf_counter(), ev))
            return out

        LlamaStepper.decode = timed_decode
        try:
            t = _timed(lambda: generate(model, prompts, max_new_tokens=new))
        finally:
            LlamaStepper.decode = plain
        gap = sorted((b[0] - a[1]) * 1e3 for a, b in zip(marks[2:], marks[3:]))
        inside = sorted((m[1] - m[0]) * 1e3 for m in marks[2:])
        dev = sorted(a[2].elapsed_time(b[2]) for a, b in zip(marks[2:], marks[3:]))
        med = lambda v: v[len(v) // 2]  # noqa: E731
        print(f"== batch {B}, {new} new tokens: {t * 1e3:.1f} ms; from the third decode call on, medians (max): "
              f"host between calls {med(gap):.3f} ({gap[-1]:.3f}) ms, host inside a call {med(inside):.3f} "
              f"({inside[-1]:.3f}) ms, device from call to call {med(dev):.3f} ({dev[-1]:.3f}) ms; the first "
              f"two calls {(marks[0][1] - marks[0][0]) * 1e3:.1f} and {(marks[1][1] - marks[1][0]) * 1e3:.1f} ms")
        for graphs in (True, False):
            with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
                t = _timed(lambda g=graphs: generate(model, prompts, max_new_tokens=new, cuda_graphs=g))
            print(f"== batch {B}, {new} new tokens, cuda_graphs={graphs}: {t * 1000:.1f} ms")
            if trace_dir is not None and graphs:
                trace_dir.mkdir(parents=True, exist_ok=True)
                p.export_chrome_trace(str(trace_dir / f"generate_b{B}.json"))
            print(p.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))
            print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=10, max_name_column_width=60))
    bi.set_enabled(False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="1b")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--few-rows-tile", default=None, choices=list(MM_CANDIDATES),
                    help="the decode step's tile (bi.FEW_ROWS_TILE; train: the training tile)")
    ap.add_argument("--unfused", action="store_true",
                    help="decode with LlamaStepper.FUSED off (the training forward's modules one by one)")
    ap.add_argument("--mm-sweep", action="store_true", help="only the matmul tiles at few rows (MM_CANDIDATES)")
    ap.add_argument("--best-out", type=Path, default=None, help="--mm-sweep: write the fastest same-bits tile's name")
    ap.add_argument("--profile", type=int, default=0, metavar="B", help="only a profile of one call at batch B")
    ap.add_argument("--trace-dir", type=Path, default=None, help="--profile: write the graph call's chrome trace here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_generate.py needs a CUDA GPU")
    cfg = _preset(args.model)
    if args.few_rows_tile is not None:
        from dettrain.kernels import batch_invariant as bi

        bi.FEW_ROWS_TILE = MM_CANDIDATES[args.few_rows_tile]
    if args.unfused:
        from dettrain.generate.llama import LlamaStepper

        LlamaStepper.FUSED = False
    if args.mm_sweep:
        mm_sweep(cfg, args.best_out)
        return
    if args.profile:
        return profile(cfg, args.profile, args.prompt, args.new, args.trace_dir)
    rows = []
    print(f"{'batch':>5} | {'dettrain decode':>15} {'HF static+compile':>17} {'ratio':>6} | "
          f"{'dettrain prefill':>16} {'train fwd eager':>15} {'ratio':>6} {'compiled':>9} {'ratio':>6} | "
          f"{'HF prefill':>10} | {'no graphs':>9}   (tokens/s)")
    for B in map(int, args.batches.split(",")):
        d = bench_dettrain(cfg, B, args.prompt, args.new)
        print(f"batch {B}: dettrain {d}", flush=True)  # kept when the alternative fails below
        h = {} if args.skip_hf else bench_hf(cfg, B, args.prompt, args.new)
        row = {"model": args.model, "batch": B, "prompt": args.prompt, "new": args.new, "fused": not args.unfused,
               "dettrain": d, "hf": h,
               "device": torch.cuda.get_device_name(), "torch": torch.__version__}
        rows.append(row)
        hd, hp = h.get("decode_tok_s", float("nan")), h.get("prefill_tok_s", float("nan"))
        # the eager forward is the one whose bits generation reproduces (a compiled run is refused); the compiled
        # one is shown beside it
        fe, fc, pre = d["train_fwd_tok_s"], d["train_fwd_compiled_tok_s"], d["prefill_tok_s"]
        print(f"{B:>5} | {d['decode_tok_s']:>15.0f} {hd:>17.0f} {d['decode_tok_s'] / hd:>6.2f} | "
              f"{pre:>16.0f} {fe:>15.0f} {pre / fe:>6.2f} {fc:>9.0f} {pre / fc:>6.2f} | {hp:>10.0f} | "
              f"{d['decode_eager_tok_s']:>9.0f}", flush=True)
        if args.json:
            with args.json.open("a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
