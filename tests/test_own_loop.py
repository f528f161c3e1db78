"""The library API in a user's own loop (dettrain.api, examples/own_loop.py): a plain PyTorch loop with torch AdamW
gives the same ledger on 1 and 2 ranks with accumulate="tree", and that ledger is what dettrain.diff reads."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from conftest import REPO, run_script

EXAMPLE = REPO / "examples" / "own_loop.py"


def run_example(out, nproc: int, *args: str) -> None:
    run_script(EXAMPLE, out, nproc, *args)


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
    from dettrain.record.wandb_io import read_wandb_file, read_wandb_run, wandb_files

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
    # StepLedger.log's own numbers (the example's tokens_seen, lr) are in the wandb rows too, step by step
    rows = {}
    for f in wandb_files(cut):
        rows.update({r["_step"]: r for r in read_wandb_file(f)[2] if "train/tokens_seen" in r})
    assert [(k, rows[k]["train/tokens_seen"], rows[k]["train/lr"]) for k in sorted(rows)] == \
        [(s["step"], s["tokens_seen"], s["lr"]) for s in steps(full)]


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


# ---- the API at accelerate/Fabric's level: sharded, bf16, a user's Dataset, extra state in checkpoints --------------
VARIANTS = {"shard": ["--shard"], "bf16": ["--precision", "bf16"], "dataset": ["--dataset"],
            "shard-bf16": ["--shard", "--precision", "bf16"]}


@pytest.fixture(scope="module")
def replicated_fp32(tmp_path_factory):
    """The example's plain run (replicated, fp32, token array) on one rank at tier 4: what the variants are held to."""
    out = tmp_path_factory.mktemp("plain")
    run_example(out, 1, "--tier", "4")
    return steps(out)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_own_loop_variant_tier4_same_ledger_on_1_and_2_ranks(tmp_path, variant, replicated_fp32):
    """GradSync(shard=True) (FSDP2), precision='bf16' and a map-style Dataset through dettrain.sampler: each gives
    the same whole step lines on 1 and 2 Gloo ranks at tier 4 (loss, fingerprints, the scheduler's lr, the user's
    counter).  Sharded fp32 is the replicated run bit for bit; bf16 compute and the Dataset change the numbers
    (they are really in use)."""
    run_example(tmp_path / "one", 1, "--tier", "4", *VARIANTS[variant])
    run_example(tmp_path / "two", 2, "--tier", "4", *VARIANTS[variant])
    a, b = steps(tmp_path / "one"), steps(tmp_path / "two")
    assert len(a) == 6 and a == b
    assert [s["lr"] for s in a] == pytest.approx([1e-3, 2e-3, 3e-3, 3e-3, 3e-3, 3e-3])
    assert [s["tokens_seen"] for s in a] == [128 * (k + 1) for k in range(6)]
    if variant == "shard":
        assert a == replicated_fp32  # FSDP2's shards give the replicated sync's bits
    else:
        assert [s["loss_bits"] for s in a] != [s["loss_bits"] for s in replicated_fp32]


def test_sharded_loop_stopped_on_2_ranks_resumes_on_1_as_uninterrupted(tmp_path, replicated_fp32):
    """GradSync(shard=True): save_checkpoint gathers the shards into full tensors by name (AdamW state too) and
    load_checkpoint gives each rank its rows, so a loop stopped on 2 ranks resumes on 1; the LR scheduler and the
    user's counter (save/load_checkpoint's extra) continue where they were: the whole ledger is the
    uninterrupted one's."""
    cut = tmp_path / "cut"
    run_example(cut, 2, "--tier", "4", "--shard", "--stop-after", "3")
    state = torch.load(cut / "checkpoints" / "step_00000003" / "state.pt", weights_only=True)
    assert state["extra"]["progress"] == {"tokens_seen": 384} and state["extra"]["scheduler"]["last_epoch"] == 3
    assert state["model"]["head.weight"].shape == (256, 48)  # full tensors, not one rank's rows
    run_example(cut, 1, "--tier", "4", "--shard", "--resume")
    assert steps(cut) == replicated_fp32


def test_checkpoint_extra_state_round_trips_and_a_missing_name_is_refused(tmp_path):
    """save_checkpoint(extra=...) keeps an LR scheduler, a GradScaler and a user's counter; load_checkpoint gives
    each its state back, and refuses (one line) a name the checkpoint does not hold."""
    import dettrain
    from dettrain.errors import UserError

    class Counter:
        def __init__(self) -> None:
            self.n = 0

        def state_dict(self) -> dict:
            return {"n": self.n}

        def load_state_dict(self, state: dict) -> None:
            self.n = state["n"]

    def build():
        model = torch.nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        return (model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5),
                torch.amp.GradScaler("cpu", init_scale=1024.0), Counter())

    model, opt, sched, scaler, counter = build()
    for _ in range(3):
        opt.step()
        sched.step()
    scaler._scale = torch.tensor(64.0)
    counter.n = 7
    dettrain.save_checkpoint(tmp_path / "ck", 3, model, opt,
                             extra={"sched": sched, "scaler": scaler, "counter": counter})
    model2, opt2, sched2, scaler2, counter2 = build()
    extra = {"sched": sched2, "scaler": scaler2, "counter": counter2}
    assert dettrain.load_checkpoint(tmp_path / "ck", model2, opt2, extra=extra) == 3
    assert sched2.last_epoch == 3 and sched2.get_last_lr() == sched.get_last_lr() == [0.5]
    assert scaler2.get_scale() == 64.0 and counter2.n == 7
    with pytest.raises(UserError, match=r"holds no state for extra \['other'\]"):
        dettrain.load_checkpoint(tmp_path / "ck", model2, opt2, extra={"other": Counter()})


def test_sampler_over_a_map_style_dataset_is_world_size_free_and_resumable():
    """dettrain.sampler(Dataset): the step's micro-batches are the collated items of the global order over the
    dataset's indices, the same samples whatever the world size, and (epoch, position) resumes mid-epoch."""
    import dettrain

    class Squares(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 37

        def __getitem__(self, i: int) -> dict:
            return {"x": torch.tensor([float(i)]), "y": torch.tensor(i * i)}

    def run(rank: int, world: int, state: dict | None = None, n: int = 12) -> list[tuple[int, list[int]]]:
        from dettrain.data import StepSampler

        s = dettrain.sampler(Squares(), seed=3, global_batch=8, micro_batch=2)
        s.rank, s.world = rank, world  # this rank's share of the same global order (no process group here)
        assert isinstance(s, StepSampler)
        if state:
            s.load_state_dict(state)
        it = iter(s)
        out = []
        for _ in range(n):
            for mb in next(it):
                assert torch.equal(mb.batch["y"], mb.batch["x"].squeeze(1).long() ** 2)
                out.append((mb.index, mb.batch["x"].squeeze(1).long().tolist()))
        return out

    one = run(0, 1)
    assert len(one) == 48 and sorted(run(0, 2) + run(1, 2), key=one.index) == one  # the same (index, samples)
    # 4 steps of 8 use 32 of 37 items an epoch: a new permutation each epoch, every epoch a permutation
    firsts = [i for _, ids in one[:16] for i in ids]
    assert len(set(firsts)) == 32 and firsts != list(range(32))
    resumed = run(0, 1, {"epoch": 1, "position": 8}, n=2)
    assert resumed == one[20:28]
