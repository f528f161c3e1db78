"""Generation speed on one GPU: dettrain.generate (training-equal logits) beside Hugging Face ``generate`` with a
static cache and torch.compile, the alternative a user would pick (docs/generate.md).

    python bench/bench_generate.py [--model 1b] [--prompt 128] [--new 128] [--batches 1,8,64] [--json PATH]

For each batch size: decode tokens/s (new tokens of the whole batch / the decode time) and prefill tokens/s
(prompt tokens / the prefill time) of ``dettrain.generate`` with det.batch_invariant on under bf16 autocast; the
same for ``LlamaForCausalLM.generate(cache_implementation="static")`` with its forward compiled
(``mode="reduce-overhead"``), the same shape, random weights, greedy, no end-of-text; and the training forward's
tokens/s at the prompt's shape (prefill's target).  Weights are random: speed does not depend on them.  Prints a
table; ``--json`` appends one JSON line per row.  Runs unattended (no prompts, no downloads).
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


def _steps(model, prompts: list[list[int]], new: int) -> tuple[float, float]:
    """(prefill s, decode s) of dettrain's cached forward, greedy (argmax on the device: the model's cost, without
    generate()'s per-request Python bookkeeping)."""
    from dettrain.generate.llama import LlamaStepper

    st = LlamaStepper(model, exact=True)
    n = len(prompts[0])
    with torch.no_grad():
        cache = st.start(prompts, n + new)
        box = []
        pre = _timed(lambda: box.append(st.prefill(cache, prompts, None)))

        def decode() -> None:
            last = box[0]
            for i in range(new - 1):
                last = st.decode(cache, last.argmax(-1).tolist(), [n + i] * len(prompts))

        return pre, _timed(decode)


def bench_dettrain(cfg, B: int, prompt: int, new: int) -> dict:
    from dettrain.kernels import batch_invariant as bi
    from dettrain.models.llama import build_model

    bi.set_enabled(True)
    model = build_model(cfg, 0, "cuda").eval()
    prompts = torch.randint(0, cfg.vocab_size, (B, prompt)).tolist()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        _steps(model, prompts, 4)  # warm-up: Triton compiles
        prefill_s, decode_s = _steps(model, prompts, new)
        # the training forward at the prompt's shape: what prefill should approach
        toks = torch.tensor(prompts, device="cuda")
        with torch.no_grad():
            model(toks)
            fwd = min(_timed(lambda: model(toks)) for _ in range(3))
    bi.set_enabled(False)
    return {"prefill_tok_s": B * prompt / prefill_s, "decode_tok_s": B * (new - 1) / decode_s,
            "train_fwd_tok_s": B * prompt / fwd}


def bench_hf(cfg, B: int, prompt: int, new: int) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    hc = LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.dim, intermediate_size=cfg.ffn_dim,
                     num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
                     num_key_value_heads=cfg.n_kv_heads or cfg.n_heads, max_position_embeddings=cfg.seq_len,
                     rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta)
    model = LlamaForCausalLM(hc).to("cuda", torch.bfloat16).eval()
    model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    ids = torch.randint(0, cfg.vocab_size, (B, prompt), device="cuda")
    kw = {"do_sample": False, "cache_implementation": "static", "pad_token_id": 0, "eos_token_id": None}
    with torch.no_grad():
        for _ in range(2):  # compile and warm up the static-cache graphs
            model.generate(ids, max_new_tokens=new, min_new_tokens=new, **kw)
        pre = min(_timed(lambda: model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)) for _ in range(3))
        total = _timed(lambda: model.generate(ids, max_new_tokens=new, min_new_tokens=new, **kw))
    return {"prefill_tok_s": B * prompt / pre, "decode_tok_s": B * (new - 1) / max(total - pre, 1e-9)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="1b")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_generate.py needs a CUDA GPU")
    cfg = _preset(args.model)
    rows = []
    print(f"{'batch':>5} | {'dettrain decode':>15} {'HF static+compile':>17} {'ratio':>6} | "
          f"{'dettrain prefill':>16} {'train fwd':>10} {'ratio':>6} | {'HF prefill':>10}   (tokens/s)")
    for B in map(int, args.batches.split(",")):
        d = bench_dettrain(cfg, B, args.prompt, args.new)
        h = {} if args.skip_hf else bench_hf(cfg, B, args.prompt, args.new)
        row = {"model": args.model, "batch": B, "prompt": args.prompt, "new": args.new, "dettrain": d, "hf": h,
               "device": torch.cuda.get_device_name(), "torch": torch.__version__}
        rows.append(row)
        hd, hp = h.get("decode_tok_s", float("nan")), h.get("prefill_tok_s", float("nan"))
        print(f"{B:>5} | {d['decode_tok_s']:>15.0f} {hd:>17.0f} {d['decode_tok_s'] / hd:>6.2f} | "
              f"{d['prefill_tok_s']:>16.0f} {d['train_fwd_tok_s']:>10.0f} "
              f"{d['prefill_tok_s'] / d['train_fwd_tok_s']:>6.2f} | {hp:>10.0f}", flush=True)
        if args.json:
            with args.json.open("a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
