"""Run-dir safety (rundir.py): one run per run dir, no silent overwrite, multirun jobs apart, resume checks the
ledger, clear errors for unwritable/full/read-only run dirs, early signals.  Real `python -m dettrain` processes."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, TINY, step_fields, train

from dettrain.record.ledger import LEDGER_NAME, read_ledger
from dettrain.record.rundir import LOCK_NAME, OVERWRITTEN_DIR


def popen(run_dir: Path, *overrides: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    env.pop("DETTRAIN_RUN_ID", None)
    return subprocess.Popen([sys.executable, "-m", "dettrain", *TINY, f"run_dir={run_dir}", *overrides], cwd=REPO,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_for(cond, p: subprocess.Popen, what: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if p.poll() is not None:
            raise AssertionError(f"the job ended (rc {p.returncode}) before {what}:\n{p.stdout.read()[-3000:]}")
        if time.monotonic() > deadline:
            p.kill()
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def has_steps(d: Path) -> bool:
    try:
        return len(read_ledger(d)[1]) > 0
    except ValueError:
        return False


def one_line_error(p: subprocess.CompletedProcess, *needles: str) -> None:
    """Exit 2, each needle in stderr, no traceback."""
    assert p.returncode == 2, (p.returncode, p.stderr[-3000:])
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    for n in needles:
        assert n in p.stderr, (n, p.stderr[-3000:])


# ---- one run per run dir -----------------------------------------------------------------------------------
def test_second_run_is_refused_while_the_first_holds_the_run_dir(tmp_path):
    """A runs (frozen by SIGSTOP once it has written a step, so it surely holds the dir); B, on 2 ranks, is refused
    with exit 2 on every rank, naming the dir and A's pid, and touches nothing; after A dies by SIGKILL its lock
    is gone with it and a new run proceeds."""
    d = tmp_path / "run"
    a = popen(d, "train.steps=400")
    try:
        wait_for(lambda: has_steps(d), a, "A's first step")
        os.kill(a.pid, signal.SIGSTOP)
        before = {p.relative_to(d): p.read_bytes() for p in d.rglob("*") if p.is_file()}
        b = train(d, nproc=2, check=False, timeout=300)
        assert b.returncode != 0
        assert f"run_dir {d} is in use by another dettrain run" in b.stderr, b.stderr[-3000:]
        assert f"pid {a.pid}" in b.stderr
        assert b.stderr.count("is in use by another dettrain run") >= 2  # both ranks were told, neither hung
        after = {p.relative_to(d): p.read_bytes() for p in d.rglob("*") if p.is_file()}
        assert after == before  # B wrote nothing: not its config, not its logs, not the ledger
        os.kill(a.pid, signal.SIGKILL)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(a.pid, signal.SIGKILL)
        a.communicate()
    assert json.loads((d / LOCK_NAME).read_text())["pid"] == a.pid  # the file stays; the lock died with A
    train(d, "ckpt.overwrite=true")
    assert [s[0] for s in step_fields(d)] == [0, 1, 2, 3]


# ---- no silent overwrite -----------------------------------------------------------------------------------
def test_fresh_run_refuses_an_existing_ledger_and_overwrite_moves_it_aside(tmp_path):
    d = tmp_path / "run"
    train(d)
    old = (d / LEDGER_NAME).read_bytes()
    p = train(d, "seed=1", check=False)
    one_line_error(p, f"run_dir {d}", "4 step lines", "ckpt.resume=auto", "run_dir=", "ckpt.overwrite=true")
    assert (d / LEDGER_NAME).read_bytes() == old
    train(d, "seed=1", "ckpt.overwrite=true")
    (moved,) = (d / OVERWRITTEN_DIR).iterdir()
    assert (moved / LEDGER_NAME).read_bytes() == old  # kept, byte for byte
    assert (moved / "config.yaml").is_file() and (moved / "logs" / "rank0.log").is_file()
    head, steps = read_ledger(d)
    assert head["config"]["seed"] == 1 and [s["step"] for s in steps] == [0, 1, 2, 3]


def test_fresh_run_refuses_a_run_dir_with_checkpoints_only(tmp_path):
    """The ledger gone, checkpoints left: a fresh run would prune them (ckpt.keep); refused as well."""
    d = tmp_path / "run"
    train(d, "train.stop_after=1")
    (d / LEDGER_NAME).unlink()
    one_line_error(train(d, check=False), "1 checkpoints in", "ckpt.overwrite=true")
    assert (d / "checkpoints" / "step_00000002").is_dir()


def test_multirun_jobs_sharing_a_run_id_get_their_own_run_dirs(tmp_path):
    """`python -m dettrain -m seed=0,1` with one DETTRAIN_RUN_ID: job N in outputs/<exp>/<id>/<N>, both complete."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
           "DETTRAIN_RUN_ID": "shared"}
    p = subprocess.run([sys.executable, "-m", "dettrain", "-m", *TINY, "seed=0,1"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    root = tmp_path / "outputs" / "default" / "shared"
    assert sorted(x.name for x in root.iterdir()) == ["0", "1"]
    heads = {}
    for job in ("0", "1"):
        heads[job], steps = read_ledger(root / job)
        assert [s["step"] for s in steps] == [0, 1, 2, 3]
    assert (heads["0"]["config"]["seed"], heads["1"]["config"]["seed"]) == (0, 1)
    assert step_fields(root / "0") != step_fields(root / "1")


def test_multirun_sweep_puts_its_jobs_under_one_sweep_dir(tmp_path):
    """`python -m dettrain -m seed=0,1` without DETTRAIN_RUN_ID: both jobs under one outputs/<exp>/<sweep id>/,
    as 0/ and 1/ (not two timestamp dirs), each with its own complete ledger of its own seed."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-m", "dettrain", "-m", *TINY, "train.steps=2", "seed=0,1"], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    sweeps = list((tmp_path / "outputs" / "default").iterdir())
    assert len(sweeps) == 1, sweeps
    assert sorted(x.name for x in sweeps[0].iterdir()) == ["0", "1"]
    heads = {job: read_ledger(sweeps[0] / job) for job in ("0", "1")}
    assert all([s["step"] for s in steps] == [0, 1] for _, steps in heads.values())
    assert (heads["0"][0]["config"]["seed"], heads["1"][0]["config"]["seed"]) == (0, 1)
    assert step_fields(sweeps[0] / "0") != step_fields(sweeps[0] / "1")


# ---- resume checks the ledger ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    """8-step schedule stopped after step 3 with checkpoints after steps 2 and 4; ledger steps 0..3."""
    d = tmp_path_factory.mktemp("stopped") / "run"
    train(d, "train.steps=8", "train.stop_after=3", "ckpt.every=2")
    assert [s[0] for s in step_fields(d)] == [0, 1, 2, 3]
    return d


@pytest.fixture(scope="module")
def other_seed(tmp_path_factory):
    d = tmp_path_factory.mktemp("other") / "run"
    train(d, "train.steps=8", "train.stop_after=3", "seed=1")
    return d


def _edit_lines(d: Path, fn) -> None:
    lines = (d / LEDGER_NAME).read_text().splitlines()
    (d / LEDGER_NAME).write_text("\n".join(fn(lines)) + "\n")


def _step_index(lines: list[str], step: int) -> int:
    return next(i for i, x in enumerate(lines) if json.loads(x).get("kind") == "step" and json.loads(x)["step"] == step)


def _tamper_param(lines: list[str]) -> list[str]:
    i = _step_index(lines, 3)
    rec = json.loads(lines[i])
    rec["param"] = format(int(rec["param"], 16) ^ 1, "016x")
    return [*lines[:i], json.dumps(rec, separators=(",", ":")), *lines[i + 1:]]


DAMAGE = {
    "intact": (None, None),
    "missing": (lambda d, o: (d / LEDGER_NAME).unlink(), "it is missing"),
    "shorter": (lambda d, o: _edit_lines(d, lambda ls: [x for x in ls if '"step":3,' not in x]), "shorter"),
    "gapped": (lambda d, o: _edit_lines(d, lambda ls: [x for x in ls if '"step":1,' not in x]), "gapped: steps 1"),
    "duplicated": (lambda d, o: _edit_lines(d, lambda ls: [*ls[:3], ls[2], *ls[3:]]), "duplicated"),
    "foreign_config": (lambda d, o: shutil.copy(o / LEDGER_NAME, d / LEDGER_NAME), "seed: 1 -> 0"),
    "foreign_fingerprint": (lambda d, o: _edit_lines(d, _tamper_param), "does not match the checkpoint"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_resume_needs_the_ledger_of_steps_0_to_k_minus_1(stopped, other_seed, tmp_path, damage):
    d = tmp_path / "run"
    shutil.copytree(stopped, d)
    spoil, needle = DAMAGE[damage]
    if spoil is not None:
        spoil(d, other_seed)
    before = (d / LEDGER_NAME).read_bytes() if (d / LEDGER_NAME).exists() else None
    p = train(d, "train.steps=8", "ckpt.resume=auto", check=False)
    if spoil is None:  # the control: the same resume on the intact copy works
        assert p.returncode == 0, p.stderr[-3000:]
        assert [s[0] for s in step_fields(d)] == list(range(8))
        return
    one_line_error(p, str(d / LEDGER_NAME), "resum" if damage != "foreign_config" else "another run", needle)
    after = (d / LEDGER_NAME).read_bytes() if (d / LEDGER_NAME).exists() else None
    assert after == before  # refused before the ledger was touched


# ---- clear errors for the run dir's file system ------------------------------------------------------------
def test_run_dir_that_cannot_be_created(tmp_path):
    (tmp_path / "file").write_text("x")
    d = tmp_path / "file" / "run"
    one_line_error(train(d, check=False), f"cannot create the run dir {d}", "Not a directory")


def _mount_tmpfs(where: Path, opts: str) -> bool:
    where.mkdir()
    if os.geteuid() != 0:
        return False
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(where)], capture_output=True)
    return p.returncode == 0


def unavailable(reason: str) -> None:
    """Skip where the machine cannot host the scenario; on CI (CI=true, root on this machine kind, where both
    were seen to work) fail instead, so the promise is never silently untested there."""
    if os.environ.get("CI"):
        pytest.fail(f"{reason}; CI must run this test")
    pytest.skip(reason)


@pytest.fixture
def tmpfs(tmp_path):
    """mount(opts) -> a fresh tmpfs under tmp_path (needs root: skipped otherwise); unmounted afterwards."""
    mounted = []

    def mount(opts: str) -> Path:
        where = tmp_path / f"mnt{len(mounted)}"
        if not _mount_tmpfs(where, opts):
            unavailable("needs root to mount a tmpfs")
        mounted.append(where)
        return where

    yield mount
    for m in mounted:
        subprocess.run(["umount", "-l", str(m)], capture_output=True)


def test_run_dir_on_a_read_only_file_system(tmpfs):
    ro = tmpfs("ro,size=1m")
    one_line_error(train(ro / "run", check=False), f"cannot create the run dir {ro / 'run'}", "Read-only file system")


def test_full_disk_names_the_ledger_and_keeps_the_lines_before(tmpfs):
    """A run dir on a 1 MiB tmpfs filled up to 64 KiB: the run stops with exit 2 and 'No space left on device'
    naming the ledger; the ledger holds whole step lines 0..k-1 (the partial line was undone)."""
    mnt = tmpfs("size=1m")
    with open(mnt / "filler", "wb") as f:
        while (st := os.statvfs(mnt)).f_bavail * st.f_frsize > 64 * 1024:
            f.write(b"\0" * 4096)
            f.flush()
    d = mnt / "run"
    p = train(d, "train.steps=2000", "log.every=1000", check=False)
    one_line_error(p, "No space left on device", str(d / LEDGER_NAME), "ckpt.resume=auto")
    text = (d / LEDGER_NAME).read_text()
    assert text.endswith("\n")
    steps = [s["step"] for s in read_ledger(d)[1]]
    assert 0 < len(steps) < 2000 and steps == list(range(len(steps)))
    assert "train" in (d / "config.yaml").read_text()  # the files written before are intact


def test_immutable_ledger_is_refused_at_start_up(stopped, tmp_path):
    d = tmp_path / "run"
    shutil.copytree(stopped, d)
    ledger = d / LEDGER_NAME
    if subprocess.run(["chattr", "+i", str(ledger)], capture_output=True).returncode != 0:
        unavailable("chattr +i is not available here (needs root and a file system with inode flags)")
    try:
        before = ledger.read_bytes()
        p = train(d, "train.steps=8", "ckpt.resume=auto", check=False)
        one_line_error(p, f"cannot write the ledger {ledger}", "Operation not permitted", "chattr -i")
        assert ledger.read_bytes() == before
        assert not list((d / "checkpoints").glob("*.tmp"))
    finally:
        subprocess.run(["chattr", "-i", str(ledger)], capture_output=True)


# ---- a signal in the first seconds -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    d = tmp_path_factory.mktemp("base") / "run"
    train(d)
    return step_fields(d)


MOMENTS = {
    "at_start": lambda d: True,  # right after the process is created: interpreter start-up or imports
    "run_dir_locked": lambda d: (d / LOCK_NAME).exists(),  # between the lock and the first step
    "ledger_open": lambda d: (d / LEDGER_NAME).exists(),  # the header is written, step 0 may be running
}


@pytest.mark.parametrize("moment,sig", [("at_start", signal.SIGTERM), ("at_start", signal.SIGUSR1),
                                         ("run_dir_locked", signal.SIGUSR1), ("ledger_open", signal.SIGTERM)],
                         ids=lambda x: x if isinstance(x, str) else signal.Signals(x).name)
def test_early_signal_leaves_a_fresh_or_resumable_run_dir(baseline, tmp_path, moment, sig):
    """Whenever the signal lands, the run dir is fresh (no step lines) or resumable (a complete checkpoint for its
    steps), never a half-made .tmp checkpoint or a ledger without one; the requeued job (ckpt.resume=auto) then
    writes the uninterrupted ledger."""
    d = tmp_path / "run"
    p = popen(d, "ckpt.every=0")
    wait_for(lambda: MOMENTS[moment](d), p, moment)
    p.send_signal(sig)
    out, _ = p.communicate(timeout=300)
    assert p.returncode in (75, 0, -sig), (p.returncode, out[-3000:])  # 0: it had finished already
    assert "Traceback" not in out, out[-3000:]
    ck = d / "checkpoints"
    assert not (ck.is_dir() and list(ck.glob("*.tmp")))
    if has_steps(d) and p.returncode != 0:
        k = len(read_ledger(d)[1])
        assert (ck / f"step_{k:08d}").is_dir()  # resumable: a checkpoint right after its last step line
    if p.returncode != 0:
        train(d, "ckpt.resume=auto")
    assert step_fields(d) == baseline


# ---- issue 23: a run that can no longer write its record stops; run ids are plain names -------------------------
def test_ledger_removed_mid_run_stops_the_run_with_exit_2(tmp_path):
    """`rm RUN/ledger.jsonl` while the run trains: the next step's append sees that the open file is no longer the
    ledger (st_nlink 0), and the run ends with exit 2 naming the ledger, never "done" with a ledger that is gone."""
    d = tmp_path / "run"
    p = popen(d, "train.steps=100000", "log.every=100000")
    wait_for(lambda: has_steps(d), p, "the first step line")
    (d / LEDGER_NAME).unlink()
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 2, (p.returncode, out[-3000:])
    assert "Traceback" not in out and "done:" not in out, out[-3000:]
    (line,) = [x for x in out.splitlines() if x.startswith("dettrain: error:")]
    assert f"the ledger {d / LEDGER_NAME} was deleted or replaced while this run was writing it" in line, line
    assert not (d / LEDGER_NAME).exists()  # nothing recreated a partial ledger under the old name


def test_ledger_replaced_mid_run_stops_the_run(tmp_path):
    """The same when the path now names another file (a `mv` over it): the run's lines would go to an unlinked
    inode, so it stops, and the file now at the path is left as it is."""
    d = tmp_path / "run"
    p = popen(d, "train.steps=100000", "log.every=100000")
    wait_for(lambda: has_steps(d), p, "the first step line")
    other = tmp_path / "other.jsonl"
    other.write_text("not ours\n")
    other.replace(d / LEDGER_NAME)
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 2 and "was deleted or replaced" in out and "done:" not in out, out[-3000:]
    assert (d / LEDGER_NAME).read_text() == "not ours\n"


def run_with_id(cwd: Path, run_id: str, *overrides: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "DETTRAIN_RUN_ID": run_id,
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)}
    return subprocess.run([sys.executable, "-m", "dettrain", *TINY, *overrides], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("run_id", ["../../../x", "a/b", "/abs", "..", ".hidden", "a b", "x\ny"])
def test_run_id_that_is_not_a_plain_name_is_refused(tmp_path, run_id):
    cwd = tmp_path / "deep" / "er" / "work"
    cwd.mkdir(parents=True)
    p = run_with_id(cwd, run_id)
    one_line_error(p, "DETTRAIN_RUN_ID=", "not a plain name")
    assert sorted(x.name for x in tmp_path.rglob("*")) == ["deep", "er", "work"]  # nothing written anywhere


def test_plain_run_id_names_the_run_dir(tmp_path):
    p = run_with_id(tmp_path, "exp-1.2_b", "train.steps=1")
    assert p.returncode == 0, p.stderr[-3000:]
    (found,) = list(tmp_path.glob("outputs/*/exp-1.2_b/ledger.jsonl"))
    assert len(read_ledger(found)[1]) == 1


def test_ledger_moved_aside_and_replaced_under_a_writer_is_refused(tmp_path):
    """The writer compares the inode and device of its open file with the file now at the ledger's path: a ledger
    moved aside (still linked, so not "deleted") with another file put in its place stops the writer with one
    UserError naming the ledger, and neither file is written to."""
    from dettrain.errors import UserError
    from dettrain.record.ledger import LedgerWriter

    path = tmp_path / LEDGER_NAME
    w = LedgerWriter(path, {"config": {}})
    step = {"kind": "step", "step": 0, "loss": 1.0, "loss_bits": "3f800000", "batch": "0" * 16, "grad": "0" * 16,
            "param": "0" * 16}
    w.write(step)
    path.rename(tmp_path / "aside.jsonl")
    path.write_text("another run's ledger\n")
    with pytest.raises(UserError, match=f"the ledger {path} was deleted or replaced .*at step 1"):
        w.write({**step, "step": 1})
    w.close()
    assert path.read_text() == "another run's ledger\n"
    assert len((tmp_path / "aside.jsonl").read_text().splitlines()) == 2  # header and step 0, nothing after


def test_immutable_checkpoints_directory_at_save_is_one_line(tmp_path):
    """checkpoints/ made immutable (chattr +i) before the first save: exit 2 naming the checkpoint and the cause,
    no traceback, no .tmp left, the ledger's steps before the save intact."""
    d = tmp_path / "run"
    (d / "checkpoints").mkdir(parents=True)
    if subprocess.run(["chattr", "+i", str(d / "checkpoints")], capture_output=True).returncode != 0:
        unavailable("chattr +i is not available here (needs root and a file system with inode flags)")
    try:
        p = train(d, "train.steps=4", "ckpt.every=2", check=False)
        one_line_error(p, f"cannot save checkpoint {d / 'checkpoints' / 'step_00000002'}", "Operation not permitted")
        assert not list((d / "checkpoints").iterdir())
        assert [s[0] for s in step_fields(d)] == [0, 1]
    finally:
        subprocess.run(["chattr", "-i", str(d / "checkpoints")], capture_output=True)
