"""Wall time and tokens/s of the default job (`python -m dettrain`, 300 steps) per tier on 1 and 2 ranks.

    python bench/bench_default_job.py --tiers 0 1 2 3 4 --ranks 1 2 [key=value ...]

Each cell is one real run of the CLI (start-up included in the wall time); tokens/s is the job's own figure
(global_batch x seq_len x steps / training-loop seconds, from its 'done:' line).  Ratios are to tier 2 on the same
number of ranks, measured in the same invocation.
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


def run(tier: int, ranks: int, overrides: list[str]) -> tuple[float, float, str]:
    with tempfile.TemporaryDirectory() as d:
        args = [f"det.tier={tier}", f"run_dir={d}/run", "log.wandb.mode=disabled", *overrides]
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
        cfg = (Path(d) / "run" / "config.yaml").read_text()
        gb = int(re.search(r"global_batch: (\d+)", cfg).group(1))
        T = int(re.search(r"seq_len: (\d+)", cfg).group(1))
        return wall, gb * T * steps / loop_s, losses[-1] if losses else "?"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiers", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    args, overrides = ap.parse_known_args()
    res = {}
    for ranks in args.ranks:
        for tier in args.tiers:
            res[ranks, tier] = run(tier, ranks, overrides)
            print(f"ranks {ranks} tier {tier}: {res[ranks, tier]}", file=sys.stderr)
    print(f"overrides: {overrides or 'none'}; {os.cpu_count()} CPUs")
    print("| ranks | tier | wall s (incl. start-up) | tokens/s | ratio to tier 2 (tok/s) | final loss |")
    print("|---|---|---|---|---|---|")
    for (ranks, tier), (wall, tps, loss) in res.items():
        base = res.get((ranks, 2), (0, tps))[1]
        print(f"| {ranks} | {tier} | {wall:.1f} | {tps:,.0f} | {tps / base:.3f} | {loss} |")


if __name__ == "__main__":
    main()
