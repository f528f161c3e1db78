"""Host time per micro-batch of each engine's own work, on the CPU, where compute is small enough to leave it visible.

A tiny LLaMA (dim 64, ``--layers`` blocks, one sequence of 32 tokens a micro-batch, fp32, eager) trains at tier 3
through the engine's own step (``begin_step``, ``micro``, ``backward``, ``reduce``, ``step``), one thread.  The model's
ops are the same for every engine, so the difference between engines is the engine's host work: for FSDP2 its
per-block hooks, which on a GPU run eagerly between the CUDA graphs of the compiled blocks.  Engines: flat, fsdp2
(``fully_shard`` per block) and fsdp2-root (one FSDP2 unit, ``DETTRAIN_FSDP2_UNITS=root``).  Prints ms per
micro-batch for each, then a cProfile of per-block FSDP2's micro-batches without a gradient sync (the steady state
of gradient accumulation), restricted to torch's FSDP2, Dynamo and profiler frames.

    python3 bench/engine_host_profile.py [--layers 12] [--micro 8] [--top 25] [--hf]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import time

import torch

from dettrain import dist as D
from dettrain.config import Config, TrainConfig
from dettrain.determinism import DetConfig
from dettrain.models.llama import ModelConfig, build_model
from dettrain.sync.engines import engine_class
from dettrain.sync.engines.fsdp2 import UNITS_ENV


def build(name: str, layers: int, m: int, hf: bool = False):
    os.environ[UNITS_ENV] = "root" if name == "fsdp2-root" else "blocks"
    mcfg = ModelConfig(dim=64, n_layers=layers, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=256, seq_len=32)
    cfg = Config(model=mcfg, train=TrainConfig(global_batch=m, micro_batch=1, compile=False), det=DetConfig(tier=3))
    cfg.dist.engine = name.split("-")[0]
    if hf:  # the Hugging Face Llama of the same shape (dettrain.models.hf, as model=hf_llama builds it)
        from dettrain.models.hf import from_config

        torch.manual_seed(0)
        model = from_config(256, 32, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                            num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    else:
        model = build_model(cfg.model, 0, "cpu")
    info = D.DistInfo(0, 1, 0, torch.device("cpu"), None)
    eng = engine_class(cfg).from_config(cfg, model, info, mixed_precision=False)
    g = torch.Generator().manual_seed(0)
    toks = [torch.randint(0, 256, (1, 33), generator=g) for _ in range(m)]

    def micro(k: int) -> None:
        with eng.micro(k):
            logits = eng.forward_module(toks[k][:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), toks[k][:, 1:].reshape(-1))
            eng.backward(loss, k)

    def finish() -> None:
        eng.reduce(1.0 / m)
        eng.step(1e-3)

    return eng, micro, finish


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--micro", type=int, default=8, help="micro-batches a step")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--hf", action="store_true", help="the Hugging Face Llama of that shape (needs transformers)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    for name in ("flat", "fsdp2", "fsdp2-root"):
        eng, micro, finish = build(name, a.layers, a.micro, a.hf)
        for _ in range(3):
            eng.begin_step(a.micro)
            for k in range(a.micro):
                micro(k)
            finish()
        t = time.perf_counter()
        for _ in range(a.steps):
            eng.begin_step(a.micro)
            for k in range(a.micro):
                micro(k)
            finish()
        ms = (time.perf_counter() - t) / a.steps / a.micro * 1e3
        print(f"{name}: {ms:.2f} ms per micro-batch (whole step / micro-batches, {a.layers} blocks)", flush=True)
        if name == "fsdp2":
            prof = cProfile.Profile()
            for _ in range(5):
                eng.begin_step(a.micro)
                prof.enable()
                for k in range(a.micro - 1):  # the micro-batches that accumulate without a gradient sync
                    micro(k)
                prof.disable()
                micro(a.micro - 1)
                finish()
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats("fsdp|_dynamo|profiler", a.top)
            print(f"fsdp2, {5 * (a.micro - 1)} micro-batches without a gradient sync:\n{out.getvalue()}")
        eng.close()


if __name__ == "__main__":
    main()
