"""python -m dettrain.diff on real runs: identical reruns; a seed, lr, norm_eps or world-size change each blamed on
the stage that really diverged first; the live check in warn mode; torn ledgers; ledgers that do not hold the same
steps each once (shorter, gapped, duplicated, stitched wandb runs); schema-invalid lines; a closed pipe; per-tensor
names; the plot; bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import REPO, train

from dettrain.record.fingerprint import combine, fingerprint, format_fp
from dettrain.record.ledger import read_ledger


def diff(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dettrain.diff", *map(str, args)], cwd=REPO, capture_output=True,
                          text=True, timeout=300, env={**os.environ, **(env or {})})


def diff_json(a, b) -> tuple[int, dict]:
    p = diff(a, b, "--json")
    assert p.returncode in (0, 1), p.stderr
    return p.returncode, json.loads(p.stdout)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("diff")
    a, b, seed, lr, eps, w2 = (root / n for n in ("a", "b", "seed", "lr", "eps", "w2"))
    train(a, "det.tier=3", "ckpt.final=false", "log.tensor_every=1")
    train(b, "det.tier=3", "ckpt.final=false", "log.tensor_every=1")
    train(seed, "det.tier=3", "ckpt.final=false", "seed=1")
    # a live check in warn mode: a changed lr must be caught at step 0 and the run must go on to the end
    p = train(lr, "det.tier=3", "ckpt.final=false", "train.lr=0.001", f"det.reference={a}")
    train(eps, "det.tier=3", "ckpt.final=false", "model.norm_eps=0.01")  # same batches and init, another forward
    train(w2, "det.tier=3", "ckpt.final=false", "log.tensor_every=1", nproc=2)  # tier 3 is not world-size invariant
    return {"a": a, "b": b, "seed": seed, "lr": lr, "lr_out": p.stdout + p.stderr, "root": root, "eps": eps,
            "w2": w2}


def test_identical_reruns_exit_0(runs):
    p = diff(runs["a"], runs["b"])
    assert p.returncode == 0, p.stdout + p.stderr
    assert "IDENTICAL" in p.stdout and "4 compared steps" in p.stdout
    rc, res = diff_json(runs["a"], runs["b"])
    assert rc == 0 and res["identical"] and res["compared"] == 4 and res["first_divergence"] is None


def test_seed_change_diverges_at_step_0_in_data_and_params(runs):
    p = diff(runs["a"], runs["seed"])
    assert p.returncode == 1
    assert "DIVERGED at step 0: data diverged first" in p.stdout
    _, res = diff_json(runs["a"], runs["seed"])
    assert ["seed", 0, 1] in res["config_differences"]  # the header difference that explains it
    assert res["first_divergence"] == 0 and res["first_field"] == "batch"
    assert {"batch", "param"} <= set(res["fields"])  # other samples and another init


def test_lr_change_blames_the_update_not_the_data(runs):
    # the premise, read straight from the ledgers: step 0 trains on the same batch to the same loss and gradient
    _, sa = read_ledger(runs["a"])
    _, sl = read_ledger(runs["lr"])
    assert [sa[0][f] for f in ("batch", "loss_bits", "grad")] == [sl[0][f] for f in ("batch", "loss_bits", "grad")]
    assert sa[0]["param"] != sl[0]["param"]
    p = diff(runs["a"], runs["lr"])
    assert p.returncode == 1
    assert "DIVERGED at step 0: parameters diverged first (data, loss, gradients equal)" in p.stdout
    assert "lr differs" in p.stdout and "train.lr" in p.stdout
    _, res = diff_json(runs["a"], runs["lr"])
    assert res["first_field"] == "param" and not {"batch", "loss_bits", "grad"} & set(res["fields"])
    assert res["loss_ulps"] == 0
    # per-tensor fingerprints: A logs them every step, the live check wrote them at its divergent step
    assert res["tensors"]["grad"] == []
    assert sorted(res["tensors"]["param"]) == sorted(n for n, v in sl[0]["tensors"]["param"].items()
                                                    if sa[0]["tensors"]["param"][n] != v)
    assert res["tensors"]["param"]


def test_live_check_warn_records_the_divergent_step_and_goes_on(runs):
    lr = runs["lr"]
    assert "DIVERGED at step 0" in runs["lr_out"] and "parameters first" in runs["lr_out"]
    lines = [json.loads(x) for x in (lr / "ledger.jsonl").read_text().splitlines()]
    steps = [x for x in lines if x["kind"] == "step"]
    events = [x for x in lines if x["kind"] == "event"]
    assert [s["step"] for s in steps] == [0, 1, 2, 3]  # warn: the run went on
    assert len(events) == 1 and events[0]["step"] == 0 and events[0]["first"] == "param"
    # per-tensor fingerprints only where the check found the divergence (log.tensor_every=0 in this run)
    assert [("tensors" in s) for s in steps] == [True, False, False, False]
    out = lr / "divergence" / "step_000000"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["first"] == "param" and summary["loss_ulps"] == 0
    assert json.loads((out / "tensors.json").read_text())["run"] == steps[0]["tensors"]
    # the saved batch is the step's batch: recompute the ledger's batch fingerprint from the file
    saved = torch.load(out / "batch_rank0.pt")
    m, t1 = saved["tokens"].shape[1:]
    fp = combine(fingerprint(tok, idx * m * t1) for idx, tok in zip(saved["micro_indices"], saved["tokens"]))
    assert format_fp(fp) == steps[0]["batch"]


def test_tensor_names_pinpoint_the_tensor(runs, tmp_path):
    """Change one parameter tensor's fingerprint (and the step total) at step 2: diff names exactly that tensor."""
    lines = (runs["a"] / "ledger.jsonl").read_text().splitlines()
    rec = json.loads(lines[3])  # header, steps 0, 1, then step 2
    assert rec["step"] == 2
    name = sorted(rec["tensors"]["param"])[3]
    rec["tensors"]["param"][name] = format_fp(int(rec["tensors"]["param"][name], 16) ^ 1)
    rec["param"] = format_fp(int(rec["param"], 16) ^ 1)
    lines[3] = json.dumps(rec)
    (tmp_path / "ledger.jsonl").write_text("\n".join(lines) + "\n")
    p = diff(runs["a"], tmp_path / "ledger.jsonl")
    assert p.returncode == 1
    assert f"tensors (param): 1 differ: {name}" in p.stdout and "tensors (grad): 0 differ" in p.stdout
    assert "DIVERGED at step 2: parameters diverged first" in p.stdout


