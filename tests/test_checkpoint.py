"""Checkpoint, resume and fault recovery (issue 5): a run that is stopped, preempted or killed and then resumed writes
the same step lines as one that never stopped.  Every test runs real `python -m dettrain` / torchrun processes on
Gloo and compares ledgers of two real runs."""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO, TINY, step_fields, train

from dettrain.checkpoint.storage import _safe_metadata
from dettrain.record.ledger import LEDGER_NAME

STEPS = ["train.steps=20"]
# tiers 3-4 with a sharded optimizer and small buckets: several buckets whose boundaries move with the world size
CANON = ["dist.shard_optimizer=true", "dist.bucket_mb=0.05"]
TIER_ARGS = {2: ["det.tier=2"], 3: ["det.tier=3", *CANON], 4: ["det.tier=4", *CANON]}
STOP = ["train.stop_after=9", "ckpt.every=4"]  # 10 steps, checkpoints after steps 8 and 10


def events(run_dir: Path, kind: str) -> list[dict]:
    lines = (Path(run_dir) / LEDGER_NAME).read_text().splitlines()
    return [e for e in map(json.loads, lines) if e.get("kind") == "event" and e.get("event") == kind]


def header(run_dir: Path) -> dict:
    return json.loads((Path(run_dir) / LEDGER_NAME).read_text().splitlines()[0])


def status(run_dir: Path) -> int:
    return subprocess.run([sys.executable, "-m", "dettrain.checkpoint", "status", str(run_dir)], cwd=REPO,
                          capture_output=True, text=True).returncode


