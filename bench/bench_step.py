"""Step time and peak memory of the training step per tier (run under torchrun, or plain python for 1 rank).

    torchrun --standalone --nproc-per-node=2 bench/bench_step.py --tiers 2 3 4 --steps 30 [key=value ...]
    torchrun --standalone --nproc-per-node=2 bench/bench_step.py --runs 3:flat 3:fsdp2 4:fsdp2 --steps 30

For each tier (or TIER:ENGINE of --runs, the first being the baseline): builds the Trainer of the default job
(plus overrides), runs --warmup steps, then times --steps
steps (wall clock per step on rank 0, ranks in lockstep), and reports the median, the tier's ratio to the first
tier listed (measured in the same process), and the peak RSS of the rank (CPU) or peak CUDA memory.
`--no-overlap` also times tier 3 with every bucket launched only after backward (the overlap baseline).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dettrain import dist as D  # noqa: E402
from dettrain.config import register, validate  # noqa: E402
from dettrain.determinism import apply_tier, seed_process, set_env_before_cuda  # noqa: E402


def compose(overrides: list[str]):
    from hydra import compose as hcompose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from dettrain.config import conf_dir, to_config

    register()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        return to_config(hcompose(config_name="config", overrides=overrides))


def time_tier(tier: int, overrides: list[str], steps: int, warmup: int, overlap: bool, info,
              engine: str = "auto") -> dict:
    from dettrain.loop.trainer import Trainer

    cfg = compose([f"det.tier={tier}", f"dist.engine={engine}", "log.wandb.mode=disabled", *overrides])
    validate(cfg, info.world)
    apply_tier(cfg.det)
    seed_process(cfg.seed, info.rank)
    tr = Trainer(cfg, info, Path("/tmp/dettrain-bench"))
    if getattr(tr.engine, "reducer", None) is not None:
        tr.engine.reducer.overlap = overlap
    it = iter(tr.sampler)
    times = []
    cuda = info.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for i in range(warmup + steps):
        micro = next(it)
        D.barrier(info)
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        tr.train_step(micro)
        if cuda:
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        tr.step += 1
        if i >= warmup:
            times.append(dt)
    mem = (torch.cuda.max_memory_allocated() / 2**20 if cuda
           else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    tok = cfg.train.global_batch * cfg.model.seq_len
    med = statistics.median(times)
    name = tr.engine_name
    tr.close()
    del tr
    gc.collect()
    return {"tier": tier, "engine": name, "overlap": overlap, "median_ms": med * 1e3, "tok_s": tok / med,
            "peak_mb": mem}


def trace_overlap(overrides: list[str], info) -> None:
    """One tier-3 step with timestamps: when each bucket's all_to_all is launched vs when backward returns."""
    from dettrain.loop.trainer import Trainer

    cfg = compose(["det.tier=3", "log.wandb.mode=disabled", *overrides])
    apply_tier(cfg.det)
    tr = Trainer(cfg, info, Path("/tmp/dettrain-bench"))
    red = tr.engine.reducer
    events: list[tuple[str, float]] = []
    launch = red._launch

    def timed_launch(b: int) -> None:  # bench-only instrumentation
        events.append((f"launch bucket {b}", time.perf_counter()))
        launch(b)

    red._launch = timed_launch
    end_micro = red.end_micro

    def timed_end(k: int) -> None:
        events.append((f"backward {k} returned", time.perf_counter()))
        end_micro(k)

    red.end_micro = timed_end
    it = iter(tr.sampler)
    tr.train_step(next(it))
    events.clear()
    t0 = time.perf_counter()
    tr.train_step(next(it))
    if info.is_main:
        print(f"overlap trace (rank 0, {len(red.layout.buckets)} buckets, times from step start):")
        for name, t in events:
            print(f"  {1e3 * (t - t0):8.1f} ms  {name}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiers", type=int, nargs="+", default=[2, 3, 4])
    ap.add_argument("--runs", nargs="+", default=None, metavar="TIER:ENGINE",
                    help="tier:engine pairs instead of --tiers (engine auto|ddp|flat|fsdp2)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--no-overlap", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--trace", action="store_true", help="print an overlap trace of one tier-3 step")
    args, overrides = ap.parse_known_args()
    runs = ([(int(t), e) for t, e in (r.split(":") for r in args.runs)] if args.runs
            else [(t, "auto") for t in args.tiers])
    set_env_before_cuda(max(t for t, _ in runs))
    info = D.init(D.DistConfig())
    if args.trace:
        trace_overlap(overrides, info)
        D.shutdown()
        return
    rows = []
    for tier, engine in runs:
        rows.append(time_tier(tier, overrides, args.steps, args.warmup, True, info, engine))
        if args.no_overlap and rows[-1]["engine"] == "flat":
            rows.append(time_tier(tier, overrides, args.steps, args.warmup, False, info, engine))
    if info.is_main:
        base = rows[0]["median_ms"]
        print(f"world {info.world}, threads/rank {torch.get_num_threads()}, overrides {overrides}")
        print("| tier | engine | overlap | median step ms | tok/s | ratio to first | peak RSS/mem MiB (rank 0) |")
        print("|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['tier']} | {r['engine']} | {r['overlap']} | {r['median_ms']:.1f} | {r['tok_s']:,.0f} | "
                  f"{r['median_ms'] / base:.3f} | {r['peak_mb']:.0f} |")
        if args.json:
            Path(args.json).write_text(json.dumps({"world": info.world, "rows": rows}, indent=1))
    D.shutdown()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
