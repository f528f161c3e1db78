"""bench/bench_grid.py keeps working: its CPU mode runs the real CLI and the plain loop on the tiny model and writes
a table whose cells are measured numbers (no run failed), with the ratios the goals name."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import REPO


def test_grid_cpu_mode_measures_every_cell(tmp_path):
    out = tmp_path / "grid.md"
    p = subprocess.run([sys.executable, str(REPO / "bench" / "bench_grid.py"), "--cpu", "--models", "tiny",
                        "--micro", "4", "--variants", "t0", "t3", "t4o", "t4o1", "--rounds", "1", "--out", str(out)],
                       cwd=REPO, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    rows = json.loads(out.with_suffix(".json").read_text())
    runs = rows[0]["runs"]
    assert set(runs) == {"plain", "t0", "t3", "t4o", "t4o1"}
    for v, recs in runs.items():
        assert all(r.get("tokens_per_s", 0) > 0 for r in recs), (v, recs)
    lines = out.read_text().splitlines()
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    line = next(ln for ln in lines if ln.startswith("| tiny"))
    cell = dict(zip(head, (c.strip() for c in line.strip().strip("|").split("|"))))
    assert "errors" not in line and cell["micro"] == "4" and cell["global batch"] == "8"
    assert float(cell["t0/plain"].split()[0]) > 0 and float(cell["t3/t0"].split()[0]) > 0
    assert float(cell["t4o/t0"].split()[0]) > 0 and float(cell["t4o1/t0"].split()[0]) > 0
    assert "peak t0 / t3 / t4o / t4o1 GiB" in head


def test_grid_table_without_the_plain_loop_or_tier_0():
    """--no-plain with only tier 3 and FSDP2 tier 3 (how FSDP2 is measured against flat): the table still has the
    ratio it can compute (f3/t3, per round) and a dash where a variant was not run, instead of failing."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_grid", REPO / "bench" / "bench_grid.py")
    grid = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(grid)
    runs = {"t3": [{"tokens_per_s": 400.0, "peak_GiB": 5.0}, {"tokens_per_s": 300.0, "peak_GiB": 5.0}],
            "f3": [{"tokens_per_s": 200.0, "peak_GiB": 6.0}, {"tokens_per_s": 270.0, "peak_GiB": 6.0}]}
    md = grid.table([{"model": "125m", "shape": "64", "mb": 4, "runs": runs}], ["t3", "f3"])
    head, _, line = md.splitlines()
    cell = dict(zip((c.strip() for c in head.strip("|").split("|")), (c.strip() for c in line.strip("|").split("|"))))
    assert cell["f3/t3"] == "0.700 [0.500-0.900]"  # the median of the per-round ratios 0.5 and 0.9, with their range
    assert cell["t0/plain"] == cell["t3/t0"] == cell["plain"] == "-"
    assert cell["peak t3 / f3 GiB"] == "5.00 / 6.00"


@pytest.mark.parametrize("hf", [False, True])
def test_engine_host_profile_times_both_engines_and_finds_fsdp2_hooks(hf):
    """bench/engine_host_profile.py keeps working, on the own LLaMA and the HF Llama: a time per micro-batch for
    each engine (FSDP2 per block and as one unit), and FSDP2's hooks in its profile (what BENCHMARKS.md's account
    of FSDP2's host time reads)."""
    p = subprocess.run([sys.executable, str(REPO / "bench" / "engine_host_profile.py"), "--layers", "2", "--micro", "2",
                        "--steps", "1", "--top", "40", *(["--hf"] if hf else [])],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    for name in ("flat", "fsdp2", "fsdp2-root"):
        line = next(ln for ln in p.stdout.splitlines() if ln.startswith(f"{name}: "))
        assert float(line.split()[1]) > 0, line
    assert "_fsdp_param_group.py" in p.stdout and "pre_forward" in p.stdout
