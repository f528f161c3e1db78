"""train.overlap_steps: the next step's first micro-batch is queued before a step's line is read (its one host
sync), so on a GPU the device runs it while the host writes the ledger and logs (on by default there: auto).
Real processes on Gloo.

Promises checked:
  * it changes no bit: ``train.overlap_steps=true`` and ``false`` write identical ledgers (every field of every
    step, per-tensor fingerprints included), with a user model that draws from Python's and numpy's global streams
    every forward, dropout, evaluations and checkpoints; and on 2 Gloo ranks at tier 4 (flat engine, the counter's
    tree) and at tier 0 (DDP, one micro-batch a rank, so the first micro-batch's backward runs DDP's all-reduce
    ahead of the previous step's gather of fingerprints: every rank queues its collectives in the same order), and
    FSDP2 at tier 4 with one micro-batch a rank (its all-gathers and reduce-scatter in that micro-batch);
  * a run stopped with train.stop_after and resumed with overlap on equals the uninterrupted run;
  * where it overlaps: only between two plain steps.  Step n+1's first micro-batch is queued before step n's line
    is read unless step n is the process's first, the last before the run's end, followed by an evaluation or a
    scheduled checkpoint; everywhere else the line comes first (the order the trainer queues micro-batches and
    reads lines, logged by tests/step_order_probe.py).
  * on the GPU (marked, skipped on CI): the default config (CUDA graphs) with overlap auto (on there) writes the
    serial run's ledger at tiers 3 and 4, and so does ``DETTRAIN_FP_STREAM=1`` (the parameter and optimizer hashes
    on a side stream).
A preemption signal agreed while a step is in flight checkpoints after that step: tests/test_interrupt.py.
"""

from __future__ import annotations

import json

import pytest
from conftest import REPO, gpu, step_fields, train

RNG_MODEL = REPO / "tests" / "rng_user_model.py"
PROBE = REPO / "tests" / "step_order_probe.py"
EVAL_CKPT = ["eval.every=3", "data.val_fraction=0.1", "ckpt.every=4"]


def test_overlap_changes_no_bit_and_resumes(tmp_path):
    args = ("train.steps=8", "det.tier=3", "model.dropout=0.1", "log.tensor_every=3", *EVAL_CKPT)
    off, on, cut = tmp_path / "off", tmp_path / "on", tmp_path / "cut"
    train(off, *args, "train.overlap_steps=false", script=RNG_MODEL)
    train(on, *args, "train.overlap_steps=true", script=RNG_MODEL)
    base = step_fields(off)
    assert len(base) == 8 and step_fields(on) == base
    assert sum("tensors" in json.loads(x) for x in (on / "ledger.jsonl").read_text().splitlines()) == 3  # 0, 3, 6
    assert sum("val_loss" in json.loads(x) for x in (on / "ledger.jsonl").read_text().splitlines()) == 3
    train(cut, *args, "train.overlap_steps=true", "train.stop_after=4", script=RNG_MODEL)
    train(cut, *args, "train.overlap_steps=true", "ckpt.resume=auto", script=RNG_MODEL)
    assert step_fields(cut) == base


@pytest.mark.parametrize("tier,batch,engine", [(4, "train.global_batch=8", "auto"), (0, "train.global_batch=4", "auto"),
                                               (4, "train.global_batch=4", "fsdp2")])
def test_overlap_on_two_ranks_changes_no_bit(tmp_path, tier, batch, engine):
    args = ("train.steps=5", f"det.tier={tier}", batch, "train.micro_batch=2", "dist.backend=gloo",
            f"dist.engine={engine}")
    train(tmp_path / "off", *args, "train.overlap_steps=false", nproc=2)
    train(tmp_path / "on", *args, "train.overlap_steps=true", nproc=2)
    base = step_fields(tmp_path / "off")
    assert len(base) == 5 and step_fields(tmp_path / "on") == base


def order(run_dir, *args: str) -> list[tuple]:
    log = run_dir.parent / f"{run_dir.name}.order"
    train(run_dir, *args, script=PROBE, env={"STEP_ORDER_LOG": str(log)})
    return [tuple(json.loads(x)) for x in log.read_text().splitlines()]


def test_the_next_step_is_queued_before_a_line_is_read_only_between_plain_steps(tmp_path):
    # 8 steps, 4 micro-batches each; evaluations after steps 2, 5 and 7 (eval.every=3, and the last step), scheduled
    # checkpoints after 3 and 7 (ckpt.every=4): the plain steps with a plain step after them are 1, 4 and 6
    ev = order(tmp_path / "on", "train.steps=8", "det.tier=3", *EVAL_CKPT, "train.overlap_steps=true")
    assert [e for e in ev if e[0] == "line"] == [("line", n) for n in range(8)]
    for n in range(7):
        line, nxt = ev.index(("line", n)), ev.index(("micro", n + 1, 0))
        if n in (1, 4, 6):
            # the next step's first micro-batch, and only that one, before this step's line
            assert nxt < line and ev[nxt + 1] == ("line", n), (n, ev)
        else:
            assert line < nxt, (n, ev)
    off = order(tmp_path / "off", "train.steps=8", "det.tier=3", *EVAL_CKPT, "train.overlap_steps=false")
    assert sorted(off) == sorted(ev) and all(off.index(("line", n)) < off.index(("micro", n + 1, 0))
                                             for n in range(7))


@gpu
@pytest.mark.parametrize("tier", [3, 4])
def test_overlap_changes_no_bit_on_the_gpu(tmp_path, tier):
    """The default config on a GPU (compile auto, CUDA graphs) with train.overlap_steps=auto (on there): the step
    queued ahead replays its graphs while the previous step's line is read, and the ledger equals the serial run's
    (train.overlap_steps=false), dropout on.  Tiers 3 and 4, which promise the same bits on a rerun.  Tier 0 does
    not (docs/determinism.md): there the overlapped run parted from the serial one at step 0's gradient, before any
    step is queued ahead, while two serial runs agreed (one H100, 2026-12-07 and 08: its timed kernel choice may
    pick other kernels in another process)."""
    pytest.importorskip("triton", reason="compile auto needs Triton on CUDA")
    args = ("train.steps=5", f"det.tier={tier}", "train.global_batch=16", "train.micro_batch=4", "model.dropout=0.1")
    train(tmp_path / "auto", *args, "train.overlap_steps=auto")
    train(tmp_path / "off", *args, "train.overlap_steps=false")
    # the experiment of step_record.py: the parameter and optimizer hashes on a side stream beside the next step
    train(tmp_path / "side", *args, "train.overlap_steps=auto", env={"DETTRAIN_FP_STREAM": "1"})
    base = step_fields(tmp_path / "off")
    assert len(base) == 5 and step_fields(tmp_path / "auto") == base and step_fields(tmp_path / "side") == base
