"""Wall time and tokens/s of the default job (`python -m dettrain`, 300 steps) per tier on 1 and 2 ranks.

    python bench/bench_default_job.py --tiers 0 1 2 3 4 --ranks 1 2 [key=value ...]
    python bench/bench_default_job.py --tiers 3 --ranks 1 2 --compile false true     # train.compile off vs on

Each cell is one real run of the CLI (start-up included in the wall time); tokens/s is the job's own figure
(global_batch x seq_len x steps / training-loop seconds, from its 'done:' line).  Ratios are to tier 2 on the same
number of ranks (with --compile: to the first compile setting), measured in the same invocation.  Compiled runs also
report the compile+first step time and the tokens/s of the other steps.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run(tier: int, ranks: int, overrides: list[str], compile: str = "auto") -> tuple:
    with tempfile.TemporaryDirectory() as d:
        args = [f"det.tier={tier}", f"run_dir={d}/run", "log.wandb.mode=disabled", f"train.compile={compile}",
                *overrides]
        if ranks == 1:
            cmd = [sys.executable, "-m", "dettrain", *args]
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
                   "-m", "dettrain", *args]
        t0 = time.perf_counter()
        p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        wall = time.perf_counter() - t0
        if p.returncode:
            raise SystemExit(p.stderr[-3000:])
        m = re.search(r"done: (\d+) steps in ([\d.]+) s", p.stdout)
        losses = re.findall(r"loss ([\d.]+)", p.stdout)
        steps, loop_s = int(m.group(1)), float(m.group(2))
        first = re.search(r"compile\+first step ([\d.]+) s\)", p.stdout)
        first_s = float(first.group(1)) if first else None
        cfg = (Path(d) / "run" / "config.yaml").read_text()
        gb = int(re.search(r"global_batch: (\d+)", cfg).group(1))
        T = int(re.search(r"seq_len: (\d+)", cfg).group(1))
        after = gb * T * (steps - 1) / (loop_s - first_s) if first_s is not None and steps > 1 else None
        return wall, gb * T * steps / loop_s, losses[-1] if losses else "?", first_s, after


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiers", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--compile", nargs="+", default=None, choices=["auto", "true", "false"],
                    help="train.compile settings to compare (default: the job's own, auto)")
    args, overrides = ap.parse_known_args()
    settings = args.compile or ["auto"]
    res = {}
    for ranks in args.ranks:
        for tier in args.tiers:
            for c in settings:
                res[ranks, tier, c] = run(tier, ranks, overrides, c)
                print(f"ranks {ranks} tier {tier} compile {c}: {res[ranks, tier, c]}", file=sys.stderr)
    print(f"overrides: {overrides or 'none'}; {os.cpu_count()} CPUs")
    if args.compile is None:
        print("| ranks | tier | wall s (incl. start-up) | tokens/s | ratio to tier 2 (tok/s) | final loss |")
        print("|---|---|---|---|---|---|")
        for (ranks, tier, _), (wall, tps, loss, _, _) in res.items():
            base = res.get((ranks, 2, "auto"), (0, tps))[1]
            print(f"| {ranks} | {tier} | {wall:.1f} | {tps:,.0f} | {tps / base:.3f} | {loss} |")
        return
    print("| ranks | tier | train.compile | wall s (incl. start-up) | tokens/s (whole loop) | ratio | "
          "compile+first step s | tokens/s after step 1 | final loss |")
    print("|---|---|---|---|---|---|---|---|---|")
    for (ranks, tier, c), (wall, tps, loss, first_s, after) in res.items():
        base = res[ranks, tier, settings[0]][1]
        print(f"| {ranks} | {tier} | {c} | {wall:.1f} | {tps:,.0f} | {tps / base:.3f} | "
              f"{'-' if first_s is None else f'{first_s:.1f}'} | {'-' if after is None else f'{after:,.0f}'} | "
              f"{loss} |")


if __name__ == "__main__":
    main()
