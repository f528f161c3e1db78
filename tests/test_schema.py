"""One step-record schema: a fingerprint field appended to record/schema.py's FIELDS, and nowhere else
(tests/schema_extra.py), is in the trainer's ledger and progress line, the library's StepLedger, ``diff``'s table
and first-divergence report, the wandb offline mirror's rows and the runs read back from them, and ``panel``'s
layout and page.  Without the field every tool reads and writes what it did before (the golden tests elsewhere)."""

from __future__ import annotations

import json
import re

import pytest
import torch
from conftest import REPO, train
from schema_extra import extra_field, install, value
from test_wandb_io import UNSET, wandb_env

from dettrain.record import schema
from dettrain.record.ledger import read_ledger, step_error
from dettrain.record.wandb_io import read_wandb_file, row_to_step, wandb_files

SCRIPT = REPO / "tests" / "schema_extra.py"
ARGS = ("train.steps=3", "log.wandb.mode=offline", "exp_name=schema")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """a: a tiny run with the extra field; b: the same run whose extra value parts from a's at step 1."""
    root = tmp_path_factory.mktemp("schema")
    env = wandb_env(root)
    pa = train(root / "a", *ARGS, script=SCRIPT, env=env, unset_env=UNSET[1:])
    train(root / "b", *ARGS, script=SCRIPT, env={**env, "SCHEMA_EXTRA_FLIP": "1"}, unset_env=UNSET[1:])
    return {"a": root / "a", "b": root / "b", "out_a": pa.stdout + pa.stderr, "env": env}


@pytest.fixture
def extra(monkeypatch):
    """The schema of the runs above, in this process."""
    monkeypatch.setattr(schema, "FIELDS", schema.FIELDS)
    install()


def rows_of(run) -> list[dict]:
    (f,) = wandb_files(run)
    return [r for r in read_wandb_file(f)[2] if "fp/param" in r]


def test_trainer_writes_and_prints_the_field(runs, extra):
    _, steps = read_ledger(runs["a"])  # the reader checks the declared field's 16 hex digits
    assert [s["step"] for s in steps] == [0, 1, 2]
    for s in steps:
        assert s["extra"] == f"{value(s, None):016x}"
        assert list(s)[list(s).index("opt") + 1] == "extra"  # after the fields before it, before lr
        assert f"| extra {s['extra'][:8]}" in runs["out_a"]  # the progress line, as param's
    bad = {**steps[0], "extra": "xyz"}
    assert step_error(bad) == "step 0: fingerprint 'extra' must be 16 lowercase hex digits (got \"xyz\")"
    # declared optional: a ledger written before the field still reads
    assert step_error({k: v for k, v in steps[0].items() if k != "extra"}) is None


def test_diff_names_the_field_in_its_table_and_first_divergence(runs, extra, capsys):
    from dettrain.tools.diff import main

    assert main([str(runs["a"]), str(runs["b"])]) == 1
    out = capsys.readouterr().out
    assert "DIVERGED at step 1: extra stage diverged first (data, loss, gradients, parameters, optimizer state " \
           "equal)" in out
    assert "  why: the extra fingerprint differs (the test's own field)" in out
    assert " step |  data loss grad param  opt extra |           loss A           loss B |      ULPs" in out
    table = {int(m[1]): m[2] for m in re.finditer(r"^ +(\d) \| ([=X ]+) \|", out, re.M)}
    assert table == {0: "   =    =    =     =    =     =", 1: "   =    =    =     =    =     X",
                     2: "   =    =    =     =    =     X"}
    assert main([str(runs["a"]), str(runs["a"] / "ledger.jsonl")]) == 0
    assert "IDENTICAL: every fingerprint (data, loss, gradients, parameters, optimizer state, extra stage)" in \
        capsys.readouterr().out


def test_wandb_mirror_logs_the_field_and_reads_it_back(runs, extra, capsys):
    _, steps = read_ledger(runs["a"])
    rows = rows_of(runs["a"])
    assert [r["fp/extra"] for r in rows] == [s["extra"] for s in steps]
    assert [r["fp24/extra"] for r in rows] == [int(s["extra"], 16) & 0xFFFFFF for s in steps]
    assert [row_to_step(r)["extra"] for r in rows] == [s["extra"] for s in steps]
    from dettrain.tools.diff import main

    (fa,), (fb,) = wandb_files(runs["a"]), wandb_files(runs["b"])
    assert main([str(fa), str(fb), "--json"]) == 1
    res = json.loads(capsys.readouterr().out)
    assert (res["first_divergence"], res["first_field"], res["first_stage"]) == (1, "extra", "extra stage")


def test_panel_has_the_fields_channel_and_stage(runs, extra, tmp_path, monkeypatch, capsys):
    pytest.importorskip("wandb_workspaces")
    pytest.importorskip("matplotlib")
    from dettrain.tools.panel import main, panel_keys, spec

    for k, v in runs["env"].items():
        monkeypatch.setenv(k, v)
    s = spec("me", "dettrain", "g", report=True)
    assert {"section": "fingerprints", "title": "extra (low 24 bits)", "type": "line", "keys": ["fp24/extra"]} in \
        s["panels"]
    logged = {k for r in rows_of(runs["a"]) for k in r}
    for view in ("workspace", "report"):
        assert "fp24/extra" in panel_keys(s[view]) and "fp24/extra" in logged
    page = tmp_path / "p.html"
    assert main([str(runs["a"]), str(runs["b"]), "--out", str(page)]) == 0
    assert "<td>diverged</td><td>3</td><td>1</td><td>extra stage</td>" in page.read_text()


def test_step_ledger_writes_and_mirrors_the_field(tmp_path, monkeypatch):
    """The library's own-loop ledger (one process, no process group) and its wandb offline mirror."""
    import dettrain

    for k, v in wandb_env(tmp_path).items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(schema, "FIELDS", (*schema.FIELDS, extra_field(flip=1)))
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    led = dettrain.StepLedger(tmp_path / "own" / "ledger.jsonl", model, opt, config={"run": "own"},
                              wandb={"mode": "offline"})
    for step in range(2):
        loss = model(torch.ones(3, 4)).square().mean()
        loss.backward()
        opt.step()
        led.log(step, loss=loss.item(), batch=torch.arange(6))
        opt.zero_grad()
    led.close()
    _, steps = read_ledger(tmp_path / "own")
    assert [s["extra"] for s in steps] == [f"{value(s, 1):016x}" for s in steps]
    assert [r["fp/extra"] for r in rows_of(tmp_path / "own")] == [s["extra"] for s in steps]
