"""The validation loss (eval.*, data.val_fraction, data.val_path): a held-out split the sampler never draws from,
the same bits on 1 and 2 ranks at tier 4 (flat and FSDP2), evaluation that leaves training untouched, resume, the
diff of a validation-only difference, and bad config exits 2 naming the key."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
from conftest import REPO, step_fields, train

from dettrain.data import DataConfig, StepSampler, ValidationSet, prepare, split_samples
from dettrain.record.ledger import read_ledger
from dettrain.tools import diff

# tier 4 with dropout on (so eval mode and the return to train mode matter); TINY runs 4 steps: evals after 1 and 3
EVAL = ["det.tier=4", "eval.every=2", "eval.batches=4", "model.dropout=0.1"]
VAL_KEYS = ("val_loss", "val_loss_bits")


def val_bits(run) -> list[tuple[int, str | None]]:
    return [(s["step"], s.get("val_loss_bits")) for s in read_ledger(run)[1]]


def training_fields(run) -> list[tuple]:
    """The step lines without the validation fields."""
    return [tuple(sorted((k, v) for k, v in s.items() if k not in VAL_KEYS)) for s in read_ledger(run)[1]]


@pytest.fixture(scope="module")
def frac_runs(tmp_path_factory):
    """data.val_fraction=0.1 at tier 4: one rank (flat), two ranks (flat), two ranks (fsdp2)."""
    root = tmp_path_factory.mktemp("frac")
    args = [*EVAL, "data.val_fraction=0.1"]
    out = {}
    for name, nproc, extra in (("flat1", 1, "dist.engine=flat"), ("flat2", 2, "dist.engine=flat"),
                               ("fsdp2", 2, "dist.engine=fsdp2")):
        p = train(root / name, *args, extra, nproc=nproc)
        out[name] = (root / name, p.stdout)
    return out


def test_val_loss_same_bits_on_1_and_2_ranks_flat_and_fsdp2(frac_runs):
    one = val_bits(frac_runs["flat1"][0])
    assert [s for s, b in one if b is not None] == [1, 3]  # (k+1) % eval.every == 0, and the last step
    assert one[1][1] != one[3][1]  # the model changed between the two evaluations
    for name in ("flat2", "fsdp2"):
        assert val_bits(frac_runs[name][0]) == one, name
        assert step_fields(frac_runs[name][0]) == step_fields(frac_runs["flat1"][0]), name
    # the progress line shows it at the evaluating steps
    _, steps = read_ledger(frac_runs["flat1"][0])
    assert f"| val {steps[1]['val_loss']:.4f}" in frac_runs["flat1"][1]
    assert struct.unpack("<I", struct.pack("<f", steps[3]["val_loss"]))[0] == int(steps[3]["val_loss_bits"], 16)


def test_held_out_samples_are_never_drawn_by_the_sampler():
    T, N = 8, 400  # token value = position, so a window's first token tells its sample id
    tokens = np.arange(N * T + 1, dtype=np.int64)
    train_ds, val_ds = split_samples(DataConfig(val_fraction=0.25), tokens, T)
    n_train = N - N // 4
    assert (train_ds.n, val_ds.n) == (n_train, N // 4)
    expected_val = list(range(n_train, n_train + 8))  # eval.batches=4 x micro_batch=2: the first held-out samples
    for world, assignment in ((1, "block"), (2, "block"), (2, "round_robin")):
        seen, val_rows = set(), {}
        for rank in range(world):
            sampler = StepSampler(train_ds, 0, 8, 2, rank, world, assignment=assignment)
            it = iter(sampler)
            for _ in range(3 * n_train // 8 + 5):  # past three epochs
                for mb in next(it):
                    seen |= set((mb.tokens[:, 0] // T).tolist())
                    assert int(mb.tokens.max()) <= n_train * T  # no held-out target is a training token
            vs = ValidationSet(val_ds, 4, 2, rank, world, assignment)
            for mb in vs.local_batches():
                val_rows[mb.index] = (mb.tokens[:, 0] // T).tolist()
                assert int(mb.tokens[:, 1:].min()) > n_train * T
        assert seen == set(range(n_train)), (world, assignment)  # every training sample, no held-out one
        assert [i for j in sorted(val_rows) for i in val_rows[j]] == expected_val, (world, assignment)
        assert sorted(vs.order) == [0, 1, 2, 3]
    full, none = split_samples(DataConfig(), tokens, T)
    assert none is None and full.n == N  # no split: training sees every sample, as before


@pytest.fixture(scope="module")
def val_file(tmp_path_factory):
    out = tmp_path_factory.mktemp("valdata") / "val.bin"
    prepare([str(REPO / "docs")], str(out), eot=False)  # byte tokens, vocabulary 256 like the embedded corpus
    return out


@pytest.fixture(scope="module")
def val_path_run(tmp_path_factory, val_file):
    run = tmp_path_factory.mktemp("vp") / "run"
    train(run, *EVAL, f"data.val_path={val_file}")
    return run


def test_val_path_evaluates_and_leaves_training_untouched(tmp_path, val_path_run):
    assert [s for s, b in val_bits(val_path_run) if b is not None] == [1, 3]
    plain = tmp_path / "plain"  # the same run without evaluation: every training field equal
    train(plain, *[a for a in EVAL if not a.startswith("eval.")])
    assert all(b is None for _, b in val_bits(plain))
    assert training_fields(val_path_run) == training_fields(plain)


def test_resume_evaluates_at_the_same_steps(tmp_path, val_file, val_path_run):
    run = tmp_path / "run"
    train(run, *EVAL, f"data.val_path={val_file}", "train.stop_after=1")
    assert [s["step"] for s in read_ledger(run)[1]] == [0, 1]
    train(run, *EVAL, f"data.val_path={val_file}", "ckpt.resume=auto")  # the ledger check passes with val fields
    assert step_fields(run) == step_fields(val_path_run)  # val_loss included, at steps 1 and 3


def _rewrite(src, dst, step: int, change) -> None:
    lines = [json.loads(x) for x in src.read_text().splitlines()]
    for x in lines:
        if x.get("kind") == "step" and x["step"] == step:
            change(x)
    dst.write_text("".join(json.dumps(x, separators=(",", ":")) + "\n" for x in lines))


def test_diff_reports_a_validation_only_difference(tmp_path, val_path_run, capsys):
    ledger = val_path_run / "ledger.jsonl"

    def next_float(x):  # the next fp32 value: one ULP away, training fields untouched
        bits = int(x["val_loss_bits"], 16) + 1
        x["val_loss_bits"] = f"{bits:08x}"
        x["val_loss"] = struct.unpack("<f", struct.pack("<I", bits))[0]

    edited = tmp_path / "edited.jsonl"
    _rewrite(ledger, edited, 3, next_float)
    assert diff.main([str(val_path_run), str(ledger)]) == 0
    assert "validation loss at 2 evaluations" in capsys.readouterr().out
    assert diff.main([str(val_path_run), str(edited)]) == 1
    out = capsys.readouterr().out
    assert not any(line.startswith("IDENTICAL") for line in out.splitlines())
    assert "DIVERGED in the validation loss at step 3" in out and "(1 ULPs of fp32)" in out
    assert diff.main([str(ledger), str(edited), "--json"]) == 1
    res = json.loads(capsys.readouterr().out)
    assert res["first_divergence"] is None and res["val_divergence"]["step"] == 3 and res["val_divergence"]["ulps"] == 1

    missing = tmp_path / "missing.jsonl"  # one run did not evaluate at step 1
    _rewrite(ledger, missing, 1, lambda x: [x.pop(k) for k in VAL_KEYS])
    assert diff.main([str(ledger), str(missing)]) == 1
    out = capsys.readouterr().out
    assert "evaluate at different steps" in out and not any(x.startswith("IDENTICAL") for x in out.splitlines())


def test_eval_batches_must_divide_over_the_ranks():
    from dettrain.config import Config, validate
    from dettrain.errors import UserError

    cfg = Config()
    cfg.data.val_fraction, cfg.eval.every, cfg.eval.batches = 0.1, 1, 2
    validate(cfg, world=2)
    cfg.eval.batches = 1
    with pytest.raises(UserError, match="eval.batches=1 must be a positive multiple of the world size 2"):
        validate(cfg, world=2)
    cfg.eval.every = 0  # unchecked while evaluation is off
    validate(cfg, world=2)


@pytest.mark.parametrize("case", ["batches_pow2", "split_too_small", "val_vocab"])
def test_bad_eval_config_exits_2_naming_the_key(tmp_path, case):
    if case == "batches_pow2":
        args, key = ["det.tier=4", "data.val_fraction=0.1", "eval.every=1", "eval.batches=3"], "eval.batches=3"
    elif case == "split_too_small":  # 4687 samples: 0.001 holds out 4, fewer than 8 x 2
        args, key = ["data.val_fraction=0.001", "eval.every=1", "eval.batches=8"], "data.val_fraction"
    else:  # end-of-text tokens (id 256) in the validation file, a 256-token model
        val = tmp_path / "val.bin"
        prepare([str(REPO / "docs")], str(val))
        args, key = [f"data.val_path={val}", "eval.every=1", "eval.batches=2"], "data.val_path"
    p = train(tmp_path / "run", *args, check=False)
    assert p.returncode == 2, p.stderr[-2000:]
    assert key in p.stderr and "Traceback" not in p.stderr
    if case == "split_too_small":
        assert "eval.batches" in p.stderr
