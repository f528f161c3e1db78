"""bench/bench_grid.py keeps working: its CPU mode runs the real CLI and the plain loop on the tiny model and writes
a table whose cells are measured numbers (no run failed), with the ratios the goals name."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO


def test_grid_cpu_mode_measures_every_cell(tmp_path):
    out = tmp_path / "grid.md"
    p = subprocess.run([sys.executable, str(REPO / "bench" / "bench_grid.py"), "--cpu", "--models", "tiny",
                        "--micro", "4", "--variants", "t0", "t3", "t4o", "t0p", "t0w", "--rounds", "1", "--out",
                        str(out)],
                       cwd=REPO, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    rows = json.loads(out.with_suffix(".json").read_text())
    runs = rows[0]["runs"]
    assert set(runs) == {"plain", "t0", "t3", "t4o", "t0p", "t0w"}
    # the wandb mirror ran (offline, its default) in t0w and only there
    assert [v for v, recs in runs.items() if any(r.get("wandb") for r in recs)] == ["t0w"]
    for v, recs in runs.items():
        assert all(r.get("tokens_per_s", 0) > 0 for r in recs), (v, recs)
    assert {r["code"] for recs in runs.values() for r in recs} == {_grid_module().code_id()}  # the code it ran
    lines = out.read_text().splitlines()
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    line = next(ln for ln in lines if ln.startswith("| cpu | tiny"))
    cell = dict(zip(head, (c.strip() for c in line.strip().strip("|").split("|"))))
    assert "errors" not in line and cell["micro"] == "4" and cell["global batch"] == "8" and rows[0]["device"] == "cpu"
    assert float(cell["t0/plain"].split()[0]) > 0 and float(cell["t3/t0"].split()[0]) > 0
    assert float(cell["t4o/t0"].split()[0]) > 0
    assert float(cell["t0p/t0"].split()[0]) > 0  # train.overlap_steps=true through the CLI
    assert float(cell["t0w/t0"].split()[0]) > 0
    assert "peak t0 / t3 / t4o / t0p / t0w GiB" in head

    # --budget 0 starts nothing: an earlier call's rows (--resume) come back whole, the missing cells stay missing
    def grid(*args):
        q = subprocess.run([sys.executable, str(REPO / "bench" / "bench_grid.py"), "--cpu", "--models", "tiny",
                            "--micro", "4", *args], cwd=REPO, capture_output=True, text=True, timeout=600)
        assert q.returncode == 0, q.stdout[-2000:] + q.stderr[-2000:]
        return q.stdout
    said = grid("--variants", "t0", "f3", "--rounds", "2", "--budget", "0", "--resume", str(out.with_suffix(".json")),
                "--out", str(tmp_path / "none.md"))
    assert json.loads((tmp_path / "none.json").read_text()) == rows
    assert "4 runs not started" in said  # f3 in round 1; plain, t0 and f3 in round 2
    # a second call with --resume runs only the rounds a cell lacks (here round 2 of the plain loop and tier 0) and
    # keeps the first call's runs as they were
    grid("--variants", "t0", "--rounds", "2", "--resume", str(out.with_suffix(".json")),
         "--out", str(tmp_path / "2.md"))
    again = json.loads((tmp_path / "2.json").read_text())
    assert len(again) == 1 and {v: len(r) for v, r in again[0]["runs"].items()} == {
        "plain": 2, "t0": 2, "t3": 1, "t4o": 1, "t0p": 1, "t0w": 1}
    assert all(again[0]["runs"][v][0] == runs[v][0] for v in runs)
    assert again[0]["runs"]["t0"][1]["tokens_per_s"] > 0
    assert "t0w" in (tmp_path / "2.md").read_text().splitlines()[0]  # the earlier call's variants stay in the table

    # runs measured on another card are not this card's rounds: the cell is still to measure here (in a row of its
    # own), and the other card's row comes back unchanged
    other = [{**again[0], "device": "NVIDIA H200"}]
    (tmp_path / "other.json").write_text(json.dumps(other))
    said = grid("--variants", "t0", "--rounds", "1", "--budget", "0", "--resume", str(tmp_path / "other.json"),
                "--out", str(tmp_path / "3.md"))
    assert "2 runs not started" in said  # the plain loop and tier 0 of the CPU's cell
    both = json.loads((tmp_path / "3.json").read_text())
    assert [r["device"] for r in both] == ["NVIDIA H200", "cpu"] and both[0] == other[0] and both[1]["runs"] == {}
    shown = [ln.split("|")[1].strip() for ln in (tmp_path / "3.md").read_text().splitlines()[2:]]
    assert shown == ["NVIDIA H200", "cpu"]


def test_grid_cut_short_keeps_the_runs_it_measured(tmp_path):
    """The .json is rewritten after every run, whole (renamed into place): killed during its second run, the grid
    leaves a readable file holding the first."""
    import signal
    import time

    out = tmp_path / "grid.md"
    p = subprocess.Popen([sys.executable, str(REPO / "bench" / "bench_grid.py"), "--cpu", "--models", "tiny",
                          "--micro", "4", "--variants", "t0", "t3", "--rounds", "1", "--out", str(out)],
                         cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not out.with_suffix(".json").exists() and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert p.poll() is None, "the .json appeared only when the grid had finished"
        os.killpg(p.pid, signal.SIGKILL)
    finally:
        p.wait()
    runs = json.loads(out.with_suffix(".json").read_text())[0]["runs"]
    assert list(runs) == ["plain"] and runs["plain"][0]["tokens_per_s"] > 0


def test_grid_resume_of_a_file_it_did_not_write_is_refused_with_the_file_and_the_fix(tmp_path):
    bad = tmp_path / "grid.json"
    for text in ("{not json", '{"model": "tiny"}'):
        bad.write_text(text)
        p = subprocess.run([sys.executable, str(REPO / "bench" / "bench_grid.py"), "--cpu", "--models", "tiny",
                            "--resume", str(bad)], cwd=REPO, capture_output=True, text=True, timeout=120)
        assert p.returncode != 0 and str(bad) in p.stderr and "leave --resume out" in p.stderr, p.stderr[-2000:]


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


def test_grid_plan_runs_every_cells_first_round_before_any_second(tmp_path):
    """--plan starts nothing and prints the runs in the order a call would start them: round-major by default (so a
    budget that ends a call early leaves every shape measured once), a cell's rounds together with --order cell,
    and rounds an earlier call measured (--resume) left out."""
    def plan(*args):
        p = subprocess.run([sys.executable, str(REPO / "bench" / "bench_grid.py"), "--cpu", "--models", "tiny",
                            "--micro", "1", "4", "--variants", "t0", "--no-plain", "--rounds", "2", "--plan", *args],
                           cwd=REPO, capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr[-2000:]
        return [ln.removeprefix("plan: cpu tiny ") for ln in p.stdout.splitlines() if ln.startswith("plan: cpu tiny")]

    assert plan() == ["mb=1 round 0 t0", "mb=4 round 0 t0", "mb=1 round 1 t0", "mb=4 round 1 t0"]
    assert plan("--order", "cell") == ["mb=1 round 0 t0", "mb=1 round 1 t0", "mb=4 round 0 t0", "mb=4 round 1 t0"]
    done = tmp_path / "grid.json"
    done.write_text(json.dumps([{"device": "cpu", "model": "tiny", "shape": "8", "mb": 4,
                                 "runs": {"t0": [{"tokens_per_s": 1.0, "peak_GiB": None}]}}]))
    assert plan("--resume", str(done)) == ["mb=1 round 0 t0", "mb=1 round 1 t0", "mb=4 round 1 t0"]
    # --remeasure: the resumed runs of a variant are dropped (the code they measured changed), in the cells this call
    # covers only, and the file itself is left as it was
    before = done.read_text()
    p = subprocess.run([sys.executable, str(REPO / "bench" / "bench_grid.py"), "--cpu", "--models", "tiny",
                        "--micro", "4", "--variants", "t0", "--no-plain", "--rounds", "2", "--plan", "--resume",
                        str(done), "--remeasure", "t0"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    lines = p.stdout.splitlines()
    assert "plan: remeasure: cpu tiny mb=4 t0: 1 earlier run(s) dropped" in lines
    assert [ln for ln in lines if ln.startswith("plan: cpu tiny")] == ["plan: cpu tiny mb=4 round 0 t0",
                                                                       "plan: cpu tiny mb=4 round 1 t0"]
    assert done.read_text() == before
    p = subprocess.run([sys.executable, str(REPO / "bench" / "bench_grid.py"), "--cpu", "--remeasure", "t3"],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "--remeasure drops runs of an earlier call: name its .json with --resume" in p.stderr


def test_grid_plan_skips_what_ran_out_of_memory_and_plans_for_a_named_card(tmp_path):
    """A variant that ran out of device memory in one round is not started again in later rounds on that card while
    the code is the same (the same process fails the same way, after its start-up and compile); another error, or
    an out-of-memory of other code, is retried.  ``--card`` plans for another card's rows of the resumed file, and
    only with --plan (a call's runs are keyed by its own card)."""
    card = "NVIDIA H100 80GB HBM3"
    oom = ("exit 1: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.95 GiB. GPU 0 has a total "
           "capacity of 79.18 GiB of which 1.33 GiB is free.")
    code = _grid_module().code_id()
    done = tmp_path / "grid.json"
    done.write_text(json.dumps([{"device": card, "model": "tiny", "shape": "8", "mb": 4,
                                 "runs": {"t0": [{"error": oom, "code": code}],
                                          "t3": [{"error": "timeout after 120 s", "code": code}]}},
                                {"device": card, "model": "tiny", "shape": "8", "mb": 1,
                                 "runs": {"t0": [{"error": oom, "code": "older"}]}}]))

    def plan(*args):
        p = subprocess.run([sys.executable, str(REPO / "bench" / "bench_grid.py"), "--cpu", "--models", "tiny",
                            "--micro", "4", "--variants", "t0", "t3", "--no-plain", "--rounds", "2", "--plan",
                            "--resume", str(done), *args], cwd=REPO, capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr[-2000:]
        return [ln.removeprefix("plan: ") for ln in p.stdout.splitlines() if ln.startswith("plan: ")]

    # mb 1 (other code's out-of-memory): its round 1 t0, then both of round 1 (reverse order); mb 4: t3 (its timeout
    # retried), then t0 (skipped)
    assert plan("--micro", "1", "4", "--card", card) == [
        f"{card} tiny mb=1 round 0 t3", f"{card} tiny mb=1 round 1 t3", f"{card} tiny mb=1 round 1 t0",
        f"{card} tiny mb=4 round 1 t3",
        f"skip: {card} tiny mb=4 round 1 t0: ran out of device memory in an earlier round",
        f"4 runs to start on {card}"]
    # this machine's own rows (cpu) hold nothing: every run is planned
    assert plan()[-1] == "4 runs to start on cpu"
    p = subprocess.run([sys.executable, str(REPO / "bench" / "bench_grid.py"), "--cpu", "--card", card], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "--card only names the card to plan for" in p.stderr


def test_benchmarks_grid_table_is_the_committed_grid():
    """BENCHMARKS.md's grid table shows the runs committed in bench/results/grid.json (the file the next device call
    resumes from): for every cell where all four variants ran, its row has the tokens/s and the ratios that
    bench_grid's own table computes from that file.  A grid.json extended without its table, or a table edited by
    hand away from the measurement, fails here."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_grid", REPO / "bench" / "bench_grid.py")
    grid = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(grid)
    rows = grid.load_rows(str(REPO / "bench" / "results" / "grid.json"))
    variants = ["t0", "t3", "t4", "f3"]
    lines = grid.table(rows, variants).splitlines()
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    doc = (REPO / "BENCHMARKS.md").read_text()
    checked = 0
    for line in lines[2:]:
        cell = dict(zip(head, (c.strip() for c in line.strip().strip("|").split("|"))))
        if any(cell[v] == "-" for v in variants):
            continue
        want = " | ".join([cell["micro"], cell["plain"], *(cell[v] for v in variants), cell["t0/plain"],
                           cell["t3/t0"], cell["t4/t0"], cell["f3/t3"]])
        assert f"| {want} |" in doc.replace("**", ""), (cell["device"], cell["model"], want)
        checked += 1
    assert checked >= 8


def _grid_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_grid", REPO / "bench" / "bench_grid.py")
    grid = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(grid)
    return grid


def test_grid_code_id_follows_the_measured_code_only(tmp_path):
    """Every run records ``code``, a hash of the files its speed depends on (the device's copy of the tree has no
    git history): it changes with a source, a config or the plain loop, and not with the docs, a bytecode cache or
    where the tree lies."""
    grid = _grid_module()
    for rel, text in [("dettrain/a.py", "x = 1\n"), ("dettrain/sub/b.py", "y = 2\n"), ("conf/model/m.yaml", "n: 1\n"),
                      ("bench/plain_loop.py", "# loop\n"), ("pyproject.toml", "[project]\n"), ("README.md", "r\n")]:
        (tmp_path / "t" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "t" / rel).write_text(text)
    root = tmp_path / "t"
    first = grid.code_id(root)
    (root / "README.md").write_text("docs changed\n")
    (root / "dettrain" / "__pycache__").mkdir()
    (root / "dettrain" / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"\0\1")
    assert grid.code_id(root) == first
    import shutil

    shutil.copytree(root, tmp_path / "elsewhere")
    assert grid.code_id(tmp_path / "elsewhere") == first
    for rel in ("dettrain/sub/b.py", "conf/model/m.yaml", "bench/plain_loop.py"):
        before = (root / rel).read_text()
        (root / rel).write_text(before + "# changed\n")
        assert grid.code_id(root) != first, rel
        (root / rel).write_text(before)
        assert grid.code_id(root) == first
    (root / "dettrain" / "sub" / "b.py").rename(root / "dettrain" / "sub" / "c.py")  # same bytes, another file
    assert grid.code_id(root) != first


def test_grid_row_whose_rounds_measured_different_code_says_so():
    """A cell resumed across a code change (round 1 on one code, round 2 on another) keeps both rounds, and its row
    names each code with its number of runs; a cell measured on one code has no such mark."""
    grid = _grid_module()

    def rec(tps, code):
        return {"tokens_per_s": tps, "peak_GiB": 1.0, "code": code}

    mixed = {"device": "cpu", "model": "tiny", "shape": "8", "mb": 4,
             "runs": {"plain": [rec(10.0, "aaa"), rec(11.0, "bbb")], "t0": [rec(12.0, "aaa"), rec(13.0, "bbb")]}}
    one = {"device": "cpu", "model": "tiny", "shape": "8", "mb": 1,
           "runs": {"plain": [rec(10.0, "aaa")], "t0": [rec(12.0, "aaa")]}}
    lines = grid.table([mixed, one], ["t0"]).splitlines()
    assert lines[2].endswith("| code: aaa (2 runs), bbb (2 runs)"), lines[2]
    assert lines[3].endswith("|") and "code:" not in lines[3]


def test_profile_steps_profiles_whole_trainer_steps_after_the_skipped_ones(tmp_path):
    """bench/profile_steps.py runs the CLI in its process and profiles --steps whole steps of the trainer after
    --skip: the trace holds the trainer's own ranges, a forward and a backward per micro-batch of exactly those
    steps and one reduce per step; asking for more steps than the run makes is an error naming the options."""
    import gzip

    from conftest import TINY

    cli = [*[o for o in TINY if not o.startswith("train.steps")], "train.steps=5", "ckpt.final=false",
           "det.tier=3"]
    trace = tmp_path / "t.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, str(REPO / "bench" / "profile_steps.py"), "--trace", str(trace), "--skip",
                        "2", "--steps", "2", "--", *cli, f"run_dir={tmp_path / 'run'}"], cwd=REPO,
                       capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    events = json.loads(gzip.open(f"{trace}.gz", "rt").read())["traceEvents"]
    names = [e["name"] for e in events if e.get("cat") == "user_annotation" and e["name"].startswith("dettrain.")]
    micro = 8 // 2  # TINY: global batch 8, micro-batch 2
    assert names.count("dettrain.forward") == names.count("dettrain.backward") == 2 * micro
    assert names.count("dettrain.reduce") == 2
    assert "profiled steps 2..3 of the trainer" in p.stdout and "dettrain.backward" in p.stdout
    p = subprocess.run([sys.executable, str(REPO / "bench" / "profile_steps.py"), "--trace", str(trace), "--skip",
                        "4", "--steps", "2", "--", *cli, f"run_dir={tmp_path / 'run2'}"], cwd=REPO,
                       capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode != 0 and "fewer than --skip 4 + --steps 2" in p.stderr


def test_host_step_times_every_observer_of_every_step(tmp_path):
    """bench/host_step.py runs the CLI in its process and times, per step, the line's read and each observer the
    trainer runs (the wandb mirror at its default, offline, included): one call a step each."""
    from conftest import TINY

    cli = [*[o for o in TINY if not o.startswith(("train.steps", "log.wandb"))], "train.steps=3", "ckpt.final=false",
           "log.wandb.mode=offline"]  # its default, whatever WANDB_MODE says
    out = tmp_path / "times.json"
    p = subprocess.run([sys.executable, str(REPO / "bench" / "host_step.py"), "--json", str(out), "--", *cli,
                        f"run_dir={tmp_path / 'run'}"], cwd=REPO, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    times = json.loads(out.read_text())
    # Python's garbage collections in the loop (after the first line), if any, timed per generation
    collections = {k: times.pop(k) for k in list(times) if k.startswith("gc generation ")}
    assert set(collections) <= {"gc generation 0", "gc generation 1", "gc generation 2"}
    assert all(t >= 0 for ts in collections.values() for t in ts)
    assert {k: len(v) for k, v in times.items()} == {
        "line (the step's host sync)": 3, "CheckFinite.on_step": 3, "WriteLedger.on_step": 3,
        "MirrorToWandb.on_step": 3, "LogProgress.on_step": 3, "Checkpoint.on_step": 3}
    assert all(t >= 0 for ts in times.values() for t in ts) and "MirrorToWandb.on_step" in p.stdout
    assert (tmp_path / "run" / "wandb").is_dir()  # the mirror ran, offline


def test_every_gpu_session_stage_has_its_own_name():
    """bench/gpu_session.sh runs a stage by the first ``case`` branch of its name: a second branch with the same name
    would never run (a new stage once shadowed the offload tests' ``otests`` this way)."""
    import collections
    import re

    text = (REPO / "bench" / "gpu_session.sh").read_text()
    start = text.index("run_stage() {")
    body = text[start:text.index("\n}\n", start)]
    names = re.findall(r"^    ([A-Za-z0-9_]+)\)", body, re.M)
    assert len(names) > 50 and {"fullgrid", "ovtests", "ovgrid", "otests"} <= set(names)
    assert [n for n, c in collections.Counter(names).items() if c > 1] == []
