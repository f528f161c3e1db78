"""Host (CPU) cost per launched op under each tier's torch settings, on CUDA: does deterministic mode slow the
launch path?  Times, in one process and alternating the settings (so CPU clocks and placement are shared), the
CPU side of small ops whose GPU work is negligible: ``torch.empty``, an in-place add, a small bf16 matmul and a
compiled two-op function.  Usage: ``python3 bench/bench_host.py [--reps N] [--rounds R]``; then, with
``--step7b``, the 7B fake-group step (``python -m dettrain.memory +exp=llm_7b --nproc 8``) of stock FSDP2 with
deterministic algorithms switched on and of tier 3 with them switched off, to see the settings' share of a real step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch


def settings(det: bool) -> None:
    torch.use_deterministic_algorithms(det)
    torch.backends.cudnn.deterministic = det
    if hasattr(torch.utils, "deterministic"):
        torch.utils.deterministic.fill_uninitialized_memory = False


def per_op_us(fn, reps: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    t1 = time.perf_counter()  # CPU time of the launches only (no sync inside the timed span)
    torch.cuda.synchronize()
    return (t1 - t0) / reps * 1e6


def micro(reps: int, rounds: int) -> dict:
    x = torch.zeros(1024, device="cuda")
    a = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    f = torch.compile(lambda t: (t * 2 + 1).sum(), fullgraph=True)
    f(x)
    ops = {"empty": lambda: torch.empty(1024, device="cuda"), "add_": lambda: x.add_(1.0),
           "mm": lambda: a @ a, "compiled": lambda: f(x)}
    out: dict = {}
    for r in range(rounds):
        for det in ((False, True) if r % 2 == 0 else (True, False)):
            settings(det)
            for name, fn in ops.items():
                fn()
                out.setdefault(f"{name} det={det}", []).append(per_op_us(fn, reps))
    settings(False)
    return {k: statistics.median(v) for k, v in out.items()}


def step7b(variant: str) -> None:
    """One 7B memory-tool run with the deterministic flag flipped after the tier's settings are applied."""
    import dettrain.determinism as determinism
    from dettrain.tools import memory

    orig = determinism.apply_tier
    flip = variant == "stock-det"

    def patched(cfg):
        orig(cfg)
        settings(flip)

    determinism.apply_tier = patched
    args = ["+exp=llm_7b", "--nproc", "8", "--device", "cuda"]
    args += ["--stock"] if variant == "stock-det" else ["det.tier=3"]
    memory.main(args)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--step7b", choices=["stock-det", "tier3-nodet"], default=None)
    a = ap.parse_args()
    if a.step7b:
        step7b(a.step7b)
        sys.exit(0)
    res = micro(a.reps, a.rounds)
    for k, v in res.items():
        print(f"{k:24s} {v:7.2f} us per op (CPU, launch side)")
    print(json.dumps(res))
