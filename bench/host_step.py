"""The host's part of each step, as the CLI runs it: ``python -m dettrain ...`` in this process, with the step
observers (loop/observers.py: the finite check, the ledger write and fsync, the wandb row, the progress line, the
checkpoint check) and the reading of each step's line (``_Queued.line``, the step's one host sync) timed per call.

    python bench/host_step.py [--json FILE] -- model=1b train.global_batch=16 train.micro_batch=2 ckpt.final=false

The arguments after ``--`` are the CLI's (the wandb mirror stays at its default, offline, unless they say
otherwise).  Prints, per timed function, the number of calls, the first call (the compiling step's, which opens
wandb's run on its first row) and the median and maximum of the others, in ms.  What the observers take is host
time between two steps: with ``train.overlap_steps`` off the device waits for it; with it on, the next step's
first micro-batch runs meanwhile.  The line's time includes waiting for the device to finish the step.  Python's
garbage collections after the first line (the compiling step's) are timed too, one row per generation (``gc
generation N``: each collection's ms), since one that lands in a host-bound step delays the device.
"""

from __future__ import annotations

import argparse
import gc
import json
import runpy
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, help="also write the per-call times (ms) here")
    args = ap.parse_args(argv[:cut])
    sys.path.insert(0, str(ROOT))
    from dettrain.loop import observers as O
    from dettrain.loop import trainer as T

    times: dict[str, list[float]] = {}

    def timed(owner, attr: str, name: str) -> None:
        original = getattr(owner, attr)

        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return original(*a, **k)
            finally:
                times.setdefault(name, []).append((time.perf_counter() - t) * 1e3)

        setattr(owner, attr, wrapper)

    for cls in (O.CheckReference, O.CheckFinite, O.WriteLedger, O.MirrorToWandb, O.LogProgress, O.Checkpoint):
        timed(cls, "on_step", f"{cls.__name__}.on_step")
    timed(T._Queued, "line", "line (the step's host sync)")
    started: list[float] = []

    def gc_timer(phase: str, info: dict) -> None:
        if not times.get("line (the step's host sync)"):  # setup and the compiling step: not the loop's
            return
        if phase == "start":
            started[:] = [time.perf_counter()]
        elif started:
            times.setdefault(f"gc generation {info['generation']}", []).append(
                (time.perf_counter() - started.pop()) * 1e3)

    gc.callbacks.append(gc_timer)
    sys.argv = ["dettrain", *argv[cut + 1:]]
    try:
        runpy.run_module("dettrain", run_name="__main__", alter_sys=True)
    except SystemExit as e:
        if e.code not in (0, None):
            raise
    finally:
        gc.callbacks.remove(gc_timer)
    if not times:
        raise SystemExit("host_step: no step ran (see the CLI's output above)")
    print(f"{'function':<34} {'calls':>5} {'first ms':>9} {'median ms':>10} {'max ms':>8}")
    for name, ts in times.items():
        rest = ts[1:] or ts
        print(f"{name:<34} {len(ts):>5} {ts[0]:>9.3f} {statistics.median(rest):>10.3f} {max(rest):>8.3f}")
    if args.json is not None:
        args.json.write_text(json.dumps(times))


if __name__ == "__main__":
    main()
