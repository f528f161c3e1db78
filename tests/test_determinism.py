"""Tiers 0-2: seeds derived per purpose; tier 2 reruns bitwise identical on 1 and 2 ranks; tier 1 reproduces data."""

from __future__ import annotations

import json
import os

import pytest
import torch
from conftest import step_fields, sums_with_1_and_2_threads, train

from dettrain.determinism import derive_seed
from dettrain.record.ledger import read_ledger


def test_derive_seed_separates_purposes_and_indices():
    seen = {derive_seed(0, p, i) for p in ("python", "numpy", "torch", "data", "dropout") for i in range(50)}
    assert len(seen) == 250
    assert derive_seed(1, "torch", 0) != derive_seed(0, "torch", 1)  # never seed + rank
    assert derive_seed(7, "init", "layers.0.attn.wq.weight") == derive_seed(7, "init", "layers.0.attn.wq.weight")
    assert 0 <= derive_seed(2**40, "x") < 2**63


def test_cpu_sum_depends_on_thread_count():
    """The trap that makes tiers >= 2 pin threads (docs/determinism.md): a 1e7-element fp32 sum differs between 1 and
    2."""
    if (os.cpu_count() or 1) < 2:
        pytest.skip("this machine has one core")
    a, b = sums_with_1_and_2_threads(0)
    assert not torch.equal(a, b)


@pytest.mark.parametrize("nproc", [1, 2])
def test_tier2_reruns_are_bitwise_identical(tmp_path, nproc):
    a, b = tmp_path / "a", tmp_path / "b"
    train(a, "det.tier=2", nproc=nproc)
    train(b, "det.tier=2", nproc=nproc)
    fa, fb = step_fields(a), step_fields(b)
    assert len(fa) == 4 and fa == fb
    # the whole step lines, byte for byte (no wall times in the ledger)
    la = (a / "ledger.jsonl").read_text().splitlines()[1:]
    assert la == (b / "ledger.jsonl").read_text().splitlines()[1:]
    header, _ = read_ledger(a)
    assert header["tier"] == 2 and header["threads"] == 1 and header["world_size"] == nproc
    assert header["config"]["det"]["tier"] == 2 and len(header["config_hash"]) == 16


def test_tier1_reproduces_data_and_seed_changes_it(tmp_path):
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    train(a, "det.tier=1")
    train(b, "det.tier=1")
    train(c, "det.tier=1", "seed=1")
    batch = lambda r: [s[2] for s in step_fields(r)]  # noqa: E731
    param = lambda r: [s[4] for s in step_fields(r)]  # noqa: E731
    assert batch(a) == batch(b)
    assert all(x != y for x, y in zip(batch(a), batch(c)))
    assert all(x != y for x, y in zip(param(a), param(c)))


def test_run_writes_config_hydra_files_and_rank_logs(tmp_path):
    r = tmp_path / "r"
    p = train(r, "det.tier=2", nproc=2)
    assert (r / "config.yaml").is_file() and (r / ".hydra" / "overrides.yaml").is_file()
    assert (r / "logs" / "rank0.log").is_file() and (r / "logs" / "rank1.log").is_file()
    # one progress line per step from rank 0 only
    assert sum(1 for line in p.stdout.splitlines() if line.startswith("step ")) == 4
    lines = (r / "ledger.jsonl").read_text().splitlines()
    head = json.loads(lines[0])
    assert head["kind"] == "header" and {"versions", "audit", "world_size"} <= set(head)
    step = json.loads(lines[1])
    assert {"step", "loss", "loss_bits", "batch", "grad", "param"} <= set(step)
    assert all(len(step[k]) == 16 for k in ("batch", "grad", "param", "opt"))


def test_shared_run_id_from_env(tmp_path):
    import subprocess
    import sys

    from conftest import REPO, TINY

    env = {"DETTRAIN_RUN_ID": "shared-id", "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "dettrain",
           *TINY, "train.steps=1", "exp_name=idtest"]
    p = subprocess.run(cmd, cwd=tmp_path, env={**env, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    runs = list((tmp_path / "outputs" / "idtest").iterdir())
    assert [d.name for d in runs] == ["shared-id"]
    assert (runs[0] / "ledger.jsonl").is_file()


def test_tier2_pins_threads_without_omp_num_threads(tmp_path):
    """No OMP_NUM_THREADS in the environment (conftest.train sets it otherwise): tier 2 still pins torch to
    det.threads=1 itself (header threads=1) and reruns bitwise; the control at tier 0 with det.threads=0 shows this
    environment really does run more threads."""
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    for d in (a, b):
        train(d, "det.tier=2", unset_env=("OMP_NUM_THREADS", "MKL_NUM_THREADS"))
    assert read_ledger(a)[0]["threads"] == read_ledger(b)[0]["threads"] == 1
    assert (a / "ledger.jsonl").read_text().splitlines()[1:] == (b / "ledger.jsonl").read_text().splitlines()[1:]
    if (os.cpu_count() or 1) > 1:
        train(c, "det.tier=0", "det.threads=0", unset_env=("OMP_NUM_THREADS", "MKL_NUM_THREADS"))
        assert read_ledger(c)[0]["threads"] > 1


def test_rng_streams_are_restored_on_resume(tmp_path):
    """A model that draws from Python's and numpy's global streams in every forward (tests/rng_user_model.py), with
    dropout on: stop after step 3 + resume == uninterrupted, every field of every step.  Fails if the resume left
    those streams at their freshly seeded state.  The control: the draws do change the numbers."""
    from conftest import REPO

    script = REPO / "tests" / "rng_user_model.py"
    args = ("train.steps=8", "model.dropout=0.1", "det.tier=3")
    base, cut, plain = tmp_path / "base", tmp_path / "cut", tmp_path / "plain"
    train(base, *args, script=script)
    train(cut, *args, "train.stop_after=3", script=script)
    train(cut, *args, "ckpt.resume=auto", script=script)
    assert step_fields(cut) == step_fields(base) and len(step_fields(base)) == 8
    train(plain, *args)
    assert [s[1] for s in step_fields(plain)] != [s[1] for s in step_fields(base)]


def test_dropout_masks_are_keyed_by_step_and_micro_batch():
    """seed_micro_batch keys the draws by (seed, step, global micro-batch index): the same key gives the same mask,
    and another step with the same micro-batch index (or another index in the same step) never reuses it."""
    from dettrain.determinism import seed_micro_batch

    def mask(step: int, micro: int, seed: int = 0) -> torch.Tensor:
        seed_micro_batch(seed, step, micro)
        return torch.nn.functional.dropout(torch.ones(4096), p=0.5, training=True) > 0

    assert torch.equal(mask(3, 1), mask(3, 1))
    others = [mask(4, 1), mask(3, 2), mask(3, 1, seed=1), mask(0, 0)]
    assert all(not torch.equal(mask(3, 1), m) for m in others)
    assert not torch.equal(mask(1, 0), mask(0, 1))  # step and index are not interchangeable
