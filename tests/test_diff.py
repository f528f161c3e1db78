"""python -m dettrain.diff on real runs: identical reruns, seed and lr changes, the live check in warn mode, torn
ledgers, per-tensor names, the plot, and bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import REPO, train

from dettrain.fingerprint import combine, fingerprint, format_fp
from dettrain.ledger import read_ledger


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
    a, b, seed, lr = (root / n for n in ("a", "b", "seed", "lr"))
    train(a, "log.tensor_every=1")
    train(b, "log.tensor_every=1")
    train(seed, "seed=1")
    # a live check in warn mode: a changed lr must be caught at step 0 and the run must go on to the end
    p = train(lr, "train.lr=0.001", f"det.reference={a}")
    return {"a": a, "b": b, "seed": seed, "lr": lr, "lr_out": p.stdout + p.stderr, "root": root}


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
    assert p.returncode == 0, p.stderr
    assert "compared the 3 common steps only" in p.stdout


def test_plot_draws_a_png(runs, tmp_path):
    out = tmp_path / "plots" / "div.png"
    p = diff(runs["a"], runs["seed"], "--plot", out)
    assert p.returncode == 1
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


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
