"""Where the trainer's steps spend their time, as the CLI runs them: ``python -m dettrain ...`` in this process, with
``torch.profiler`` on for a few of its steps only, after the compiling and warm-up ones.

    python bench/profile_steps.py --trace OUT/t3.json [--skip 3] [--steps 2] -- model=1b train.global_batch=16 \\
        train.micro_batch=1 det.tier=3 ckpt.final=false

The arguments after ``--`` are the CLI's.  The trainer's steps (loop/trainer.py: ``Trainer._step``, and the reading
of each step's line) are wrapped: the profiler starts before step ``--skip`` (0-based) is queued and stops once the
line of the ``--steps``-th step after it is read and the device has finished, so the trace holds whole steps of
the run the trainer builds (its compile, CUDA graphs and engine; with train.overlap_steps on, also the next
step's first micro-batch, queued before that line was read), named by the trainer's own ranges
(``dettrain.forward``, ``dettrain.backward``, ``dettrain.reduce``, ``dettrain.clip_step``).  Writes the Chrome
trace gzipped (``--trace`` + ``.gz``) and prints ``trace_summary.py``'s reading of it: the span, the GPU's busy and
idle time, kernel time by kind.  Two traces (say tier 0 and tier 3 at one shape) compare with ``python
bench/trace_summary.py a.json.gz b.json.gz``.  On the CPU (a tiny model) it profiles host ops only: what keeps the
tool working (tests/test_bench_grid.py).
"""

from __future__ import annotations

import argparse
import gzip
import os
import runpy
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", type=Path, required=True, help="the Chrome trace to write (gzipped: TRACE.gz)")
    ap.add_argument("--skip", type=int, default=3, help="steps run before the profiler starts (compile, warm-up)")
    ap.add_argument("--steps", type=int, default=2, help="steps profiled")
    args = ap.parse_args(argv[:cut])
    cli = argv[cut + 1:]
    if args.skip < 0 or args.steps < 1:
        ap.error("--skip must be >= 0 and --steps >= 1")
    import torch

    sys.path.insert(0, str(ROOT))
    from dettrain.loop import trainer as T

    cuda = torch.cuda.is_available()
    activities = [torch.profiler.ProfilerActivity.CPU, *([torch.profiler.ProfilerActivity.CUDA] if cuda else [])]
    state = {"calls": 0, "lines": 0, "prof": None, "done": False}
    original_step, original_line = T.Trainer._step, T._Queued.line

    def step(self, *a, **k):  # the generator of one step: the profiler starts before step --skip is queued
        if state["calls"] == args.skip:
            if cuda:
                torch.cuda.synchronize()
            state["prof"] = torch.profiler.profile(activities=activities)
            state["prof"].__enter__()
        state["calls"] += 1
        return original_step(self, *a, **k)

    def line(self):  # ... and stops once the line of the last profiled step is read and the device is done
        out = original_line(self)
        state["lines"] += 1
        if state["prof"] is not None and not state["done"] and state["lines"] == args.skip + args.steps:
            if cuda:
                torch.cuda.synchronize()
            state["prof"].__exit__(None, None, None)
            state["done"] = True
        return out

    T.Trainer._step, T._Queued.line = step, line
    sys.argv = ["dettrain", *cli]
    try:
        runpy.run_module("dettrain", run_name="__main__")
    except SystemExit as e:
        if e.code not in (0, None):
            raise
    finally:
        T.Trainer._step, T._Queued.line = original_step, original_line
    if not state["done"]:
        raise SystemExit(f"profile_steps.py: the run made {state['lines']} steps, fewer than --skip {args.skip} + "
                         f"--steps {args.steps}: raise train.steps or lower them")
    args.trace.parent.mkdir(parents=True, exist_ok=True)
    state["prof"].export_chrome_trace(str(args.trace))
    with open(args.trace, "rb") as src, gzip.open(f"{args.trace}.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    os.remove(args.trace)
    sys.path.insert(0, str(ROOT / "bench"))
    import trace_summary

    print(f"profiled steps {args.skip}..{args.skip + args.steps - 1} of the trainer; host time in its ranges:")
    for name, (n, ms) in ranges(f"{args.trace}.gz").items():
        print(f"  {name:<24s} {n:5d}x {ms:9.2f} ms")
    if cuda:
        s = trace_summary.summary(trace_summary.load(f"{args.trace}.gz"))
        print(trace_summary.render(f"{args.trace}.gz", s, 15))


def ranges(path: str) -> dict[str, tuple[int, float]]:
    """The trainer's named ranges (``dettrain.*``) on the host: name -> (count, total ms), in order of first use."""
    import json

    with gzip.open(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    out: dict[str, list] = {}
    for e in sorted((e for e in events if e.get("ph") == "X" and e.get("cat") == "user_annotation"
                     and str(e.get("name", "")).startswith("dettrain.")), key=lambda e: e["ts"]):
        r = out.setdefault(e["name"], [0, 0.0])
        r[0] += 1
        r[1] += e["dur"] / 1e3
    return {k: (v[0], v[1]) for k, v in out.items()}


if __name__ == "__main__":
    main()
