"""Ctrl-C (SIGINT) is a preemption request like SIGTERM: checkpoint after the current step, exit 75, resumable to
the uninterrupted ledger; one that lands during a save leaves no ``.tmp``; a second Ctrl-C aborts at once and what
was written stays readable and resumable.  Real processes: ``python -m dettrain`` and torchrun on Gloo."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, TINY, step_fields, train

from dettrain.record.ledger import LEDGER_NAME, read_ledger

TESTS = Path(__file__).resolve().parent
STEPS = ["train.steps=30"]


def events(run_dir: Path, kind: str) -> list[dict]:
    lines = (Path(run_dir) / LEDGER_NAME).read_text().splitlines()
    return [e for e in map(json.loads, lines) if e.get("kind") == "event" and e.get("event") == kind]


def status(run_dir: Path) -> int:
    return subprocess.run([sys.executable, "-m", "dettrain.checkpoint", "status", str(run_dir)], cwd=REPO,
                          capture_output=True, text=True, timeout=300).returncode


def popen(run_dir: Path, *overrides: str, nproc: int = 1, env: dict | None = None, tiny: bool = True,
          new_session: bool = False) -> subprocess.Popen:
    """A job like conftest.train, not waited for.  ``new_session``: in a process group of its own, which a test
    signals as a terminal's Ctrl-C does (every process of the foreground group)."""
    args = [*(TINY if tiny else []), f"run_dir={run_dir}", *overrides]
    cmd = ([sys.executable, "-m", "dettrain", *args] if nproc == 1 else
           [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "-m",
            "dettrain", *args])
    full = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    full.pop("DETTRAIN_RUN_ID", None)
    return subprocess.Popen(cmd, cwd=REPO, env=full, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=new_session)


def wait_for(cond, p: subprocess.Popen, what: str, timeout: float = 300, poll: float = 0.01) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if p.poll() is not None:
            raise AssertionError(f"the job ended (rc {p.returncode}) before {what}:\n{p.stdout.read()[-4000:]}")
        if time.monotonic() > deadline:
            p.kill()
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(poll)


def finish(p: subprocess.Popen, timeout: float = 300) -> tuple[int, str]:
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        out, _ = p.communicate()
        raise AssertionError(f"job did not finish:\n{out[-4000:]}") from None
    return p.returncode, out


def n_steps(d: Path) -> int:
    try:
        return len(read_ledger(d)[1])
    except Exception:  # noqa: BLE001 - not there yet
        return 0


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    cache: dict[tuple, list] = {}

    def get(*overrides: str, nproc: int = 1, env: dict | None = None, tiny: bool = True) -> list:
        key = (overrides, nproc, tiny)
        if key not in cache:
            d = tmp_path_factory.mktemp("base") / "run"
            train(d, *STEPS, *overrides, nproc=nproc, env=env, tiny=tiny)
            cache[key] = step_fields(d)
        return cache[key]

    return get


def test_sigint_checkpoints_exits_75_and_resumes(baseline, tmp_path):
    d = tmp_path / "run"
    p = popen(d, *STEPS)
    wait_for(lambda: n_steps(d) >= 2, p, "two steps")
    p.send_signal(signal.SIGINT)
    rc, out = finish(p)
    assert rc == 75, out[-3000:]
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-3000:]
    (ev,) = events(d, "preempted")
    k = ev["step"]
    assert "SIGINT" in ev["reason"] and ev["exit_code"] == 75 and 2 <= k < 30
    assert (d / "checkpoints" / f"step_{k:08d}").is_dir()
    assert [s[0] for s in step_fields(d)] == list(range(k))  # nothing since the checkpoint was lost
    assert status(d) == 75
    train(d, *STEPS, "ckpt.resume=auto")
    assert step_fields(d) == baseline()


def test_a_signal_while_the_next_step_is_in_flight_checkpoints_after_it(baseline, tmp_path):
    """train.overlap_steps=true queues every plain step's successor before reading its line: a Ctrl-C agreed then
    waits for that step (the log says so), checkpoints when nothing is in flight, and resumes to the uninterrupted
    ledger (which overlap_steps does not change)."""
    d = tmp_path / "run"
    p = popen(d, *STEPS, "train.overlap_steps=true")
    wait_for(lambda: n_steps(d) >= 2, p, "two steps")
    p.send_signal(signal.SIGINT)
    rc, out = finish(p)
    assert rc == 75, out[-3000:]
    assert "SIGINT: the next step is in flight (train.overlap_steps); checkpoint after it" in out, out[-3000:]
    (ev,) = events(d, "preempted")
    k = ev["step"]
    assert (d / "checkpoints" / f"step_{k:08d}").is_dir() and 3 <= k < 30
    assert [s[0] for s in step_fields(d)] == list(range(k))  # the step in flight finished and was recorded
    train(d, *STEPS, "ckpt.resume=auto", "train.overlap_steps=true")
    assert step_fields(d) == baseline()


