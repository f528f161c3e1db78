"""The wandb mirror and the offline reader, against files the real wandb client wrote (offline, no network)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from conftest import REPO, train

from dettrain.record.ledger import read_ledger
from dettrain.record.wandb_io import read_wandb_file, read_wandb_run, wandb_files


def wandb_env(home, silent: bool = True) -> dict:
    # offline, no key, and a dead server address: nothing here may reach the network
    env = {"HOME": str(home), "WANDB_MODE": "offline", "WANDB_API_KEY": "", "WANDB_BASE_URL": "http://127.0.0.1:9",
           "NETRC": str(home / "none")}
    return {**env, "WANDB_SILENT": "true"} if silent else env


# variables of the developer's shell that would change what these tests see
UNSET = ("WANDB_SILENT", "WANDB_PROJECT", "WANDB_ENTITY", "WANDB_RUN_GROUP", "WANDB_QUIET", "WANDB_CONSOLE")


@pytest.fixture(scope="module")
def wrun(tmp_path_factory):
    root = tmp_path_factory.mktemp("wandb")
    run = root / "run"
    train(run, "log.wandb.mode=offline", "log.tensor_every=2", "exp_name=wexp", env=wandb_env(root))
    return run


def test_offline_run_reads_back_the_ledger(wrun):
    header, steps = read_ledger(wrun)
    wheader, wsteps = read_wandb_run(wrun / "wandb")
    assert len(steps) == 4 and [s["step"] for s in wsteps] == [0, 1, 2, 3]
    # every fingerprint, the loss, lr, grad norm and the per-tensor fingerprints round-trip exactly
    for s, w in zip(steps, wsteps):
        assert {k: v for k, v in w.items() if k != "ref_match"} == s
    assert "tensors" in wsteps[0] and "tensors" not in wsteps[1]
    # the header rides along in the config: the diff sees the same config and environment
    assert wheader["config"] == header["config"]
    assert {k: v for k, v in wheader.items() if k not in ("wandb", "config")} == \
        {k: v for k, v in header.items() if k not in ("wandb", "config")}
    # the resolved wandb settings of the ledger header ride along too
    # the default group: the experiment name and the config hash's prefix (reruns of one config share it)
    group = f"wexp-{header['config_hash'][:8]}"
    assert header["wandb"]["mode"] == "offline" and header["wandb"]["group"] == group
    assert {k: wheader["wandb"][k] for k in ("mode", "mode_from", "project", "group", "verbose")} == \
        {k: header["wandb"][k] for k in ("mode", "mode_from", "project", "group", "verbose")}
    # reruns of one experiment share a group; the job type says what they are
    assert wheader["wandb"]["group"] == group and wheader["wandb"]["job_type"] == "train"
    p = subprocess.run([sys.executable, "-m", "dettrain.diff", str(wrun), str(wandb_files(wrun)[0])], cwd=REPO,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "config: identical" in p.stdout and "environment: identical" in p.stdout


def test_low_bits_are_exact_plottable_numbers(wrun):
    _, steps = read_ledger(wrun)
    _, _, rows = read_wandb_file(wandb_files(wrun)[0])
    rows = [r for r in rows if "fp/param" in r]
    assert len(rows) == len(steps)
    for row, s in zip(rows, steps):
        for f in ("batch", "loss_bits", "grad", "param", "opt"):
            v = row[f"fp24/{f}"]
            assert v == int(s[f][-6:], 16) and float(v) == v and float(v) == float(np.float32(v))


def test_reader_matches_what_the_real_client_logged(tmp_path):
    """Rows bigger than a 32 KiB block (first/middle/last chunks) and many small ones, written by wandb itself."""
    script = textwrap.dedent("""
        import json, sys, wandb
        run = wandb.init(mode="offline", dir=sys.argv[1], project="p", group="g", job_type="j",
                         config={"a": 1, "nested": {"b": [1, 2]}})
        rows = []
        for i in range(300):
            row = {"x": i * 0.1, "s": f"{i:016x}", "i": i}
            if i % 100 == 7:
                row["big"] = "y" * (40_000 + i)
            run.log(row, step=i)
            rows.append(row)
        run.finish()
        json.dump(rows, open(sys.argv[2], "w"))
    """)
    (tmp_path / "w.py").write_text(script)
    subprocess.run([sys.executable, str(tmp_path / "w.py"), str(tmp_path), str(tmp_path / "rows.json")],
                   check=True, capture_output=True, env={**os.environ, **wandb_env(tmp_path)}, timeout=300)
    logged = json.loads((tmp_path / "rows.json").read_text())
    (f,) = wandb_files(tmp_path / "wandb")
    assert f.stat().st_size > 3 * 32 * 1024
    config, meta, rows = read_wandb_file(f)
    assert config["a"] == 1 and config["nested"] == {"b": [1, 2]}
    assert meta["group"] == "g" and meta["job_type"] == "j" and meta["project"] == "p"
    assert [{k: r[k] for k in want} for r, want in zip(rows, logged)] == logged
    assert [r["_step"] for r in rows] == list(range(300))


def test_torn_and_damaged_wandb_files(wrun, tmp_path):
    _, steps = read_ledger(wrun)
    data = wandb_files(wrun)[0].read_bytes()
    # killed mid-write: any cut is tolerated and yields a prefix of the steps
    for cut in (len(data) - 1, len(data) - 200, len(data) // 2):
        (tmp_path / "torn.wandb").write_bytes(data[:cut])
        _, _, rows = read_wandb_file(tmp_path / "torn.wandb")
        got = [r["fp/param"] for r in rows if "fp/param" in r]
        assert got == [s["param"] for s in steps[: len(got)]]
    bad = bytearray(data)
    bad[40] ^= 0xFF  # inside the first record, far from the tail
    (tmp_path / "bad.wandb").write_bytes(bytes(bad))
    with pytest.raises(ValueError, match="corrupt record"):
        read_wandb_file(tmp_path / "bad.wandb")
    (tmp_path / "magic.wandb").write_bytes(b"not a wandb file")
    p = subprocess.run([sys.executable, "-m", "dettrain.diff", str(wrun), str(tmp_path / "magic.wandb")], cwd=REPO,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and "not a wandb record log" in p.stderr


def test_wandb_failure_never_stops_the_run(tmp_path):
    """wandb.init fails on rank 0 (its directory is a file): both ranks finish and the ledger has every step."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "wandb").write_text("in the way")
    p = train(run, "log.wandb.mode=offline", nproc=2, env=wandb_env(tmp_path))
    assert "wandb: could not start the mirror" in p.stdout
    _, steps = read_ledger(run)
    assert [s["step"] for s in steps] == [0, 1, 2, 3]


