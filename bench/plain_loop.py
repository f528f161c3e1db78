"""The loop a user writes instead of dettrain: the baseline of bench/bench_grid.py.

The same model (dettrain's LLaMA from its preset, or transformers' LlamaForCausalLM of that shape), ``torch.compile``
of the whole model, bf16 autocast over fp32 parameters, fused AdamW, gradient accumulation over micro-batches, one
optimizer step per global batch; no dettrain in the step.  Prints one JSON line: tokens/s over the timed steps (after
``--warmup``), the per-step times, and the peak device memory.

    python3 bench/plain_loop.py --model 125m --global-batch 64 --micro-batch 8 [--hf] [--steps 12] [--cpu]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F


def build(model: str, hf: bool, device: torch.device):
    """(module mapping (B, T) ids to logits, vocab size, seq len) for a preset of conf/model."""
    from hydra import compose, initialize_config_dir

    from dettrain.config import conf_dir, register

    register()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
        m = compose(config_name="config", overrides=[f"model={model}"]).model
    if not hf:
        from dettrain.models.llama import ModelConfig, build_model

        cfg = ModelConfig(**{k: v for k, v in m.items() if k in ModelConfig.__dataclass_fields__})
        return build_model(cfg, 0, device), cfg.vocab_size, cfg.seq_len
    from transformers import LlamaConfig, LlamaForCausalLM

    hc = LlamaConfig(vocab_size=m.vocab_size, hidden_size=m.dim, intermediate_size=m.ffn_dim,
                     num_hidden_layers=m.n_layers, num_attention_heads=m.n_heads, num_key_value_heads=m.n_kv_heads,
                     max_position_embeddings=m.seq_len, rms_norm_eps=1e-5, tie_word_embeddings=False,
                     attn_implementation="sdpa")
    net = LlamaForCausalLM(hc).to(device)

    class Logits(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.hf = net

        def forward(self, x):
            return self.hf(input_ids=x, use_cache=False).logits

    return Logits(), m.vocab_size, m.seq_len


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="125m")
    ap.add_argument("--hf", action="store_true", help="transformers' LlamaForCausalLM of the preset's shape")
    ap.add_argument("--global-batch", type=int, default=64)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--cpu", action="store_true", help="CPU, fp32, not compiled (keeps the script working on CI)")
    a = ap.parse_args()
    device = torch.device("cpu" if a.cpu else "cuda")
    torch.manual_seed(0)
    model, vocab, T = build(a.model, a.hf, device)
    model.train()
    step_fn = model if a.cpu else torch.compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=not a.cpu)
    accum = a.global_batch // a.micro_batch
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if not a.cpu else torch.autocast("cpu", enabled=False)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, vocab, (a.micro_batch, T + 1), generator=g) for _ in range(accum)]

    def sync():
        if not a.cpu:
            torch.cuda.synchronize()

    times = []
    for i in range(a.warmup + a.steps):
        sync()
        t0 = time.perf_counter()
        for tok in batches:
            tok = tok.to(device, non_blocking=True)
            with amp:
                logits = step_fn(tok[:, :-1])
            loss = F.cross_entropy(logits.float().reshape(-1, vocab), tok[:, 1:].reshape(-1)) / accum
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        float(loss.detach())  # one host sync a step, as a loop printing its loss has
        sync()
        if i >= a.warmup:
            times.append(time.perf_counter() - t0)
    tokens = a.global_batch * T
    peak = torch.cuda.max_memory_allocated() / 2**30 if not a.cpu else None
    print(json.dumps({"plain_tokens_per_s": tokens / statistics.median(times), "step_s": times,
                      "peak_GiB": peak}))


if __name__ == "__main__":
    main()
