"""Where a profiled step's GPU time went, from the Chrome traces ``python -m dettrain.memory ... --profile FILE``
writes (FILE.trace.json, or gzipped): the step's span, the union of its kernel, copy and memset intervals (busy),
the idle rest and where it falls (per 25 ms window), and kernel time by kind.  Given two traces (a baseline first),
also the kernels whose time or count differs.  BENCHMARKS.md's profile tables were read this way.

    python3 bench/trace_summary.py stock.trace.json.gz tier3.trace.json.gz [--window-ms 25] [--top 15]
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
from collections import defaultdict

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
# kernel kinds, first match wins (names as torch 2.11 / cuDNN 9 / Triton 3.6 / dettrain's kernels print them)
KINDS = (("gemm", r"nvjet|gemm|cutlass|xmma"), ("attn_fwd", r"fprop|_attn_fwd"),
         ("attn_bwd", r"bprop|_attn_bwd|_attn_delta|dot_do_o|convert_dq"), ("chunk_cat", r"chunk_cat"),
         ("split_copy", r"split_with_sizes"), ("memcpy", r"Memcpy"), ("memset", r"Memset"),
         ("rowsum", r"_group_tree"), ("adamw", r"adam"), ("foreach", r"multi_tensor"), ("inductor", r"triton_"))


def load(path: str) -> list[tuple[float, float, str]]:
    """(start us, end us, name) of every GPU interval of the trace, sorted."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    return sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events
                  if e.get("ph") == "X" and e.get("cat") in GPU_CATS)


def kind(name: str) -> str:
    return next((k for k, pat in KINDS if re.search(pat, name, re.I)), "other")


def summary(iv: list[tuple[float, float, str]], window_us: float = 25e3) -> dict:
    """span, busy (the union of the intervals), idle = span - busy, idle per window (keyed by the window's start
    in ms from the first interval), and time and count by kind and by kernel name (overlaps counted in each)."""
    if not iv:
        return {"span_ms": 0.0, "busy_ms": 0.0, "idle_ms": 0.0, "idle_by_window": {}, "kinds": {}, "names": {}}
    t0, end, busy = iv[0][0], iv[0][0], 0.0
    idle: dict[int, float] = defaultdict(float)
    for s, e, _ in iv:
        if s > end:  # a gap: no GPU work between end and s
            idle[int((end - t0) // window_us)] += s - end
            busy += e - s
        elif e > end:
            busy += e - end
        end = max(end, e)
    kinds: dict[str, list] = defaultdict(lambda: [0, 0.0])
    names: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for s, e, n in iv:
        for table, key in ((kinds, kind(n)), (names, n[:100])):
            table[key][0] += 1
            table[key][1] += (e - s) / 1e3
    return {"span_ms": (end - t0) / 1e3, "busy_ms": busy / 1e3, "idle_ms": (end - t0 - busy) / 1e3,
            "idle_by_window": {int(k * window_us / 1e3): v / 1e3 for k, v in sorted(idle.items())},
            "kinds": dict(kinds), "names": dict(names)}


def render(path: str, s: dict, top: int) -> str:
    out = [f"{path}: span {s['span_ms']:.1f} ms, GPU busy {s['busy_ms']:.1f} ms, idle {s['idle_ms']:.1f} ms",
           "  idle by window (ms from the start: ms idle): " + " ".join(
               f"{k}:{v:.1f}" for k, v in s["idle_by_window"].items() if v >= 0.5)]
    for k, (n, ms) in sorted(s["kinds"].items(), key=lambda x: -x[1][1]):
        out.append(f"  {k:<11s} {n:6d} intervals {ms:9.2f} ms")
    for name, (n, ms) in sorted(s["names"].items(), key=lambda x: -x[1][1])[:top]:
        out.append(f"    {ms:9.2f} ms {n:5d}x {name}")
    return "\n".join(out)


def differences(a: dict, b: dict, top: int) -> str:
    """Kernels whose count differs or whose time differs by 0.5 ms or more, largest difference first."""
    rows = []
    for name in set(a["names"]) | set(b["names"]):
        (na, ta), (nb, tb) = a["names"].get(name, (0, 0.0)), b["names"].get(name, (0, 0.0))
        if na != nb or abs(tb - ta) >= 0.5:
            rows.append((tb - ta, na, ta, nb, tb, name))
    rows.sort(key=lambda r: -abs(r[0]))
    lines = ["kernel time, first -> second trace (count, ms):"]
    lines += [f"  {d:+8.2f} ms  {na:5d} {ta:8.2f} -> {nb:5d} {tb:8.2f}  {name}"
              for d, na, ta, nb, tb, name in rows[:top]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("traces", nargs="+", help="Chrome traces (.json or .json.gz); with two, the first is the baseline")
    ap.add_argument("--window-ms", type=float, default=25.0)
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args(argv)
    sums = [summary(load(p), args.window_ms * 1e3) for p in args.traces]
    for p, s in zip(args.traces, sums):
        print(render(p, s, args.top))
    if len(sums) == 2:
        print(differences(sums[0], sums[1], args.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
