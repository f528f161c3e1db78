"""slurm/dettrain.sbatch on a real Slurm: a throwaway cluster on localhost (munged, slurmctld, slurmd n1 and n2).

1. A 2-node x 2-process job (one torchrun per node, c10d rendezvous on the first node) writes the same ledger as a
   single-node 4-process run of the same tier-3 job, into outputs/<exp>/<job id>/, with one log per node.
2. SIGUSR1 to the batch script mid-run (what ``--signal=B:USR1@N`` sends before the time limit): every trainer
   checkpoints and stops, the script requeues the job, the requeued job (same id, so same run dir) resumes with
   ckpt.resume=auto and finishes with the identical ledger.

Needs root and Debian's slurm-wlm + munge (``.ci/run`` installs them).  Skipped only off CI when they are missing;
with CI=true a missing Slurm is a failure, not a skip.
"""

from __future__ import annotations

import json
import os
import time

import pytest
from conftest import step_fields
from launching import JOB, SBATCH, launch_env, reference_run
from slurm_cluster import SlurmCluster, unavailable_reason

from dettrain.record.ledger import read_ledger

pytestmark = pytest.mark.slurm


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    reason = unavailable_reason()
    if reason:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"CI must run the Slurm tests, but: {reason}")
        pytest.skip(reason)
    with SlurmCluster(tmp_path_factory.mktemp("slurm")) as c:
        yield c


def submit(cluster: SlurmCluster, submit_dir) -> int:
    # nodes and processes per node as a user would give them; the script is read from the checkout
    return cluster.sbatch(SBATCH, "--nproc", "2", *JOB, options=("--nodes=2", "--time=10"),
                          env=launch_env(DETTRAIN_ROOT=str(SBATCH.parent.parent)), cwd=submit_dir)


def events(run_dir) -> list[dict]:
    lines = (run_dir / "ledger.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines[1:]) if e.get("kind") == "event"]


def test_two_node_job_matches_single_node(cluster, tmp_path, tmp_path_factory):
    ref = reference_run(tmp_path_factory)
    job = submit(cluster, tmp_path)
    info = cluster.wait_job(job)
    assert info["JobState"] == "COMPLETED", f"job {info}\n{cluster.logs()}\n{_job_logs(tmp_path)}"
    assert info["NodeList"] == "n[1-2]"

    run = tmp_path / "outputs" / "default" / str(job)  # run id = job id
    header, steps = read_ledger(run)
    assert header["world_size"] == 4 and header["tier"] == 3
    assert len(steps) == 40
    assert step_fields(run) == step_fields(ref)
    # one log per node, each written by that node's own shell (the per-node variables were not expanded once)
    logs = sorted((tmp_path / "slurm-logs" / f"dettrain-{job}").glob("node*.log"))
    assert [p.name for p in logs] == ["node0.log", "node1.log"]
    for i, p in enumerate(logs):
        assert f"node {i} (n{i + 1}) of job {job}, restart 0" in p.read_text()


def test_preempted_job_requeues_and_resumes(cluster, tmp_path, tmp_path_factory):
    ref = reference_run(tmp_path_factory)
    job = submit(cluster, tmp_path)
    run = tmp_path / "outputs" / "default" / str(job)

    # wait until training is under way (3 steps in the ledger), then signal the batch script as Slurm would
    deadline = time.monotonic() + 300
    while not (run / "ledger.jsonl").exists() or sum(
            '"kind":"step"' in ln for ln in (run / "ledger.jsonl").read_text().splitlines()) < 3:
        state = cluster.job(job)["JobState"]
        assert state in ("PENDING", "CONFIGURING", "RUNNING"), f"job {state} before it was signalled"
        assert time.monotonic() < deadline, "the job never reached step 3"
        time.sleep(0.2)
    cluster._run(["scancel", "--batch", "--signal=USR1", str(job)])

    info = cluster.wait_job(job, timeout=400)
    assert info["JobState"] == "COMPLETED", f"job {info}\n{cluster.logs()}\n{_job_logs(tmp_path)}"
    assert info["Restarts"] == "1", f"the job was not requeued: {info}\n{_job_logs(tmp_path)}"

    # the first run stopped mid-way with a checkpoint; the requeued one resumed exactly there
    ev = events(run)
    pre = [e for e in ev if e.get("event") == "preempted"]
    res = [e for e in ev if e.get("event") == "resume"]
    assert len(pre) == 1 and pre[0]["reason"] == "preempted by SIGUSR1", ev
    assert 3 <= pre[0]["step"] < 40, "the signal did not land mid-run"
    assert len(res) == 1 and res[0]["step"] == pre[0]["step"], ev
    assert step_fields(run) == step_fields(ref)
    for i in range(2):
        text = (tmp_path / "slurm-logs" / f"dettrain-{job}" / f"node{i}.log").read_text()
        assert "restart 0" in text and "restart 1" in text  # one log per node, appended across the requeue


def _job_logs(submit_dir) -> str:
    out = []
    for p in sorted(submit_dir.glob("slurm-*.out")) + sorted(submit_dir.glob("slurm-logs/*/*.log")):
        out.append(f"--- {p.name}\n{p.read_text(errors='replace')[-4000:]}")
    return "\n".join(out)