def test_torn_last_line_is_tolerated(runs, tmp_path):
    text = (runs["a"] / "ledger.jsonl").read_text()
    (tmp_path / "extra.jsonl").write_text(text + '{"kind":"step","step":4,"loss":5.1,"los')  # crash mid-write
    p = diff(runs["a"], tmp_path / "extra.jsonl")
    assert p.returncode == 0, p.stderr
    lines = text.splitlines()
    (tmp_path / "cut.jsonl").write_text("\n".join(lines[:-1] + [lines[-1][: len(lines[-1]) // 2]]))
    p = diff(runs["a"], tmp_path / "cut.jsonl")
    assert p.returncode == 1, p.stderr  # 3 of 4 steps: not identical ...
    assert "only in A: 3" in p.stdout and "NOT IDENTICAL" in p.stdout
    p = diff(runs["a"], tmp_path / "cut.jsonl", "--common-only")
    assert p.returncode == 0, p.stderr  # ... unless asked to compare the common steps only
    assert "equal over the 3 common steps (--common-only)" in p.stdout and "IDENTICAL:" in p.stdout


def test_plot_draws_a_png(runs, tmp_path):
    out = tmp_path / "plots" / "div.png"
    p = diff(runs["a"], runs["seed"], "--plot", out)
    assert p.returncode == 1
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_plot_without_matplotlib_names_the_extra_and_compares_nothing(runs, tmp_path):
    # an interpreter where matplotlib is not importable (as on a machine without the plot extra)
    code = ("import sys; sys.modules['matplotlib'] = None; from dettrain.tools.diff import main; "
            f"sys.exit(main([{str(runs['a'])!r}, {str(runs['seed'])!r}, '--plot', {str(tmp_path / 'd.png')!r}]))")
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert "diff --plot needs matplotlib: pip install 'dettrain[plot]'" in p.stderr
    assert p.stdout == "" and not (tmp_path / "d.png").exists()


def test_bad_input_exits_2(runs, tmp_path):
    a = runs["a"]
    empty = tmp_path / "empty"
    empty.mkdir()
    lines = (a / "ledger.jsonl").read_text().splitlines()
    (tmp_path / "mid.jsonl").write_text("\n".join([lines[0], lines[1], "{not json", *lines[2:]]) + "\n")
    (tmp_path / "nohdr.jsonl").write_text("\n".join(lines[1:]) + "\n")
    (tmp_path / "nosteps.jsonl").write_text(lines[0] + "\n")
    cases = [
        (tmp_path / "missing", "no such file or directory"),
        (empty, "without ledger.jsonl"),
        (tmp_path / "mid.jsonl", "line 3 is not valid JSON"),
        (tmp_path / "nohdr.jsonl", "not a dettrain ledger header"),
        (tmp_path / "nosteps.jsonl", "no common steps"),
    ]
    for path, msg in cases:
        p = diff(a, path)
        assert p.returncode == 2, (path, p.stdout, p.stderr)
        assert msg in p.stderr, (path, p.stderr)
    # an online wandb run without an API key: a clear message, no prompt, no network
    env = {"HOME": str(tmp_path), "WANDB_API_KEY": "", "NETRC": str(tmp_path / "none")}
    p = diff(a, "wandb:someone/dettrain/abc123", env=env)
    assert p.returncode == 2 and "API key" in p.stderr
    p = diff(a)
    assert p.returncode == 2  # argparse: missing argument


# ---- each stage named correctly, from real runs ------------------------------------------------------------------
def test_norm_eps_change_blames_the_loss(runs):
    """model.norm_eps changes the forward only: same batch (and init) at step 0, a different loss."""
    _, sa = read_ledger(runs["a"])
    _, se = read_ledger(runs["eps"])
    assert sa[0]["batch"] == se[0]["batch"] and sa[0]["loss_bits"] != se[0]["loss_bits"]  # the premise
    p = diff(runs["a"], runs["eps"])
    assert p.returncode == 1
    assert "DIVERGED at step 0: loss diverged first (data equal)" in p.stdout, p.stdout
    assert "model.norm_eps" in p.stdout
    _, res = diff_json(runs["a"], runs["eps"])
    assert res["first_field"] == "loss_bits" and res["first_stage"] == "loss" and res["loss_ulps"] > 0


def test_tier3_on_one_and_two_ranks_blames_the_gradients(runs):
    """Tier 3 promises the same bits for the same world size only: on 1 vs 2 ranks the batch and the canonical mean
    loss agree, but the reduced gradient is summed in another order (rank-local subtrees), so it differs."""
    ha, sa = read_ledger(runs["a"])
    hw, sw = read_ledger(runs["w2"])
    assert (ha["world_size"], hw["world_size"]) == (1, 2) and ha["config_hash"] == hw["config_hash"]
    assert [sa[0][f] for f in ("batch", "loss_bits")] == [sw[0][f] for f in ("batch", "loss_bits")]  # the premise
    assert sa[0]["grad"] != sw[0]["grad"]
    p = diff(runs["a"], runs["w2"])
    assert p.returncode == 1
    assert "DIVERGED at step 0: gradients diverged first (data, loss equal)" in p.stdout, p.stdout
    _, res = diff_json(runs["a"], runs["w2"])
    assert res["first_field"] == "grad" and res["loss_ulps"] == 0 and res["tensors"]["grad"]
    assert ["world_size", 1, 2] in res["environment_differences"]


# ---- IDENTICAL only for the same steps, each once -------------------------------------------------------------
def _lines(run) -> list[str]:
    return (run / "ledger.jsonl").read_text().splitlines()


def _write(path, lines: list[str]):
    path.write_text("\n".join(lines) + "\n")
    return path


def test_not_the_same_steps_each_once_is_not_identical(runs, tmp_path):
    """Equal fingerprints at every common step, but a shorter, gapped, reordered or duplicated ledger: exit 1 with
    the reason; --common-only compares the common steps (exit 0) unless a step is held twice with different
    fingerprints."""
    a = runs["a"]
    head, *steps = _lines(a)  # 4 step lines, no events (a fresh run)
    changed = json.loads(steps[2])
    changed["param"] = format_fp(int(changed["param"], 16) ^ 1)
    cases = {  # name -> (lines, text in the report, exit with --common-only)
        "shorter": ([head, *steps[:2]], "only in A: 2..3", 0),
        "gap": ([head, steps[0], steps[2], steps[3]], "B has gaps: steps 1 are missing", 0),
        "duplicate": ([head, *steps[:3], steps[2], steps[3]], "B holds steps more than once: 2", 0),
        "reordered": ([head, steps[0], steps[2], steps[1], steps[3]], "not in increasing order", 0),
        # step 2 twice, the later copy equal to A's: "the last copy wins" would call it identical
        "conflicting_duplicate": ([head, steps[0], steps[1], json.dumps(changed), *steps[2:]],
                                  "B holds different fingerprints for the same step: 2", 1),
    }
    for name, (lines, text, rc_common) in cases.items():
        f = _write(tmp_path / f"{name}.jsonl", lines)
        p = diff(a, f)
        assert p.returncode == 1, (name, p.stdout, p.stderr)
        assert text in p.stdout and "\nNOT IDENTICAL: " in p.stdout and "\nIDENTICAL:" not in p.stdout, (name, p.stdout)
        rc, res = diff_json(a, f)
        assert rc == 1 and not res["identical"] and res["first_divergence"] is None, name
        p = diff(a, f, "--common-only")
        assert p.returncode == rc_common, (name, p.stdout)
        assert text in p.stdout, (name, p.stdout)  # still reported


def test_wandb_runs_stitched_in_one_dir_are_not_identical(tmp_path):
    """Two different wandb offline runs (same config, so the same numbers) copied into one dir: the reader keeps
    both runs' steps and diff reports the stitch (exit 1), where it used to let the later run override the earlier
    and call the result identical to either."""
    import shutil

    w1, w2 = tmp_path / "w1", tmp_path / "w2"
    train(w1, "log.wandb.mode=offline", "train.steps=2")
    train(w2, "log.wandb.mode=offline", "train.steps=2")
    both = tmp_path / "both" / "wandb"
    for w in (w1, w2):
        (run_dir,) = (w / "wandb").glob("offline-run-*")
        shutil.copytree(run_dir, both / run_dir.name)
    p = diff(w1 / "wandb", w2 / "wandb")
    assert p.returncode == 0, p.stdout + p.stderr  # each alone: one run, identical to the other
    p = diff(w1, both.parent / "wandb")
    assert p.returncode == 1, p.stdout + p.stderr
    assert "B is stitched from 2 different wandb runs" in p.stdout and "B holds steps more than once: 0..1" in \
        p.stdout, p.stdout


BAD_STEP_LINES = {  # what replaces step 1's line -> what the error must say
    "no_step": (lambda r: r.pop("step"), "step line without 'step'"),
    "step_str": (lambda r: r.update(step="1"), "'step' must be an integer >= 0, got \"1\""),
    "step_float": (lambda r: r.update(step=1.5), "'step' must be an integer >= 0, got 1.5"),
    "step_bool": (lambda r: r.update(step=True), "'step' must be an integer >= 0, got true"),
    "step_negative": (lambda r: r.update(step=-1), "'step' must be an integer >= 0, got -1"),
    "no_grad": (lambda r: r.pop("grad"), "fingerprint 'grad' must be 16 lowercase hex digits (missing)"),
    "no_batch": (lambda r: r.pop("batch"), "fingerprint 'batch' must be 16 lowercase hex digits (missing)"),
    "param_int": (lambda r: r.update(param=5), "fingerprint 'param' must be 16 lowercase hex digits (got 5)"),
    "opt_short": (lambda r: r.update(opt="abc"), "fingerprint 'opt' must be 16 lowercase hex digits"),
    "no_loss_bits": (lambda r: r.pop("loss_bits"), "'loss_bits' must be 8 lowercase hex digits"),
    "loss_str": (lambda r: r.update(loss="5.1"), "'loss' must be a number"),
    "lr_str": (lambda r: r.update(lr="x"), "'lr' must be a number"),
    "tensors_list": (lambda r: r.update(tensors=[1]), "'tensors' must be an object"),
}


def test_schema_invalid_step_lines_exit_2_naming_file_and_line(runs, tmp_path, capsys):
    from dettrain.tools.diff import main

    a = runs["a"]
    head, *steps = _lines(a)
    for name, (change, msg) in BAD_STEP_LINES.items():
        rec = json.loads(steps[1])
        change(rec)
        f = _write(tmp_path / f"{name}.jsonl", [head, steps[0], json.dumps(rec), *steps[2:]])
        assert main([str(a), str(f)]) == 2, name
        err = capsys.readouterr().err
        assert err.startswith(f"dettrain.diff: error: {f}: line 3: ") and msg in err, (name, err)
    # a line that is JSON but not an object
    f = _write(tmp_path / "list.jsonl", [head, steps[0], "[1, 2]", *steps[2:]])
    assert main([str(a), str(f)]) == 2
    assert f"{f}: line 3 is not a JSON object" in capsys.readouterr().err
    p = diff(a, tmp_path / "no_step.jsonl")  # and as a process: one line, no traceback
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "Traceback" not in p.stderr, p.stderr


def test_closed_pipe_ends_quietly_with_the_usual_status(runs, tmp_path):
    """`diff A B | head -1`: the reader goes away after one line; diff ends without a BrokenPipeError traceback and
    with its exit status (0 identical, 1 diverged).  Ledgers of 30000 steps make the report far larger than a pipe's
    buffer, so the write really meets the closed pipe."""
    head, first, *_ = _lines(runs["a"])
    rec = json.loads(first)
    lines = [head] + [json.dumps({**rec, "step": k}) for k in range(30000)]
    same = _write(tmp_path / "same.jsonl", lines)
    rec["param"] = format_fp(int(rec["param"], 16) ^ 1)
    other = _write(tmp_path / "other.jsonl", [*lines[:-1], json.dumps({**rec, "step": 29999})])
    for b, want in ((same, 0), (other, 1)):
        for fmt in ([], ["--json"]):
            cmd = f"{sys.executable} -m dettrain.diff {same} {b} --context 30000 {' '.join(fmt)} | head -1; " \
                  "exit ${PIPESTATUS[0]}"
            p = subprocess.run(["bash", "-c", cmd], cwd=REPO, capture_output=True, text=True, timeout=300)
            assert p.returncode == want, (b, fmt, p.returncode, p.stderr[-2000:])
            assert p.stderr == "", p.stderr[-2000:]
            assert p.stdout.count("\n") == 1


def test_same_ledger_on_both_sides_is_noted(tmp_path):
    """`diff R R` (the same ledger file after resolving paths: run dir vs its ledger, a symlink) still exits 0 but
    says A and B are the same file; a byte-identical copy is another file and gets no such note."""
    run = tmp_path / "run"
    train(run, "train.steps=2")
    link = tmp_path / "link"
    link.symlink_to(run)
    copy = tmp_path / "copy.jsonl"
    copy.write_bytes((run / "ledger.jsonl").read_bytes())
    for a, b in ((run, run), (run, run / "ledger.jsonl"), (link, run)):
        p = diff(a, b)
        assert p.returncode == 0 and "IDENTICAL" in p.stdout, p.stdout + p.stderr
        assert "note: A and B are the same file (" in p.stdout, p.stdout
        rc, res = diff_json(a, b)
        assert rc == 0 and res["same_file"] is True
    p = diff(run, copy)
    assert p.returncode == 0 and "same file" not in p.stdout, p.stdout
    assert diff_json(run, copy)[1]["same_file"] is False


def test_a_trace_a_device_and_a_cut_trace_are_bad_input(tmp_path):
    """A trace against a ledger (either side, a file or the base name of rank files), /dev/null, a trace cut short
    (fewer records than its header counts) and traces of 2 ranks against 1: exit 2, one line, no traceback."""
    step = {"kind": "step", "step": 0, "loss": 1.0, "loss_bits": "3f800000", "batch": "0" * 16, "grad": "0" * 16,
            "param": "0" * 16}
    ledger = tmp_path / "ledger.jsonl"
    ledger.write_text(json.dumps({"kind": "header", "config": {}}) + "\n" + json.dumps(step) + "\n")

    def trace_file(path, n_records: int, rank: int = 0, world: int = 1, write: int | None = None):
        recs = [{"kind": "module", "phase": "forward", "module": f"m{i}", "call": 0, "out": 0, "fp": "0" * 16,
                 "shape": [1], "dtype": "float32"} for i in range(n_records)]
        head = {"kind": "trace_header", "rank": rank, "world": world, "n_records": n_records}
        path.write_text("\n".join(json.dumps(x) for x in [head, *recs[:write]]) + "\n")
        return path

    one = trace_file(tmp_path / "one.jsonl", 3)
    cut = trace_file(tmp_path / "cut.jsonl", 3, write=1)
    for r in (0, 1):
        trace_file(tmp_path / f"two.jsonl.rank{r}", 3, rank=r, world=2)
    cases = [((one, ledger), f"{one} is a trace of one step"), ((ledger, one), f"{one} is a trace of one step"),
             ((ledger, tmp_path / "two.jsonl"), "is a trace of one step"),
             (("/dev/null", ledger), "/dev/null is not a regular file"),
             ((cut, one), f"{cut}: holds 1 of the 3 records its header counts"),
             ((tmp_path / "two.jsonl", one), "compare traces of the same world size")]
    for args, msg in cases:
        p = diff(*args)
        assert p.returncode == 2 and msg in p.stderr and "Traceback" not in p.stderr, (args, p.stdout, p.stderr)
        assert len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert diff(one, one).returncode == 0
