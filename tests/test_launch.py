"""launch/: the single-node torchrun wrapper and the manual multi-node launch, run for real on localhost.

Two ``launch/multinode.sh`` processes with NNODES=2 (node ranks 0 and 1, 2 Gloo ranks each) must write the same
ledger, step for step and bit for bit, as one ``launch/torchrun.sh --nproc 4`` run of the same tier-3 job: a shared
run id puts all four ranks of the two "nodes" into one run dir, and tier 3 makes the placement of ranks irrelevant.
"""

from __future__ import annotations

import socket
import subprocess

from conftest import step_fields
from launching import JOB, LAUNCH, launch_env, reference_run, run_script

from dettrain.record.ledger import read_ledger
from dettrain.tools import launch


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_node_launch_matches_single_node(tmp_path, tmp_path_factory):
    ref = reference_run(tmp_path_factory)
    port = str(_free_port())
    procs = []
    for node in (0, 1):
        # the head node's address is given explicitly (the script has no localhost default)
        env = launch_env(NNODES="2", NODE_RANK=str(node), MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                         DETTRAIN_RUN_ID="two-nodes")
        procs.append(subprocess.Popen(["bash", str(LAUNCH / "multinode.sh"), "--nproc", "2", *JOB], cwd=tmp_path,
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=300)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for node, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"node {node} failed ({p.returncode}):\n{out[-5000:]}"

    # one run dir, named by the shared run id, holds the ledger and the logs of all four ranks
    run = tmp_path / "outputs" / "default" / "two-nodes"
    assert sorted(f.name for f in (run / "logs").glob("rank*.log")) == [f"rank{r}.log" for r in range(4)]
    header, steps = read_ledger(run)
    ref_header, _ = read_ledger(ref)
    assert header["world_size"] == ref_header["world_size"] == 4
    assert header["tier"] == 3
    assert len(steps) == 40
    assert step_fields(run) == step_fields(ref)


def test_launch_env_follows_the_tier(capsys, monkeypatch):
    """The environment the scripts export before torchrun starts: pinned threads and the CUDA/NCCL variables from
    tier 2 up, nothing pinned at tier 0; the run dir when it is fixed before launch."""
    # what an earlier in-process test may have set (dettrain.memory's plan_memory sets the tier's CUDA variables,
    # as the trainer does): an exported variable keeps its value, so it would not be printed
    for k in ("CUBLAS_WORKSPACE_CONFIG", "NCCL_NVLS_ENABLE", "DETTRAIN_RUN_ID", "DETTRAIN_RUN_DIR"):
        monkeypatch.delenv(k, raising=False)

    def env_of(*overrides: str) -> dict[str, str]:
        assert launch.main(["env", *overrides]) == 0
        out = capsys.readouterr().out
        return dict(line.removeprefix("export ").split("=", 1) for line in out.splitlines())

    t2 = env_of("det.tier=2", "det.threads=3")
    assert t2["DETTRAIN_TIER"] == "2"
    assert t2["OMP_NUM_THREADS"] == t2["MKL_NUM_THREADS"] == "3"
    assert t2["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8" and t2["NCCL_NVLS_ENABLE"] == "0"
    t0 = env_of("det.tier=0", "det.threads=0")
    assert t0["DETTRAIN_TIER"] == "0"
    assert not {"OMP_NUM_THREADS", "CUBLAS_WORKSPACE_CONFIG", "NCCL_NVLS_ENABLE"} & set(t0)
    assert env_of("run_dir=/some/where")["DETTRAIN_RUN_DIR"] == "/some/where"
    assert launch.main(["env", "det.tierr=1"]) == 2 and "det.tierr" in capsys.readouterr().err


def test_bad_launches_stop_before_torchrun(tmp_path):
    """A missing multi-node setting or a bad override is reported by the script; no training starts."""
    p = run_script(LAUNCH / "multinode.sh", *JOB, cwd=tmp_path, check=False,
                   env=launch_env(NNODES="2", NODE_RANK="1", DETTRAIN_RUN_ID="x"))
    assert p.returncode == 2 and "MASTER_ADDR" in p.stderr
    p = run_script(LAUNCH / "torchrun.sh", "det.tierr=3", cwd=tmp_path, check=False, env=launch_env())
    assert p.returncode != 0 and "det.tierr" in p.stderr
    assert not (tmp_path / "outputs").exists()