def test_ctrl_c_under_torchrun_checkpoints_every_rank(baseline, tmp_path):
    """A terminal's Ctrl-C: SIGINT to torchrun and both workers at once (their process group); torchrun then
    forwards its own SIGINT to the workers, the same key press.  Every rank checkpoints after the same step."""
    d = tmp_path / "run"
    p = popen(d, *STEPS, "det.tier=3", nproc=2, new_session=True)
    wait_for(lambda: n_steps(d) >= 2, p, "two steps")
    os.killpg(p.pid, signal.SIGINT)
    rc, out = finish(p)
    assert rc != 0, out[-3000:]  # torchrun reports the signal it got as its own failure
    (ev,) = events(d, "preempted")
    k = ev["step"]
    assert "SIGINT" in ev["reason"] and 2 <= k < 30, out[-3000:]
    assert (d / "checkpoints" / f"step_{k:08d}").is_dir()
    assert not list((d / "checkpoints").glob("*.tmp"))
    assert status(d) == 75
    train(d, *STEPS, "det.tier=3", "ckpt.resume=auto", nproc=2)
    assert step_fields(d) == baseline("det.tier=3", nproc=2)


def test_sigint_during_a_save_leaves_no_tmp(baseline, tmp_path):
    """SIGINT while a checkpoint is being written (its .tmp dir exists): the save completes, the run checkpoints
    after the next step and exits 75; no .tmp is left and the resumed run is the uninterrupted one."""
    d = tmp_path / "run"
    p = popen(d, *STEPS, "ckpt.every=1", "ckpt.keep=1")
    ck = d / "checkpoints"
    wait_for(lambda: ck.is_dir() and any(ck.glob("step_*.tmp")), p, "a checkpoint being written", poll=0.001)
    p.send_signal(signal.SIGINT)
    rc, out = finish(p)
    assert rc == 75, out[-3000:]
    assert not list(ck.glob("*.tmp")), sorted(x.name for x in ck.iterdir())
    (ev,) = events(d, "preempted")
    assert (ck / f"step_{ev['step']:08d}").is_dir() and "SIGINT" in ev["reason"]
    train(d, *STEPS, "ckpt.every=1", "ckpt.keep=1", "ckpt.resume=auto")
    assert step_fields(d) == baseline("ckpt.every=1", "ckpt.keep=1")


def test_second_sigint_aborts_at_once_and_the_run_stays_resumable(baseline, tmp_path):
    """The run is held inside a step (its model waits on a gate file), so the first SIGINT's checkpoint cannot
    come: a second SIGINT, later than one key press, ends the process by the signal while it is still held.  The
    ledger stays readable, the last checkpoint good, and ckpt.resume=auto gives the uninterrupted ledger."""
    gate = tmp_path / "gate"
    # the tiny job's data and batch keys (its model.* keys are dettrain's LLaMA's), a custom model that can be held
    model = [*(a for a in TINY if not a.startswith("model.")), "model=custom", "model._target_=custom_models.GatedMLP",
             "model.seq_len=64", f"+model.gate={gate}", "ckpt.every=1", "ckpt.keep=1"]
    env = {"PYTHONPATH": os.pathsep.join([str(TESTS), str(REPO), os.environ.get("PYTHONPATH", "")])}
    d = tmp_path / "run"
    p = popen(d, *STEPS, *model, env=env, tiny=False)
    wait_for(lambda: n_steps(d) >= 2, p, "two steps")
    gate.touch()  # the next forward waits: the run is held inside a step
    wait_for(lambda: Path(f"{gate}.held").exists(), p, "the run held inside a step")
    p.send_signal(signal.SIGINT)
    time.sleep(2.0)  # longer than one key press (dettrain.signals.SAME_PRESS_S)
    assert p.poll() is None, "the first SIGINT must not end a held step"
    p.send_signal(signal.SIGINT)
    rc, out = finish(p, timeout=60)
    assert rc in (-signal.SIGINT, 130), (rc, out[-3000:])  # ended by the signal itself (130 in a shell)
    assert "second Ctrl-C: aborting now" in out
    assert not events(d, "preempted")  # no checkpoint of the held step was attempted
    k = n_steps(d)
    assert [s[0] for s in step_fields(d)] == list(range(k)) and k >= 2  # readable, whole lines
    assert status(d) == 75  # resumable from the last checkpoint
    gate.unlink()
    train(d, *STEPS, *model, "ckpt.resume=auto", env=env, tiny=False)
    assert step_fields(d) == baseline(*model, env=env, tiny=False)
