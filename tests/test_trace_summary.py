"""bench/trace_summary.py, which BENCHMARKS.md's profile tables were read with: busy time is the union of the GPU
intervals (overlapping streams counted once), idle is the rest of the span, and idle lands in the window where the
gap starts.  Checked on a written trace whose answers follow from its intervals by hand."""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def ts():
    spec = importlib.util.spec_from_file_location("trace_summary", REPO / "bench" / "trace_summary.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _trace(path: Path, intervals) -> Path:
    events = [{"ph": "X", "cat": cat, "name": name, "ts": s, "dur": d} for cat, name, s, d in intervals]
    events.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 10**6})  # not GPU time
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    return path


def test_busy_is_the_union_and_idle_the_gaps(tmp_path, ts, capsys):
    # us: gemm 0-10000; on another stream _group_tree 5000-12000 (overlaps 5000); gap 12000-20000 (8 ms, window 0);
    # copy 20000-26000; gap 26000-30000 (4 ms, window 25); _attn_fwd 30000-31000 inside nothing else
    iv = [("kernel", "nvjet_sm90_x", 0, 10_000), ("kernel", "_group_tree_kernel", 5_000, 7_000),
          ("gpu_memcpy", "Memcpy DtoD (Device -> Device)", 20_000, 6_000),
          ("kernel", "_attn_fwd_kernel", 30_000, 1_000)]
    s = ts.summary(ts.load(str(_trace(tmp_path / "a.json.gz", iv))))
    assert s["span_ms"] == 31.0 and s["busy_ms"] == 12.0 + 6.0 + 1.0 and s["idle_ms"] == 12.0
    assert s["idle_by_window"] == {0: 8.0, 25: 4.0}
    assert {k: v[1] for k, v in s["kinds"].items()} == {"gemm": 10.0, "rowsum": 7.0, "memcpy": 6.0, "attn_fwd": 1.0}
    # two traces: the differences name the kernel that appears in one only
    b = _trace(tmp_path / "b.json.gz", iv[:1] + [("kernel", "cudnn_flash_fprop_x", 10_000, 2_000)])
    assert ts.main([str(tmp_path / "a.json.gz"), str(b)]) == 0
    out = capsys.readouterr().out
    assert "-7.00 ms" in out and "_group_tree_kernel" in out and "+2.00 ms" in out