def test_online_without_a_key_falls_back_to_offline(tmp_path):
    """log.wandb.mode=online with no API key: a warning, then the same mirror offline; the run is unaffected."""
    env = {k: v for k, v in wandb_env(tmp_path).items() if k != "WANDB_MODE"}  # let dettrain ask for online
    run = tmp_path / "run"
    p = train(run, "log.wandb.mode=online", "train.steps=2", env=env)
    assert "wandb: online mode failed" in p.stdout
    _, steps = read_ledger(run)
    _, wsteps = read_wandb_run(run)
    assert len(steps) == 2 and wsteps == steps


# ---- the environment, quiet wandb, step numbers --------------------------------------------------------------
@pytest.fixture(scope="module")
def envrun(tmp_path_factory):
    """log.wandb.mode unset (null): WANDB_MODE=offline and WANDB_PROJECT=x from the environment; WANDB_SILENT
    unset, so only dettrain can keep wandb quiet; checkpoints every 2 steps."""
    root = tmp_path_factory.mktemp("wenv")
    run = root / "run"
    env = {**wandb_env(root, silent=False), "WANDB_PROJECT": "x"}
    p = train(run, "log.wandb.mode=null", "ckpt.every=2", env=env, unset_env=UNSET[:1] + UNSET[2:])
    return run, p


def test_wandb_mode_and_project_come_from_the_environment(envrun):
    run, _ = envrun
    header, _ = read_ledger(run)
    assert header["wandb"]["mode"] == "offline" and header["wandb"]["mode_from"] == "WANDB_MODE"
    assert header["wandb"]["project"] == "x"
    (f,) = wandb_files(run)
    _, meta, _ = read_wandb_file(f)
    assert meta["project"] == "x"  # what the wandb client itself recorded for the run


