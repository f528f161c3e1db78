"""Helpers shared by test_launch.py and test_slurm.py: the job they all run, and its single-node reference.

Every launch test trains the same tiny job at tier 3 on 4 Gloo ranks (``JOB``); the reference is one
``launch/torchrun.sh --nproc 4`` run of it, made once per session and compared with every multi-node run.  40 steps
(each well under a second) leave a preemption signal sent after step 3 ample room to land mid-run.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from conftest import REPO, TINY

JOB = [*TINY, "train.steps=40", "det.tier=3", "dist.backend=gloo"]
LAUNCH = REPO / "launch"
SBATCH = REPO / "slurm" / "dettrain.sbatch"

_reference: dict[str, Path] = {}


def launch_env(**extra: str) -> dict[str, str]:
    """The environment for a launch script: our Python, no run id inherited from the caller."""
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONUNBUFFERED": "1", **extra}
    for k in ("DETTRAIN_RUN_ID", "DETTRAIN_RUN_DIR", "NPROC_PER_NODE", "OMP_NUM_THREADS"):
        if k not in extra:
            env.pop(k, None)
    return env


def run_script(script: Path, *args: str, cwd: Path, env: dict[str, str], timeout: int = 300,
               check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run(["bash", str(script), *args], cwd=cwd, env=env, capture_output=True, text=True,
                       timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"{script.name} {' '.join(args)} failed ({p.returncode})\n--- stdout\n"
                             f"{p.stdout[-3000:]}\n--- stderr\n{p.stderr[-5000:]}")
    return p


def reference_run(tmp_path_factory) -> Path:
    """Run dir of the single-node 4-process run of JOB (launch/torchrun.sh), made once per session."""
    if "dir" not in _reference:
        root = tmp_path_factory.mktemp("reference")
        run_script(LAUNCH / "torchrun.sh", "--nproc", "4", *JOB, cwd=root, env=launch_env())
        # no run id given: the wrapper makes one and all four ranks share it (one run dir, four rank logs)
        runs = list((root / "outputs" / "default").iterdir())
        assert len(runs) == 1, runs
        assert len(list((runs[0] / "logs").glob("rank*.log"))) == 4
        _reference["dir"] = runs[0]
    return _reference["dir"]
