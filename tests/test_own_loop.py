"""The library API in a user's own loop (dettrain.api, examples/own_loop.py): a plain PyTorch loop with torch AdamW
gives the same ledger on 1 and 2 ranks with accumulate="tree", and that ledger is what dettrain.diff reads."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import REPO

EXAMPLE = REPO / "examples" / "own_loop.py"


def run_example(out, nproc: int, *args: str) -> None:
    cmd = [sys.executable, str(EXAMPLE), "--out", str(out), *args] if nproc == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", str(EXAMPLE),
         "--out", str(out), *args]
    p = subprocess.run(cmd, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]


def steps(out) -> list[dict]:
    lines = [json.loads(x) for x in (out / "ledger.jsonl").read_text().splitlines()]
    return [x for x in lines if x["kind"] == "step"]


def test_own_loop_tier4_same_ledger_on_1_and_2_ranks(tmp_path):
    run_example(tmp_path / "one", 1, "--tier", "4")
    run_example(tmp_path / "two", 2, "--tier", "4")
    a, b = steps(tmp_path / "one"), steps(tmp_path / "two")
    assert len(a) == 6 and a == b  # whole step lines: loss, batch, grad, param, opt (AdamW moments), grad_norm
    diff = subprocess.run([sys.executable, "-m", "dettrain.diff", str(tmp_path / "one"), str(tmp_path / "two")],
                          cwd=REPO, capture_output=True, text=True)
    assert diff.returncode == 0 and "IDENTICAL" in diff.stdout, diff.stdout + diff.stderr
    # the left fold over local micro-batches (tier 3) is not world-size invariant: the tree is what makes it so
    run_example(tmp_path / "fold1", 1, "--tier", "3")
    run_example(tmp_path / "fold2", 2, "--tier", "3")
    assert [s["grad"] for s in steps(tmp_path / "fold1")] != [s["grad"] for s in steps(tmp_path / "fold2")]


def test_own_loop_tier3_reruns_identical_on_2_ranks(tmp_path):
    run_example(tmp_path / "a", 2, "--tier", "3")
    run_example(tmp_path / "b", 2, "--tier", "3")
    assert steps(tmp_path / "a") == steps(tmp_path / "b")


def test_gradsync_in_process_gives_the_mean_gradient():
    import dettrain
    from dettrain.errors import UserError

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    ref = [p.detach().clone() for p in model.parameters()]
    xs = [torch.randn(5, 8) for _ in range(4)]
    sync = dettrain.GradSync(model, accumulate="tree")
    for k, i in enumerate(sync.my_micro_batches(4)):
        sync.backward(model(xs[i]).square().mean(), k)
    sync.reduce()
    got = [p.grad.clone() for p in model.parameters()]
    # an independent path: plain autograd on a copy of the weights
    clone = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    with torch.no_grad():
        for p, r in zip(clone.parameters(), ref):
            p.copy_(r)
    sum(clone(x).square().mean() for x in xs).backward()
    for g, p in zip(got, clone.parameters()):
        torch.testing.assert_close(g, p.grad / 4, rtol=1e-5, atol=1e-7)
    norm = sync.clip_grad_norm_(1e-3)
    assert norm == pytest.approx(float(torch.cat([g.reshape(-1) for g in got]).norm()), rel=1e-6)
    assert float(torch.cat([p.grad.reshape(-1) for p in model.parameters()]).norm()) == pytest.approx(1e-3, rel=1e-4)
    with pytest.raises(UserError, match="accumulate"):
        dettrain.GradSync(model, accumulate="sum")