def popen(run_dir: Path, *overrides: str, nproc: int, torchrun_args: tuple[str, ...] = (),
          env: dict | None = None) -> subprocess.Popen:
    """Start a job like conftest.train, without waiting (to signal or kill it)."""
    args = [*TINY, f"run_dir={run_dir}", *overrides]
    if nproc == 1:
        cmd = [sys.executable, "-m", "dettrain", *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               *torchrun_args, "-m", "dettrain", *args]
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    full_env.pop("DETTRAIN_RUN_ID", None)
    return subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_for(cond, p: subprocess.Popen, what: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if p.poll() is not None:
            raise AssertionError(f"the job ended (rc {p.returncode}) before {what}:\n{p.stdout.read()[-4000:]}")
        if time.monotonic() > deadline:
            p.kill()
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def worker_pids(launcher_pid: int) -> dict[int, int]:
    """{rank: pid} of torchrun's worker processes (children of the launcher whose environment holds RANK)."""
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid != launcher_pid:
                continue
            env = dict(e.split(b"=", 1) for e in (d / "environ").read_bytes().split(b"\0") if b"=" in e)
        except (OSError, ValueError, IndexError):
            continue
        if b"RANK" in env:
            out[int(env[b"RANK"])] = int(d.name)
    return out


def finish(p: subprocess.Popen, timeout: float = 300) -> tuple[int, str]:
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        out, _ = p.communicate()
        raise AssertionError(f"job did not finish:\n{out[-4000:]}") from None
    return p.returncode, out


# ---- shared runs: one uninterrupted baseline and one stopped run per tier (2 ranks) ----------------------
@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    cache: dict[tuple[str, int], Path] = {}

    def get(kind: str, tier: int) -> Path:
        if (kind, tier) not in cache:
            d = tmp_path_factory.mktemp(f"{kind}{tier}")
            extra = STOP if kind == "stopped" else []
            train(d, *STEPS, *TIER_ARGS[tier], *extra, nproc=2)
            cache[kind, tier] = d
        return cache[kind, tier]

    return get


def copy_run(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("tier", [2, 3, 4])
def test_stop_after_then_resume_equals_uninterrupted(runs, tmp_path, tier):
    """stop_after ends the run with a checkpoint; ckpt.resume=auto continues the same ledger, bit for bit."""
    base = runs("base", tier)
    d = copy_run(runs("stopped", tier), tmp_path / "run")
    assert [s[0] for s in step_fields(d)] == list(range(10))
    assert sorted(p.name for p in (d / "checkpoints").iterdir()) == ["step_00000008", "step_00000010"]
    train(d, *STEPS, *TIER_ARGS[tier], "ckpt.resume=auto", nproc=2)
    assert step_fields(d) == step_fields(base)
    (ev,) = events(d, "resume")
    assert ev["step"] == 10 and ev["config_hash"] == ev["saved_config_hash"] == header(base)["config_hash"]


@pytest.mark.parametrize("nproc", [1, 4])
def test_tier4_checkpoint_resumes_on_another_world_size(runs, tmp_path, nproc):
    """Tier 4: saved on 2 ranks (sharded optimizer), resumed on 1 and on 4: the same bits as the uninterrupted run.
    On 1 rank the resume also turns dist.offload_partials on (4 micro-batches there, so the partial of the first
    pair waits in host memory): it moves no bit, so it is no config change and the config hash stays."""
    base = runs("base", 4)
    d = copy_run(runs("stopped", 4), tmp_path / "run")
    offload = ["dist.offload_partials=true"] if nproc == 1 else []
    train(d, *STEPS, *TIER_ARGS[4], *offload, "ckpt.resume=auto", nproc=nproc)
    assert step_fields(d) == step_fields(base)
    (ev,) = events(d, "resume")
    assert (ev["saved_world_size"], ev["world_size"]) == (2, nproc)
    assert ev["config_hash"] == ev["saved_config_hash"] and set(ev["config_changes"]) == {"world_size"}


def test_sigusr1_on_one_rank_checkpoints_all_and_resumes(runs, tmp_path):
    """SIGUSR1 to rank 1 only: both ranks stop after the same step with a checkpoint and exit 75; resuming gives
    the uninterrupted ledger."""
    base = runs("base", 3)
    d = tmp_path / "run"
    p = popen(d, *STEPS, *TIER_ARGS[3], nproc=2)
    # the ledger exists once training starts; every rank installed its handler before the process group
    wait_for(lambda: (d / LEDGER_NAME).is_file(), p, "the ledger")
    os.kill(worker_pids(p.pid)[1], signal.SIGUSR1)
    rc, out = finish(p)
    assert rc != 0, out[-3000:]  # torchrun reports a failure ...
    assert "exitcode: 75" in out.replace("exitcode  :", "exitcode:"), out[-3000:]  # ... of 75
    (ev,) = events(d, "preempted")
    k = ev["step"]
    assert 0 < k < 20 and ev["exit_code"] == 75 and "SIGUSR1" in ev["reason"]
    assert (d / "checkpoints" / f"step_{k:08d}").is_dir()
    assert [s[0] for s in step_fields(d)] == list(range(k))
    assert status(d) == 75  # the literal launch scripts and Slurm test, not only our constant
    train(d, *STEPS, *TIER_ARGS[3], "ckpt.resume=auto", nproc=2)
    assert step_fields(d) == step_fields(base)
    assert status(d) == 0


def test_sigterm_single_process_exits_with_requeue_code(runs, tmp_path):
    """`python -m dettrain` itself exits 75 on SIGTERM after its checkpoint; the resumed run (tier 4, 1 process)
    equals the 2-rank uninterrupted one."""
    base = runs("base", 4)
    d = tmp_path / "run"
    p = popen(d, *STEPS, *TIER_ARGS[4], nproc=1)
    wait_for(lambda: (d / LEDGER_NAME).is_file(), p, "the ledger")
    p.send_signal(signal.SIGTERM)
    rc, out = finish(p)
    assert rc == 75, out[-3000:]
    (ev,) = events(d, "preempted")
    assert "SIGTERM" in ev["reason"]
    train(d, *STEPS, *TIER_ARGS[4], "ckpt.resume=auto", nproc=1)
    assert step_fields(d) == step_fields(base)


def test_sigkill_of_one_rank_restarts_and_resumes_by_itself(runs, tmp_path):
    """Under torchrun --max-restarts=1, SIGKILL of rank 1 restarts the job, which resumes from the last checkpoint
    and writes the uninterrupted ledger."""
    base = runs("base", 4)
    d = tmp_path / "run"
    # torchrun's shared rendezvous store leaks the dead attempt's addresses into the restart (pytorch#135712):
    # restarts need TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in the launcher's environment (docs/checkpoint.md)
    p = popen(d, *STEPS, *TIER_ARGS[4], "ckpt.every=2", "ckpt.resume=auto", nproc=2,
              torchrun_args=("--max-restarts=1",), env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    wait_for(lambda: (d / "checkpoints" / "step_00000002").is_dir(), p, "the first checkpoint")
    os.kill(worker_pids(p.pid)[1], signal.SIGKILL)
    rc, out = finish(p)
    assert rc == 0, out[-4000:]
    (ev,) = events(d, "resume")
    assert ev["restart"] == 1 and ev["step"] >= 2
    assert step_fields(d) == step_fields(base)


def test_truncated_checkpoint_is_refused_and_auto_falls_back(runs, tmp_path):
    base = runs("base", 3)
    d = copy_run(runs("stopped", 3), tmp_path / "run")
    bad = d / "checkpoints" / "step_00000010"
    f = bad / "__1_0.distcp"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    # an explicit path: a clear refusal, nothing trained
    p = train(d, *STEPS, *TIER_ARGS[3], f"ckpt.resume={bad}", nproc=2, check=False)
    assert p.returncode != 0
    assert "__1_0.distcp" in p.stderr and "truncated" in p.stderr, p.stderr[-3000:]
    assert [s[0] for s in step_fields(d)] == list(range(10))
    # auto: skips the damaged checkpoint (kept aside as .corrupt), resumes from step 8, same ledger
    train(d, *STEPS, *TIER_ARGS[3], "ckpt.resume=auto", nproc=2)
    (ev,) = events(d, "resume")
    assert ev["step"] == 8 and "truncated" in ev["skipped"][0]["reason"]
    assert (d / "checkpoints" / "step_00000010.corrupt").is_dir()
    assert step_fields(d) == step_fields(base)


def test_damaged_tensor_data_fails_the_fingerprint_check(runs, tmp_path):
    """One parameter value changed inside a well-formed data file (same size, valid record: what neither a size
    check nor the reader can see) is refused by the fingerprint check on load."""
    d = copy_run(runs("stopped", 4), tmp_path / "run")
    ck = d / "checkpoints" / "step_00000010"
    md = _safe_metadata(ck / ".metadata")
    key = next(k for k in md.storage_data if k.fqn.startswith("model/"))  # a box of a parameter (issue 25 format)
    info = md.storage_data[key]
    f = ck / info.relative_path
    raw = f.read_bytes()
    t = torch.load(io.BytesIO(raw[info.offset : info.offset + info.length]), weights_only=True)
    t.view(-1)[t.numel() // 2] += 1.0
    buf = io.BytesIO()
    torch.save(t, buf)
    rec = buf.getvalue()
    assert len(rec) == info.length  # the same layout, only the value (and its record's CRC) differ
    f.write_bytes(raw[: info.offset] + rec + raw[info.offset + info.length :])
    p = train(d, *STEPS, *TIER_ARGS[4], f"ckpt.resume={ck}", nproc=1, check=False)
    assert p.returncode == 2, p.stderr[-3000:]
    assert f"checkpoint {ck}: loaded state does not match its fingerprints (param" in p.stderr, p.stderr[-3000:]


def test_config_change_is_refused_unless_allowed(runs, tmp_path):
    """Seed, global batch and (below tier 4) world size are part of the promise: a resume that changes them is
    refused, naming each key; a change listed in ckpt.allow_config_change resumes and is recorded."""
    base = runs("base", 3)
    d = copy_run(runs("stopped", 3), tmp_path / "run")
    p = train(d, *STEPS, *TIER_ARGS[3], "ckpt.resume=auto", "seed=1", "train.global_batch=16", nproc=1,
              check=False)
    assert p.returncode == 2
    for key in ("seed: 0 -> 1", "train.global_batch: 8 -> 16", "world_size: 2 -> 1", "ckpt.allow_config_change"):
        assert key in p.stderr, p.stderr[-2000:]
    assert [s[0] for s in step_fields(d)] == list(range(10))  # the ledger is untouched
    # an allowed change resumes, and the ledger header and resume event record it
    train(d, *STEPS, *TIER_ARGS[3], "ckpt.resume=auto", "train.lr=0.001", "ckpt.allow_config_change=[train.lr]",
          nproc=2)
    (ev,) = events(d, "resume")
    assert ev["config_changes"] == {"train.lr": [0.003, 0.001]}
    assert header(d)["config_changes"] == [{"at_step": 10, "changes": {"train.lr": [0.003, 0.001]}}]
    ours, ref = step_fields(d), step_fields(base)
    assert ours[:10] == ref[:10] and ours[10] != ref[10]  # the new learning rate acts from step 10 on


def test_metadata_reader_admits_only_dcp_classes(runs, tmp_path):
    """DCP's .metadata is a pickle: ours loads a real one, and refuses a tampered one without running its payload."""
    real = runs("stopped", 4) / "checkpoints" / "step_00000010" / ".metadata"
    md = _safe_metadata(real)
    assert any(k.startswith("model/") for k in md.state_dict_metadata)  # the flat engine's names (issue 25)
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    evil = tmp_path / ".metadata"
    evil.write_bytes(pickle.dumps(Payload()))
    with pytest.raises(pickle.UnpicklingError, match="refusing to load"):
        _safe_metadata(evil)
    assert not marker.exists()


# ---- damaged checkpoints: every kind of damage is BAD in `list`, skipped by `status`, refused or skipped on resume
CK10, CK8 = "step_00000010", "step_00000008"


def cli(*args: str | Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dettrain.checkpoint", *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)


def damage_framing(ck: Path, rank: int = 0) -> str:
    """Overwrite the framing (zip local header) of the record nearest the middle of ``__<rank>_0.distcp``; the
    file keeps its size.  Returns the file name."""
    md = _safe_metadata(ck / ".metadata")
    name = f"__{rank}_0.distcp"
    f = ck / name
    raw = bytearray(f.read_bytes())
    offsets = sorted(i.offset for i in md.storage_data.values() if i.relative_path == name)
    off = min(offsets, key=lambda o: abs(o - len(raw) // 2))
    assert 0 < off and raw[off : off + 4] == b"PK\x03\x04"  # a record in the middle, at its zip header
    raw[off : off + 48] = b"\xa5" * 48
    f.write_bytes(bytes(raw))
    return name


def rewrite_meta(ck: Path, change) -> None:
    """Change dettrain.json with ``change(meta)`` and recompute its sha256 (what a careless tool or a hand edit
    would leave: self-consistent, malformed)."""
    from dettrain.checkpoint.manifest import _body_sha

    mp = ck / "dettrain.json"
    meta = json.loads(mp.read_text())
    change(meta)
    meta.pop("sha256", None)
    meta["sha256"] = _body_sha(meta)
    mp.write_text(json.dumps(meta))


def _flip_middle(f: Path) -> None:
    raw = bytearray(f.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    f.write_bytes(bytes(raw))


DAMAGE = {  # name -> what it does to step_00000010 (every one keeps step_00000008 intact)
    "framing": damage_framing,
    "byte_flip_in_data_file": lambda ck: _flip_middle(ck / "__1_0.distcp"),
    "truncated_data_file": lambda ck: (ck / "__1_0.distcp").write_bytes((ck / "__1_0.distcp").read_bytes()[:100]),
    "missing_data_file": lambda ck: (ck / "__0_0.distcp").unlink(),
    "byte_flip_in_dcp_metadata": lambda ck: _flip_middle(ck / ".metadata"),
    "byte_flip_in_rng_file": lambda ck: _flip_middle(ck / "rng" / "rank_00001.json"),
    "byte_flip_in_dettrain_json": lambda ck: _flip_middle(ck / "dettrain.json"),
    "dettrain_json_not_json": lambda ck: (ck / "dettrain.json").write_text("{\"format\": 2, \"st"),
    "dettrain_json_a_list": lambda ck: (ck / "dettrain.json").write_text("[1, 2]"),
    "rehashed_field_removed": lambda ck: rewrite_meta(ck, lambda m: m.pop("sampler")),
    "rehashed_wrong_type": lambda ck: rewrite_meta(ck, lambda m: m.update(step="10")),
    "rehashed_float_position": lambda ck: rewrite_meta(ck, lambda m: m["sampler"].update(position=1.5)),
    "rehashed_fingerprint_not_hex": lambda ck: rewrite_meta(ck, lambda m: m["fingerprints"].update(param=7)),
    "rehashed_hash_list_short": lambda ck: rewrite_meta(ck, lambda m: m["sha256_files"].pop("__1_0.distcp")),
    "rehashed_path_escapes": lambda ck: rewrite_meta(ck, lambda m: m["files"].update({"../../ledger.jsonl": 1})),
    "rehashed_rng_list_short": lambda ck: rewrite_meta(ck, lambda m: m["rng_sha256"].pop()),
}


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_list_and_status_verify_every_file(runs, tmp_path, kind, capsys):
    """Each kind of damage to the newest checkpoint: `list` calls it BAD (and the older one ok), `status` calls the
    run resumable only from the older one (exit 75, the literal Slurm scripts test)."""
    from dettrain.tools import checkpoint

    d = copy_run(runs("stopped", 4), tmp_path / "run")
    assert checkpoint.main(["list", str(d)]) == 0
    assert capsys.readouterr().out.splitlines() == [f"{CK8}: ok  step 8 world 2 tier 4 (every)",
                                                    f"{CK10}: ok  step 10 world 2 tier 4 (stop_after)"]
    DAMAGE[kind](d / "checkpoints" / CK10)
    assert checkpoint.main(["list", str(d)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"{CK8}: ok  step 8") and out[1].startswith(f"{CK10}: BAD checkpoint "), out
    assert checkpoint.main(["status", str(d)]) == 75
    msg = capsys.readouterr().out
    assert msg.startswith("resumable: 10/20 steps") and f"newest verified checkpoint {CK8}" in msg, msg


def test_framing_damage_same_size_auto_falls_back_explicit_refused(runs, tmp_path):
    """A shard whose framing is overwritten mid-file (same size) makes DCP raise CheckpointException (a
    BaseException): an explicit path is refused with exit 2 and one line, auto falls back to the previous
    checkpoint and resumes bit for bit; the CLI tools, run as processes, see the damage too."""
    base = runs("base", 4)
    d = copy_run(runs("stopped", 4), tmp_path / "run")
    ck = d / "checkpoints" / CK10
    size = (ck / "__0_0.distcp").stat().st_size
    name = damage_framing(ck)
    assert (ck / name).stat().st_size == size
    p = cli("list", d)
    assert p.returncode == 0 and f"{CK10}: BAD checkpoint {ck}: file {name} does not match its sha256" in p.stdout
    p = cli("status", d)
    assert p.returncode == 75 and CK8 in p.stdout, p.stdout
    # an explicit path: exit 2, a one-line error naming the checkpoint and DCP's failure; nothing trained
    p = train(d, *STEPS, *TIER_ARGS[4], f"ckpt.resume={ck}", nproc=1, check=False)
    assert p.returncode == 2, p.stderr[-3000:]
    assert "Traceback" not in p.stderr and "CheckpointException" not in p.stderr, p.stderr[-3000:]
    (line,) = [x for x in p.stderr.splitlines() if x.startswith("dettrain: error:")]
    assert f"checkpoint {ck}: reading tensors failed (rank 0:" in line, line
    assert [s[0] for s in step_fields(d)] == list(range(10))
    # auto: step 10 is set aside as .corrupt, step 8 is loaded, the ledger equals the uninterrupted run's
    train(d, *STEPS, *TIER_ARGS[4], "ckpt.resume=auto", nproc=1)
    (ev,) = events(d, "resume")
    assert ev["step"] == 8 and "reading tensors failed" in ev["skipped"][0]["reason"]
    assert (d / "checkpoints" / f"{CK10}.corrupt").is_dir()
    assert step_fields(d) == step_fields(base)
    p = cli("list", d)
    assert f"{CK10}.corrupt: BAD" in p.stdout, p.stdout


@pytest.mark.parametrize("kind", ["rehashed_field_removed", "rehashed_wrong_type", "rehashed_float_position"])
def test_malformed_rehashed_metadata_is_a_clear_refusal(runs, tmp_path, kind):
    """dettrain.json with a field removed or of the wrong type, its sha256 recomputed: a one-line CorruptCheckpoint
    naming the field (exit 2), never a KeyError/TypeError traceback."""
    d = copy_run(runs("stopped", 4), tmp_path / "run")
    ck = d / "checkpoints" / CK10
    DAMAGE[kind](ck)
    p = train(d, *STEPS, *TIER_ARGS[4], f"ckpt.resume={ck}", nproc=1, check=False)
    assert p.returncode == 2, p.stderr[-3000:]
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    (line,) = [x for x in p.stderr.splitlines() if x.startswith("dettrain: error:")]
    field = {"rehashed_field_removed": "field 'sampler' is missing", "rehashed_wrong_type": "field 'step' is not",
             "rehashed_float_position": "field 'sampler' is not"}[kind]
    assert f"checkpoint {ck}: dettrain.json is malformed ({field}" in line, line


# ---- status: fresh run dirs are requeued (75) and start afresh; complete 0; steps without a checkpoint 1 ----------
def test_status_of_fresh_complete_and_unresumable_run_dirs(runs, tmp_path):
    """What a signal in the first seconds can leave (no run dir, no ledger, an empty or torn header, a header and no
    steps) is "fresh", exit 75, so the Slurm script requeues it; the requeued job (ckpt.resume=auto) trains from
    step 0 and writes the uninterrupted ledger."""
    base = runs("base", 4)
    head = (base / LEDGER_NAME).read_text().splitlines()[0]

    def ledger(text: str):
        def make(d: Path) -> None:
            d.mkdir()
            (d / LEDGER_NAME).write_text(text)
        return make

    states = {
        "no_run_dir": lambda d: None,
        "empty_run_dir": lambda d: d.mkdir(),
        "config_only": lambda d: (d.mkdir(), (d / "config.yaml").write_text("seed: 0\n")),
        "empty_ledger": ledger(""),
        "torn_header": ledger(head[: len(head) // 2]),
        "header_only": ledger(head + "\n"),
    }
    for name, make in states.items():
        make(tmp_path / name)
        p = cli("status", tmp_path / name)
        assert p.returncode == 75 and p.stdout.startswith("fresh: "), (name, p.stdout, p.stderr)
    d = tmp_path / "header_only"
    train(d, *STEPS, *TIER_ARGS[4], "ckpt.resume=auto", nproc=1)  # what the requeued job runs
    assert step_fields(d) == step_fields(base)
    p = cli("status", d)
    assert p.returncode == 0 and p.stdout.startswith("complete: 20/20 steps"), p.stdout
    # steps in the ledger and no checkpoint (killed before its first save): neither complete nor resumable
    cut = copy_run(base, tmp_path / "cut")
    shutil.rmtree(cut / "checkpoints")  # the finished base run has its ckpt.final checkpoint (issue 25): drop it
    lines = (cut / LEDGER_NAME).read_text().splitlines()
    (cut / LEDGER_NAME).write_text("\n".join(lines[:6]) + "\n")
    p = cli("status", cut)
    assert p.returncode == 1 and p.stdout.startswith("neither: 5/20 steps and no usable checkpoint"), p.stdout


@pytest.mark.parametrize("wait", ["nothing", "run_dir"])
def test_signal_in_the_first_moments_leaves_a_requeueable_run_dir(runs, tmp_path, wait):
    """SIGTERM at once (before the handler exists: the process dies of it) or once the run dir exists: either way
    `status` says requeue (75), and the requeued job gives the uninterrupted ledger."""
    base = runs("base", 4)
    d = tmp_path / "run"
    p = popen(d, *STEPS, *TIER_ARGS[4], nproc=1)
    if wait == "run_dir":
        wait_for(lambda: d.is_dir(), p, "the run dir")
    p.send_signal(signal.SIGTERM)
    rc, out = finish(p)
    assert rc in (-signal.SIGTERM, 75), out[-3000:]  # killed by the signal, or checkpointed after a step
    s = cli("status", d)
    assert s.returncode == 75, (rc, s.stdout)
    train(d, *STEPS, *TIER_ARGS[4], "ckpt.resume=auto", nproc=1)
    assert step_fields(d) == step_fields(base)


# ---- issue 23: DCP's .metadata damaged at the same size; status of a file; the engine that saved it; full disk ------
def test_same_size_damaged_dcp_metadata_explicit_refused_auto_falls_back(runs, tmp_path):
    """.metadata (DCP's pickle) with one byte flipped keeps its size, so only its sha256 in dettrain.json tells:
    an explicit path is refused (exit 2, one line naming the file and the check), auto falls back to the previous
    checkpoint and the resumed ledger equals the uninterrupted run's.  Both assert the sha256 check's own words,
    so a resume that skipped it (and failed later, or not at all) would fail this test."""
    base = runs("base", 4)
    d = copy_run(runs("stopped", 4), tmp_path / "run")
    ck = d / "checkpoints" / CK10
    size = (ck / ".metadata").stat().st_size
    _flip_middle(ck / ".metadata")
    assert (ck / ".metadata").stat().st_size == size
    sha_words = f"checkpoint {ck}: file .metadata does not match its sha256 (damaged)"
    p = train(d, *STEPS, *TIER_ARGS[4], f"ckpt.resume={ck}", nproc=1, check=False)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-3000:]
    (line,) = [x for x in p.stderr.splitlines() if x.startswith("dettrain: error:")]
    assert sha_words in line, line
    # advice that works in this run dir (ckpt.resume=none alone is refused where a run is)
    assert "or here with ckpt.resume=none ckpt.overwrite=true" in line, line
    assert [s[0] for s in step_fields(d)] == list(range(10))  # nothing trained, the ledger untouched
    train(d, *STEPS, *TIER_ARGS[4], "ckpt.resume=auto", nproc=2)
    (ev,) = events(d, "resume")
    assert ev["step"] == 8 and ev["skipped"][0]["reason"] == sha_words, ev
    assert (d / "checkpoints" / f"{CK10}.corrupt").is_dir()
    assert step_fields(d) == step_fields(base)


def test_status_of_a_ledger_file_answers_for_its_run_dir(runs, tmp_path):
    """`status RUN/ledger.jsonl` is the status of RUN (never "fresh"/75 for a finished run); any other file is
    refused with exit 2 naming it."""
    base = runs("base", 4)
    p = cli("status", base / LEDGER_NAME)
    assert p.returncode == 0 and p.stdout.startswith("complete: 20/20 steps"), (p.stdout, p.stderr)
    stopped = runs("stopped", 4)
    p = cli("status", stopped / LEDGER_NAME)
    assert p.returncode == 75 and p.stdout.startswith("resumable: 10/20 steps"), (p.stdout, p.stderr)
    other = tmp_path / "copy.jsonl"  # a ledger under another name is not a run dir either
    shutil.copy(base / LEDGER_NAME, other)
    for f in (base / "config.yaml", other):
        for cmd in ("status", "list"):
            p = cli(cmd, f)
            assert p.returncode == 2 and f"{f} is a file, not a run dir" in p.stderr, (cmd, p.stdout, p.stderr)


def test_flat_checkpoint_resumed_on_fsdp2_names_the_real_fix(runs, tmp_path):
    """A flat-engine checkpoint resumed with dist.engine=fsdp2: one line naming the engine that saved it, without
    suggesting ckpt.allow_config_change=[dist.engine] (which cannot convert the layout); resuming with that engine
    works."""
    d = copy_run(runs("stopped", 4), tmp_path / "run")
    for extra in ([], ["ckpt.allow_config_change=[dist.engine]"]):
        p = train(d, *STEPS, *TIER_ARGS[4][:1], "dist.engine=fsdp2", "ckpt.resume=auto", *extra, nproc=1,
                  check=False)
        assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-3000:]
        (line,) = [x for x in p.stderr.splitlines() if x.startswith("dettrain: error:")]
        assert "saved by the flat engine and this run uses dist.engine=fsdp2" in line, line
        assert "Resume with dist.engine=flat" in line and "allow_config_change=[" not in line, line
    assert [s[0] for s in step_fields(d)] == list(range(10))


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 4 MiB tmpfs (needs root: skipped otherwise), unmounted afterwards."""
    where = tmp_path / "mnt"
    where.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(where)],
                                           capture_output=True).returncode != 0:
        pytest.skip("needs root to mount a tmpfs")
    yield where
    subprocess.run(["umount", "-l", str(where)], capture_output=True)


@pytest.mark.parametrize("engine", ["fsdp2", "flat"])
def test_disk_full_during_a_checkpoint_save(small_tmpfs, tmp_path, engine):
    """The disk fills during the second save (room for one checkpoint of this model, 1.4 MiB): DCP raises its
    CheckpointException (a BaseException); the run stops with exit 2 and one line naming the checkpoint and "No
    space left on device"; no .tmp is left, the previous checkpoint stays good (status: resumable from it), and once
    there is room again the resumed ledger equals an uninterrupted run's."""
    job = ("train.steps=6", "det.tier=4", f"dist.engine={engine}", "ckpt.every=2")
    base = tmp_path / "base"
    train(base, *job)
    filler = small_tmpfs / "filler"
    with open(filler, "wb") as f:
        while (st := os.statvfs(small_tmpfs)).f_bavail * st.f_frsize > 2100 * 1024:
            f.write(b"\0" * 4096)
            f.flush()
    d = small_tmpfs / "run"
    p = train(d, *job, check=False)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-3000:]
    (line,) = [x for x in p.stderr.splitlines() if x.startswith("dettrain: error:")]
    assert f"cannot save checkpoint {d / 'checkpoints' / 'step_00000004'}: No space left on device" in line, line
    assert sorted(x.name for x in (d / "checkpoints").iterdir()) == ["step_00000002"]
    st = cli("status", d)
    assert st.returncode == 75 and "newest verified checkpoint step_00000002" in st.stdout, st.stdout
    filler.unlink()
    train(d, *job, "ckpt.resume=auto", "ckpt.keep=1")  # room for two checkpoints of this model at a time
    assert step_fields(d) == step_fields(base)


# ---- issue 43: a torn last ledger line: status and ckpt.resume=auto agree ------------------------------------------
def test_torn_ledger_tail_status_and_auto_agree_on_the_checkpoint_it_supports(runs, tmp_path):
    """The ledger's last line (step 9) torn: steps 0..8 are intact, so step_10 cannot resume (it needs step 9's
    line) and step_8 can.  `status` names step_8 (75, resumable), auto resumes from it (never the exit 2 a Slurm
    requeue would loop on), records step_10 as skipped and why, drops the torn line, and the ledger equals the
    uninterrupted run's."""
    base = runs("base", 4)
    d = copy_run(runs("stopped", 4), tmp_path / "run")
    lines = (d / LEDGER_NAME).read_text().splitlines()
    i = next(i for i, x in enumerate(lines) if json.loads(x).get("kind") == "step" and json.loads(x)["step"] == 9)
    (d / LEDGER_NAME).write_text("\n".join(lines[:i]) + "\n" + lines[i][: len(lines[i]) // 2])  # a crash mid-line
    p = cli("status", d)
    assert p.returncode == 75 and p.stdout.startswith("resumable: 9/20 steps"), p.stdout
    assert f"newest verified checkpoint {CK8}" in p.stdout and f"{CK10}: newer than the ledger" in p.stdout
    r = train(d, *STEPS, *TIER_ARGS[4], "ckpt.resume=auto", nproc=2)
    assert f"checkpoint {CK10} is newer than the ledger" in r.stdout + r.stderr
    (ev,) = events(d, "resume")
    assert ev["step"] == 8 and "is torn" in ev["skipped"][0]["reason"], ev
    assert step_fields(d) == step_fields(base)
    assert not (d / "checkpoints" / f"{CK10}.corrupt").exists()  # not damaged: superseded by the resumed run's


def test_ckpt_keep_holds_the_newest_complete_checkpoints(tmp_path):
    """ckpt.keep is the retention key: after each complete save only the newest N checkpoints stay."""
    for keep, want in ((2, [4, 5]), (1, [5])):
        d = tmp_path / f"keep{keep}"
        train(d, "train.steps=5", "ckpt.every=1", f"ckpt.keep={keep}")
        assert sorted(x.name for x in (d / "checkpoints").iterdir()) == [f"step_{k:08d}" for k in want]
