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


# ---- issue 25: the sampler, checkpoint/resume and the wandb mirror in a user's loop -------------------------------
def test_own_loop_tier4_stop_and_resume_equals_uninterrupted_on_2_ranks(tmp_path):
    """examples/own_loop.py on 2 Gloo ranks at tier 4: stopped after step 3 (dettrain.save_checkpoint) and resumed
    (load_checkpoint: model, AdamW, sampler position, RNG streams; StepLedger(resume_step=3)) writes the same
    whole ledger as the uninterrupted run; its wandb mirror (offline, one run continued over both attempts) holds
    the ledger's fingerprints step by step."""
    from conftest import step_fields

    from dettrain.record.ledger import read_ledger
    from dettrain.record.wandb_io import read_wandb_run

    full, cut = tmp_path / "full", tmp_path / "cut"
    run_example(full, 2, "--tier", "4")
    run_example(cut, 2, "--tier", "4", "--stop-after", "3", "--wandb")
    assert [s["step"] for s in steps(cut)] == [0, 1, 2]
    assert (cut / "checkpoints" / "step_00000003" / "loop.json").is_file()
    run_example(cut, 2, "--tier", "4", "--resume", "--wandb")
    assert len(step_fields(full)) == 6 and step_fields(cut) == step_fields(full)
    assert read_ledger(cut)[0]["config"] == read_ledger(full)[0]["config"]
    header, mirrored = read_wandb_run(cut)
    assert len(header["wandb"]["runs"]) == 1  # the resume continued the same wandb run
    fields = ("step", "batch", "loss_bits", "grad", "param", "opt")
    assert [tuple(r[f] for f in fields) for r in mirrored] == step_fields(full, fields)


def test_load_checkpoint_refuses_a_damaged_file(tmp_path):
    import dettrain
    from dettrain.errors import UserError

    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    assert dettrain.load_checkpoint(tmp_path / "ck", model, opt) is None  # nothing saved yet: a fresh start
    path = dettrain.save_checkpoint(tmp_path / "ck", 1, model, opt)
    other = torch.nn.Linear(4, 2)
    o2 = torch.optim.AdamW(other.parameters())
    assert dettrain.load_checkpoint(tmp_path / "ck", other, o2) == 1
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), other.state_dict().values()))
    assert torch.equal(o2.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    with open(path / "state.pt", "r+b") as f:
        f.seek(100)
        f.write(b"\xff")
    with pytest.raises(UserError, match="state.pt does not match its sha256"):
        dettrain.load_checkpoint(tmp_path / "ck", other, o2)


def test_step_ledger_never_replaces_another_runs_ledger(tmp_path):
    """A fresh StepLedger (resume_step=None) refuses a ledger holding steps of another config (the trainer refuses the
    same); the same config restarted from step 0 rewrites its own ledger, as ckpt.resume=auto without a checkpoint."""
    import dettrain
    from dettrain.errors import UserError

    model = torch.nn.Linear(4, 2)
    path = tmp_path / "ledger.jsonl"
    first = dettrain.StepLedger(path, model, config={"run": "a"})
    first.log(0, loss=1.0)
    first.close()
    before = path.read_bytes()
    with pytest.raises(UserError, match="holds 1 steps of another run.*resume_step=load_checkpoint"):
        dettrain.StepLedger(path, model, config={"run": "b"})
    assert path.read_bytes() == before
    path.write_bytes(b"not a ledger\n{}\n")
    with pytest.raises(UserError, match="not a ledger this loop may replace"):
        dettrain.StepLedger(path, model, config={"run": "a"})
    path.write_bytes(before)
    again = dettrain.StepLedger(path, model, config={"run": "a"})  # the same run from step 0: rewritten
    again.close()
    assert len(path.read_text().splitlines()) == 1


def test_load_checkpoint_refuses_what_would_not_resume_the_same_loop(tmp_path, caplog):
    """Another optimizer class, a sampler of another geometry, a file as the root, the run dir instead of its
    checkpoints directory: each a UserError naming the fix.  A newer step directory without loop.json (damage) is
    passed over with a logged warning, and with no complete checkpoint left it is an error, never a fresh start."""
    import logging

    import dettrain
    from dettrain.errors import UserError

    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    data = dettrain.sampler(None, seq_len=16, seed=0, global_batch=8, micro_batch=2, max_bytes=20_000)
    root = tmp_path / "out" / "checkpoints"
    dettrain.save_checkpoint(root, 1, model, opt, data)
    last = dettrain.save_checkpoint(root, 2, model, opt, data)
    with pytest.raises(UserError, match="holds the state of a torch.optim.adamw.AdamW optimizer, this loop's is "
                                        "torch.optim.sgd.SGD"):
        dettrain.load_checkpoint(root, model, torch.optim.SGD(model.parameters(), lr=0.1), data)
    other = dettrain.sampler(None, seq_len=16, seed=0, global_batch=4, micro_batch=2, max_bytes=20_000)
    with pytest.raises(UserError, match="sampler of another geometry \\(global_batch 8 -> 4\\)"):
        dettrain.load_checkpoint(root, model, opt, other)
    with pytest.raises(UserError, match="is a file"):
        dettrain.load_checkpoint(last / "loop.json", model, opt, data)
    with pytest.raises(UserError, match="pass that directory"):
        dettrain.load_checkpoint(tmp_path / "out", model, opt, data)
    assert dettrain.load_checkpoint(root, model, opt, data) == 2
    (last / "loop.json").unlink()
    with caplog.at_level(logging.WARNING, logger="dettrain"):
        assert dettrain.load_checkpoint(root, model, opt, data) == 1
    assert "step_00000002 has no loop.json (damaged); resuming from" in caplog.text
    (root / "step_00000001" / "loop.json").unlink()
    with pytest.raises(UserError, match="no complete checkpoint"):
        dettrain.load_checkpoint(root, model, opt, data)