def test_offline_wandb_is_quiet_by_default(envrun):
    _, p = envrun
    out = p.stdout + p.stderr
    assert "wandb:" not in out, out[-3000:]
    assert "step " in p.stdout  # dettrain's own lines are there


def test_explicit_keys_beat_the_environment_and_verbose_lets_wandb_talk(tmp_path):
    run = tmp_path / "run"
    env = {**wandb_env(tmp_path, silent=False), "WANDB_MODE": "disabled", "WANDB_PROJECT": "x"}
    p = train(run, "log.wandb.mode=offline", "log.wandb.project=mine", "log.wandb.verbose=true", "train.steps=1",
              env=env, unset_env=UNSET[:1] + UNSET[2:])
    header, _ = read_ledger(run)
    assert header["wandb"]["mode"] == "offline" and header["wandb"]["mode_from"] == "log.wandb.mode"
    (f,) = wandb_files(run)
    assert read_wandb_file(f)[1]["project"] == "mine" and header["wandb"]["project"] == "mine"
    assert "wandb:" in p.stdout + p.stderr  # the banner and the offline sync hint


def test_wandb_mode_disabled_in_the_environment_writes_no_wandb_dir(tmp_path):
    run = tmp_path / "run"
    train(run, "log.wandb.mode=null", "train.steps=1", env={**wandb_env(tmp_path), "WANDB_MODE": "disabled"})
    assert not (run / "wandb").exists()
    header, steps = read_ledger(run)
    assert header["wandb"]["mode"] == "disabled" and len(steps) == 1
    bad = train(tmp_path / "bad", "log.wandb.mode=null", env={**wandb_env(tmp_path), "WANDB_MODE": "sometimes"},
                check=False)
    assert bad.returncode == 2 and "WANDB_MODE='sometimes'" in bad.stdout + bad.stderr


def test_step_numbers_agree_in_console_ledger_wandb_and_checkpoints(envrun):
    """Ledger step k is the k-th optimizer step (0-based); wandb logs it at step k; the console line of that step
    starts 'step k (k+1/N)'; a checkpoint step_n holds the state after n steps: a resumed run writes ledger step n
    next, and its ledger event says step n."""
    run, p = envrun
    _, steps = read_ledger(run)
    ks = [s["step"] for s in steps]
    assert ks == [0, 1, 2, 3]
    _, _, rows = read_wandb_file(wandb_files(run)[0])
    assert [r["_step"] for r in rows if "fp/param" in r] == ks
    console = [line.split("|")[0].strip() for line in p.stdout.splitlines() if line.startswith("step ")]
    assert [" ".join(c.split()) for c in console] == [f"step {k} ({k + 1}/4)" for k in ks]
    events = [json.loads(x) for x in (run / "ledger.jsonl").read_text().splitlines()]
    ck = [e["step"] for e in events if e.get("event") == "checkpoint"]
    assert ck == [2, 4]
    assert sorted(d.name for d in (run / "checkpoints").iterdir() if d.name.startswith("step_")) == \
        [f"step_{n:08d}" for n in ck]


# ---- names, tags, notes, the step axis, resuming ---------------------------------------------------------------
def _run_records(f) -> tuple[object, list]:
    """(the run record, the metric records) of one .wandb file."""
    from dettrain.record.wandb_io import iter_records

    recs = list(iter_records(f))
    (run,) = [r.run for r in recs if r.WhichOneof("record_type") == "run"]
    return run, [r.metric for r in recs if r.WhichOneof("record_type") == "metric"]


