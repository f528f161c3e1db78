"""``dettrain panel``: the workspace it builds names only keys the mirror logs in a real offline run; the mirror's
train/eval/perf keys and its default group; the vs-reference summary against an independent ledger comparison."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO, gpu, has_cuda, train
from test_wandb_io import UNSET, wandb_env

from dettrain.config import Config
from dettrain.record.ledger import FP_FIELDS, read_ledger
from dettrain.record.wandb_io import default_group, read_wandb_file, resolve_wandb, row_to_step, step_row, wandb_files
from dettrain.tools.diff import load_run
from dettrain.tools.panel import PANELS, VS_REF_KEYS, panel_keys, vs_reference

pytest.importorskip("wandb_workspaces")

COMMON = ("log.wandb.mode=offline", "exp_name=pexp", "eval.every=2", "eval.batches=2", "data.val_fraction=0.05")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """a: a run; b: its rerun with a live reference (det.reference=a: ref/* keys); c: another learning rate."""
    root = tmp_path_factory.mktemp("panel")
    env = wandb_env(root)
    train(root / "a", *COMMON, env=env, unset_env=UNSET[1:])
    train(root / "b", *COMMON, f"det.reference={root / 'a'}", env=env, unset_env=UNSET[1:])
    train(root / "c", *COMMON, "train.lr=0.002", env=env, unset_env=UNSET[1:])
    return root


def rows_of(run) -> list[dict]:
    (f,) = wandb_files(run)
    return [r for r in read_wandb_file(f)[2] if "fp/param" in r]


def panel(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dettrain.panel", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env=env)


def test_every_key_a_panel_names_is_logged_by_the_mirror(runs, tmp_path):
    """The --dry-run spec (the real CLI, no network) against the keys a real offline run wrote to its .wandb file."""
    header, _ = read_ledger(runs / "a")
    group = header["wandb"]["group"]
    env = {**os.environ, **wandb_env(tmp_path)}
    p = panel("--entity", "me", "--project", "dettrain", "--group", group, "--report", "--dry-run", "--out",
              str(tmp_path / "spec.json"), env=env)
    assert p.returncode == 0, p.stderr
    spec = json.loads((tmp_path / "spec.json").read_text())
    assert spec["group"] == group and spec["workspace"]["entity"] == "me"
    # the view filters the runs of this group, oldest first
    runset = spec["workspace"]["spec"]["section"]["runSets"][0]
    assert {"key": {"section": "run", "name": "group"}, "op": "=", "value": group} in [
        {k: f[k] for k in ("key", "op", "value")} for f in runset["filters"]["filters"]]
    assert runset["sort"]["keys"][0] == {"key": {"section": "run", "name": "createdAt"}, "ascending": True}
    logged = {k for run in ("a", "b") for r in rows_of(runs / run) for k in r}
    for view in ("workspace", "report"):
        keys = panel_keys(spec[view])
        history = {k for k in keys if not k.startswith("summary:")}
        summary = {k.removeprefix("summary:") for k in keys} - history
        assert history and history <= logged, (view, sorted(history - logged))
        assert summary and summary <= set(VS_REF_KEYS), (view, sorted(summary - set(VS_REF_KEYS)))
        # every hash channel of the ledger has its panel; so have the losses and the throughput
        assert {f"fp24/{f}" for f in FP_FIELDS} | {"train/loss", "eval/loss", "perf/tokens_per_s",
                                                   "perf/mfu"} <= history
    assert panel_keys(spec["workspace"]) == {k for p in PANELS for k in p.keys}
    # the summary keys the panels plot are exactly what vs_reference writes
    ra, rb = load_run(str(wandb_files(runs / "a")[0])), load_run(str(wandb_files(runs / "b")[0]))
    assert set(vs_reference(ra, rb, "a")) == set(VS_REF_KEYS)


def test_mirror_logs_train_eval_and_perf_keys(runs):
    _, steps = read_ledger(runs / "a")
    rows = rows_of(runs / "a")
    assert [r["_step"] for r in rows] == [s["step"] for s in steps] == [0, 1, 2, 3]
    for r, s in zip(rows, steps):
        assert (r["train/loss"], r["train/lr"], r["train/grad_norm"]) == (s["loss"], s["lr"], s["grad_norm"])
        assert "loss" not in r and "lr" not in r  # the prefixed names replace the bare ones
        assert ("eval/loss" in r) == ("val_loss" in s) and r.get("eval/loss") == s.get("val_loss")
        assert isinstance(r["perf/tokens_per_s"], float) and r["perf/tokens_per_s"] > 0
        assert "perf/mfu" in r and r["perf/mfu"] is None  # a CPU has no peak: logged as null
    assert sum("eval/loss" in r for r in rows) == 2  # eval.every=2 over 4 steps
    # the live reference's keys, in the rerun that has one
    rows_b = rows_of(runs / "b")
    assert [r["ref/match"] for r in rows_b] == [1, 1, 1, 1] and [r["ref/loss_ulps"] for r in rows_b] == [0] * 4


def test_default_group_is_the_experiment_and_config_hash(runs, tmp_path):
    ha, _ = read_ledger(runs / "a")
    hb, _ = read_ledger(runs / "b")
    hc, _ = read_ledger(runs / "c")
    # b differs from a only in det.reference, which is not in the hash: a rerun shares a's group; c does not
    assert ha["config_hash"] == hb["config_hash"] != hc["config_hash"]
    assert ha["wandb"]["group"] == hb["wandb"]["group"] == f"pexp-{ha['config_hash'][:8]}"
    assert hc["wandb"]["group"] == f"pexp-{hc['config_hash'][:8]}"
    for run, h in (("a", ha), ("c", hc)):  # what the wandb client itself recorded
        (f,) = wandb_files(runs / run)
        assert read_wandb_file(f)[1]["group"] == h["wandb"]["group"]
    # log.wandb.group, then WANDB_RUN_GROUP, beat the default
    cfg = Config()
    cfg.exp_name = "e"
    assert resolve_wandb(cfg, "0123456789abcdef")["group"] == default_group("e", "0123456789abcdef") == "e-01234567"
    cfg.log.wandb.group = "mine"
    assert resolve_wandb(cfg, "0123456789abcdef")["group"] == "mine"
    run = tmp_path / "g"
    train(run, "log.wandb.mode=offline", "log.wandb.group=mine", "train.steps=1", env=wandb_env(tmp_path),
          unset_env=UNSET[1:])
    assert read_ledger(run)[0]["wandb"]["group"] == "mine"
    assert read_wandb_file(wandb_files(run)[0])[1]["group"] == "mine"


def test_vs_reference_agrees_with_the_ledgers(runs):
    """The vs_ref summary, computed from the wandb offline runs, against a plain comparison of the ledgers."""
    ref = load_run(str(wandb_files(runs / "a")[0]))
    same = vs_reference(ref, load_run(str(wandb_files(runs / "b")[0])), "rid")
    assert same == {"vs_ref/reference": "rid", "vs_ref/verdict": "identical", "vs_ref/first_divergence": None,
                    "vs_ref/first_stage": None, "vs_ref/matching_steps": 4, "vs_ref/compared": 4}
    other = vs_reference(ref, load_run(str(wandb_files(runs / "c")[0])), "rid")
    _, la = read_ledger(runs / "a")
    _, lc = read_ledger(runs / "c")
    first = next(x["step"] for x, y in zip(la, lc) if any(x[f] != y[f] for f in FP_FIELDS))
    assert other["vs_ref/verdict"] == "diverged" and other["vs_ref/first_divergence"] == first
    assert other["vs_ref/matching_steps"] == first and other["vs_ref/compared"] == 4
    # the same batches, a different learning rate: the first fingerprint to differ is the parameters'
    assert next(f for f in FP_FIELDS if la[first][f] != lc[first][f]) == "param"
    assert other["vs_ref/first_stage"] is not None


def test_rows_of_older_mirrors_still_read():
    """Rows an older mirror wrote (loss, lr, grad_norm, val_loss unprefixed) read back as the same ledger line."""
    rec = {"kind": "step", "step": 3, "loss": 2.5, "batch": "0" * 16, "loss_bits": "40200000", "grad": "1" * 16,
           "param": "2" * 16, "opt": "3" * 16, "lr": 0.001, "grad_norm": 0.5, "val_loss": 2.25,
           "val_loss_bits": "40100000"}
    new = {**step_row(rec), "_step": 3}
    old = {{"train/loss": "loss", "train/lr": "lr", "train/grad_norm": "grad_norm", "eval/loss": "val_loss"}.get(k, k):
           v for k, v in new.items()}
    assert "loss" in old and "train/loss" not in old
    assert row_to_step(old) == row_to_step(new) == rec


def test_panel_errors_are_one_line(tmp_path):
    env = {**os.environ, **wandb_env(tmp_path)}
    p = panel("--entity", "me", "--project", "p", "--group", "g", env=env)  # online, no key
    assert p.returncode == 2 and "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1
    assert "WANDB_API_KEY" in p.stderr and "--dry-run" in p.stderr
    p = panel("--entity", "me", "--project", "p", "--group", "g", "--dry-run", "--out", str(tmp_path / "a.png"),
              str(tmp_path), str(tmp_path), env=env)
    assert p.returncode == 2 and "drop --dry-run" in p.stderr and "Traceback" not in p.stderr
    p = panel(str(tmp_path), "--out", str(tmp_path / "a.png"), env=env)
    assert p.returncode == 2 and "at least two" in p.stderr and "Traceback" not in p.stderr
    p = panel(str(tmp_path), str(tmp_path), "--out", str(tmp_path / "a.txt"), env=env)
    assert p.returncode == 2 and ".html" in p.stderr and "Traceback" not in p.stderr
    p = panel("--entity", "me", "--group", "g", "--out", str(tmp_path / "x.json"), env=env)
    assert p.returncode == 2 and "--dry-run" in p.stderr and not (tmp_path / "x.json").exists()
    # --dry-run --out never replaces a user's file without --force
    mine = tmp_path / "mine.json"
    mine.write_text("keep me")
    p = panel("--entity", "me", "--group", "g", "--dry-run", "--out", str(mine), env=env)
    assert p.returncode == 2 and "--force" in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert mine.read_text() == "keep me" and sorted(x.name for x in tmp_path.iterdir() if "mine" in x.name) == \
        ["mine.json"]
    p = panel("--entity", "me", "--group", "g", "--dry-run", "--out", str(mine), "--force", env=env)
    assert p.returncode == 0 and json.loads(mine.read_text())["group"] == "g", p.stderr


@gpu
def test_mfu_is_logged_on_a_gpu_with_a_known_peak(tmp_path):
    import torch

    from dettrain.record.wandb_io import peak_flops

    pytest.importorskip("triton")
    assert has_cuda()
    peak = peak_flops(torch.cuda.get_device_name(0))
    if peak is None:
        pytest.skip(f"no bf16 peak known for {torch.cuda.get_device_name(0)} (wandb_io.PEAK_BF16_FLOPS)")
    run = tmp_path / "g"
    train(run, "log.wandb.mode=offline", "det.tier=3", "train.precision=bf16", "model.vocab_size=512",
          env=wandb_env(tmp_path), unset_env=UNSET[1:])
    header, _ = read_ledger(run)
    assert header["device"].startswith("cuda")
    rows = rows_of(run)
    timed = [r for r in rows if "perf/tokens_per_s" in r]
    # train.compile=auto compiles on CUDA: the first step's time is compile time and carries no perf/* keys
    assert len(timed) >= len(rows) - 1 >= 3
    for r in timed:
        tok_s, got = r["perf/tokens_per_s"], r["perf/mfu"]
        assert isinstance(got, float) and 0 < got < 1
        assert got == pytest.approx(6 * header["n_params"] * tok_s / (header["world_size"] * peak), rel=1e-12)


def test_dry_run_without_a_group_shows_every_dettrain_run_of_the_project(tmp_path):
    p = panel("--entity", "me", "--project", "p", "--dry-run", env={**os.environ, **wandb_env(tmp_path)})
    assert p.returncode == 0, p.stderr
    spec = json.loads(p.stdout)
    runset = spec["workspace"]["spec"]["section"]["runSets"][0]
    assert spec["group"] is None
    assert [{k: f[k] for k in ("key", "op", "value")} for f in runset["filters"]["filters"]] == [
        {"key": {"section": "run", "name": "jobType"}, "op": "=", "value": "train"}]


def test_panel_draws_run_dirs_without_a_server(runs, tmp_path):
    """panel A B C --out page.html|picture.png: the loss and each fingerprint's agreement with A per step, the
    first divergence marked and named (a real matplotlib drawing, no server)."""
    import matplotlib.image

    _, la = read_ledger(runs / "a")
    _, lc = read_ledger(runs / "c")
    first = next(x["step"] for x, y in zip(la, lc) if any(x[f] != y[f] for f in FP_FIELDS))
    args = [str(runs / r) for r in "abc"]
    p = panel(*args, "--out", str(tmp_path / "r.html"))
    assert p.returncode == 0, p.stderr
    assert f"{runs / 'b'}: identical" in p.stdout and f"{runs / 'c'}: diverged at step {first}" in p.stdout
    page = (tmp_path / "r.html").read_text()
    assert page.count("<svg") == 1 and f"first divergence at step {first}" in page
    assert f"<td>{runs / 'c'}</td><td>diverged</td><td>4</td><td>{first}</td>" in page
    p = panel(*args, "--out", str(tmp_path / "r.png"))
    assert p.returncode == 0, p.stderr
    img = matplotlib.image.imread(tmp_path / "r.png")[..., :3]
    red = ((img[..., 0] > 0.6) & (img[..., 1] < 0.35)).sum()
    green = ((img[..., 1] > 0.5) & (img[..., 0] < 0.35)).sum()
    assert red > 100 and green > 100, (red, green)  # c's cells after the divergence, b's and c's before it
    again = panel(*args, "--out", str(tmp_path / "r.png"))
    assert again.returncode == 2 and "--force" in again.stderr
