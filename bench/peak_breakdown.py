"""What is allocated at a run's peak of device memory, by call site: the trainer as the CLI runs it, in this process,
with the CUDA caching allocator's history on.

    python bench/peak_breakdown.py [--top 25] [--snapshot out.pickle] -- model=125m train.micro_batch=4 det.tier=3 ...

The arguments after ``--`` are the CLI's (``python -m dettrain ...``; add ``ckpt.final=false``).  After the run
the allocator's trace is replayed: the moment the sum of live allocations was largest, and what was live then,
grouped by the innermost dettrain frame (file:line function) of each allocation's stack (torch's own frame when
none is dettrain's), largest group first.  CUDA only.  Memory recorded before history started (none: it starts
before the CLI's imports) would be missed; CUDA-graph pools appear as the allocations made while capturing.
"""

from __future__ import annotations

import argparse
import pickle
import runpy
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _site(frames: list[dict]) -> str:
    """The innermost frame in dettrain/ (the project's call site), else the innermost Python frame."""
    for f in frames:
        fn = f.get("filename", "")
        if "/dettrain/" in fn and "/site-packages/" not in fn:
            return f"{fn.split('/dettrain/')[-1]}:{f.get('line')} {f.get('name')}"
    for f in frames:
        fn = f.get("filename", "")
        if fn.endswith(".py"):
            return f"{fn.rsplit('/', 2)[-1]}:{f.get('line')} {f.get('name')}"
    return "(no Python frame)"


def peak(trace: list[dict]) -> tuple[int, int, dict[int, tuple[int, list]]]:
    """(peak bytes, index of the event that reached it, the live allocations then: addr -> (size, frames))."""
    live: dict[int, tuple[int, list]] = {}
    total = best = at = 0
    for i, e in enumerate(trace):
        act = e["action"]
        if act == "alloc":
            live[e["addr"]] = (e["size"], e.get("frames", []))
            total += e["size"]
            if total > best:
                best, at = total, i
        elif act == "free_completed" and e["addr"] in live:
            total -= live.pop(e["addr"])[0]
    live = {}
    for e in trace[: at + 1]:
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], e.get("frames", []))
        elif e["action"] == "free_completed":
            live.pop(e["addr"], None)
    return best, at, live


def breakdown(live: dict[int, tuple[int, list]]) -> list[tuple[str, int, int]]:
    """(call site, bytes, allocations) per call site, largest first."""
    by: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for size, frames in live.values():
        g = by[_site(frames)]
        g[0] += size
        g[1] += 1
    return sorted(((k, v[0], v[1]) for k, v in by.items()), key=lambda r: -r[1])


def main() -> None:
    argv = sys.argv[1:]
    cli = argv[argv.index("--") + 1:] if "--" in argv else []
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--snapshot", type=Path, default=None, help="also write the allocator snapshot (pickle)")
    args = ap.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("peak_breakdown.py needs a CUDA GPU")
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    sys.argv = ["dettrain", *cli]
    sys.path.insert(0, str(ROOT))
    try:
        runpy.run_module("dettrain", run_name="__main__")
    except SystemExit as e:
        if e.code not in (0, None):
            raise
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    if args.snapshot:
        args.snapshot.write_bytes(pickle.dumps(snap))
    dev = torch.cuda.current_device()
    trace = snap["device_traces"][dev]
    best, at, live = peak(trace)
    print(f"peak of live allocations: {best / 2**30:.3f} GiB at event {at} of {len(trace)} "
          f"(torch.cuda.max_memory_allocated: {torch.cuda.max_memory_allocated() / 2**30:.3f} GiB)")
    for site, size, n in breakdown(live)[: args.top]:
        print(f"{size / 2**20:10.1f} MiB {n:6d}  {site}")


if __name__ == "__main__":
    main()