def test_resumed_run_continues_its_wandb_run_without_logging_steps_twice(tmp_path):
    """Stopped after step 3 with checkpoints at 2 and 4, resumed from step 2: the wandb run (one id) holds each
    step once, 0-3 from the first attempt and 4-5 from the second; names, tags and notes come from the keys, else
    WANDB_NAME / WANDB_TAGS; every channel is plotted against train/step."""
    run = tmp_path / "run"
    job = ("train.steps=6", "ckpt.every=2", "ckpt.keep=3", "log.wandb.mode=offline")
    env = {**wandb_env(tmp_path), "WANDB_NAME": "from-env", "WANDB_TAGS": "a, b"}
    train(run, *job, "train.stop_after=3", "log.wandb.notes=first attempt", env=env, unset_env=UNSET[2:])
    train(run, *job, f"ckpt.resume={run / 'checkpoints' / 'step_00000002'}", "log.wandb.name=from-key",
          "log.wandb.tags=[c]", env=env, unset_env=UNSET[2:])
    first, second = wandb_files(run)
    (rows1, rows2) = (read_wandb_file(f)[2] for f in (first, second))
    assert [r["_step"] for r in rows1] == [0, 1, 2, 3] and [r["_step"] for r in rows2] == [4, 5]
    assert all(r["train/step"] == r["_step"] for r in rows1 + rows2)
    (run1, metrics), (run2, _) = _run_records(first), _run_records(second)
    assert run1.run_id == run2.run_id
    assert (run1.display_name, list(run1.tags), run1.notes) == ("from-env", ["a", "b", "tier3", "world1"],
                                                                "first attempt")
    assert (run2.display_name, list(run2.tags)) == ("from-key", ["c", "tier3", "world1"])
    stepped = {m.glob_name: m.step_metric for m in metrics if m.glob_name}
    assert stepped == {k: "train/step" for k in ("train/*", "eval/*", "perf/*", "fp/*", "fp24/*", "ref/*")}
    _, steps = read_ledger(run)
    _, wsteps = read_wandb_run(run)
    assert [s["step"] for s in steps] == list(range(6)) and wsteps == steps


def test_mirror_finish_waits_for_the_runs_file_to_hold_every_record(wrun, tmp_path, caplog):
    """wandb's run.finish() returns once its sender has the exit record, while its writer may still hold the records
    of a short run back: the .wandb file can hold its header alone for a moment (seen in the suite: a StepLedger
    read back right after close() found no steps).  WandbMirror waits until the file ends in the exit record, so a
    reader in the same process sees every step; a file that never completes ends the wait at the mirror's timeout
    with a warning naming it.  Here the trainer's real offline file is written back in stages by a thread."""
    import logging
    import threading
    import time
    import types

    from dettrain.record.wandb_io import WandbMirror, _iter_payloads, ends_in_exit, iter_records

    (src,) = wandb_files(wrun / "wandb")
    data = src.read_bytes()
    assert ends_in_exit(src)
    # the first part ends 3 bytes into the record after the first history row: rows, but not all of them
    kinds = [r.WhichOneof("record_type") for r in iter_records(src)]
    cut = [pos for _, pos in _iter_payloads(src)][kinds.index("history")] + 3
    assert kinds.count("history") == 4 and cut < len(data)
    late = tmp_path / "run-late.wandb"
    late.write_bytes(data[:7])  # what the file holds until wandb's writer catches up: the header
    assert not ends_in_exit(late)

    def write_late():
        time.sleep(0.2)
        with open(late, "ab") as f:  # the records arrive in two parts, the first one cut inside a record
            f.write(data[7:cut])
            f.flush()
            time.sleep(0.2)
            f.write(data[cut:])

    mirror = WandbMirror(types.SimpleNamespace(settings=types.SimpleNamespace(sync_file=str(late))), timeout_s=30)
    t = threading.Thread(target=write_late)
    t.start()
    try:
        assert mirror.await_file(time.monotonic() + 30)
        assert late.read_bytes() == data  # it returned only once the whole file was there
    finally:
        t.join()
    assert read_wandb_file(late)[2] == read_wandb_file(src)[2]

    stuck = tmp_path / "run-stuck.wandb"
    stuck.write_bytes(data[: len(data) // 2])
    mirror = WandbMirror(types.SimpleNamespace(settings=types.SimpleNamespace(sync_file=str(stuck))), timeout_s=0.3)
    with caplog.at_level(logging.WARNING, logger="dettrain"):
        assert not mirror.await_file(time.monotonic() + 0.3)
    assert str(stuck) in caplog.text and "log.wandb.timeout_s=0.3" in caplog.text
