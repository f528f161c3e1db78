"""dettrain trace on real runs: a faithful replay's step fingerprints equal the ledger's (and an override is
reported as unfaithful); ``--repeat 2`` names the deliberately non-deterministic module and op; a thread-count
dependent CPU reduction is named between det.threads=1 and 2 at tier 0; per-rank traces for the flat and FSDP2
engines at 2 ranks; ``dettrain diff`` of trace files; bad input exits 2 with one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, sums_with_1_and_2_threads, tmpfs, train

from dettrain.record.ledger import read_ledger
from dettrain.tools.trace import compare_traces, read_one, read_trace

TESTS = Path(__file__).resolve().parent
ENV = {"PYTHONPATH": os.pathsep.join([str(TESTS), str(REPO), os.environ.get("PYTHONPATH", "")])}
# the ledger's step fingerprints, and the validation loss on evaluating steps
FIELDS = ("batch", "loss_bits", "grad", "param", "opt")
CUSTOM = ["model=custom", "model.seq_len=32", "train.steps=2", "train.global_batch=4", "train.micro_batch=2",
          "data.max_bytes=300000", "log.wandb.mode=disabled", "log.every=1", "ckpt.every=1"]


def trace(*args, nproc: int = 1, env: dict | None = None) -> subprocess.CompletedProcess:
    """``python -m dettrain.trace ARGS`` (through torchrun for nproc > 1), as a user runs it."""
    entry = ["-m", "dettrain.trace", *map(str, args)]
    cmd = ([sys.executable, *entry] if nproc == 1 else
           [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *entry])
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **ENV, **(env or {})})


def diff(a, b) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dettrain.diff", str(a), str(b)], cwd=REPO, capture_output=True,
                          text=True, timeout=300, env={**os.environ, **ENV})


def ledger_step(run: Path, step: int) -> dict:
    _, steps = read_ledger(run)
    return next(s for s in steps if s["step"] == step)


# ---- faithful replays --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama_run(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("trace") / "run"
    train(run, "det.tier=3", "ckpt.every=2", "eval.every=2", "data.val_fraction=0.1", "eval.batches=2")
    return run


def test_replay_between_checkpoints_is_faithful_with_every_op_traced(llama_run, tmp_path):
    out = tmp_path / "t3.jsonl"
    p = trace(llama_run, "--step", 3, "--ops", "--out", out)  # checkpoint step_2, replays step 2, traces 3
    assert p.returncode == 0, p.stdout + p.stderr
    assert "faithful: step fingerprints equal the ledger's" in p.stdout
    head, recs = read_one(out)
    assert head["checkpoint"].endswith("step_00000002") and head["replayed"] == [2]
    want = ledger_step(llama_run, 3)
    assert "val_loss_bits" in want  # an evaluating step: its validation loss is replayed too
    assert head["faithful"] and head["differs"] == []
    # the trace's own step fingerprints, against the ledger line that training wrote
    for f in (*FIELDS, "val_loss_bits"):
        assert head["step_record"][f] == want[f], f
    assert head["step_record"]["grad_norm"] == want["grad_norm"] and head["step_record"]["lr"] == want["lr"]
    # every module ran forward and backward, in execution order, the ops inside them named
    assert [r["seq"] for r in recs] == list(range(len(recs)))
    fwd = {r["module"] for r in recs if r["kind"] == "module" and r["phase"] == "forward"}
    bwd = {r["module"] for r in recs if r["kind"] == "module" and r["phase"] == "backward"}
    assert {"tok_emb", "layers.0.attn", "layers.1.ffn.w2", "norm", ""} <= fwd  # "": the model itself
    assert {"layers.0.attn", "layers.1.ffn.w2", "norm", ""} <= bwd
    calls = {r["call"] for r in recs if r["kind"] == "module" and r["module"] == "layers.0.attn"}
    assert calls == {0, 1, 2, 3}  # 4 micro-batches of 2 samples
    ops = {(r["module"], r["op"].split(".")[0]) for r in recs if r["kind"] == "op"}
    assert ("layers.1.ffn.w2", "mm") in ops and ("norm", "rsqrt") in ops
    assert any(r["kind"] == "op" and r["phase"] == "backward" and r["module"].startswith("layers.") for r in recs)
    # the same trace compared with itself through dettrain diff
    d = diff(out, out)
    assert d.returncode == 0 and "IDENTICAL" in d.stdout, d.stdout + d.stderr


def test_replay_at_a_checkpoint_and_an_override_that_is_reported(llama_run, tmp_path):
    p = trace(llama_run, "--step", 2, "--out", tmp_path / "t2.jsonl")
    assert p.returncode == 0, p.stdout + p.stderr
    head, recs = read_one(tmp_path / "t2.jsonl")
    assert head["replayed"] == [] and head["faithful"]
    assert [head["step_record"][f] for f in FIELDS] == [ledger_step(llama_run, 2)[f] for f in FIELDS]
    assert recs and not any(r["kind"] == "op" for r in recs)  # no --ops: modules only
    # another learning rate: same batch, loss and gradient, another update; the replay says so
    q = trace(llama_run, "--step", 2, "train.lr=0.001", "--out", tmp_path / "lr.jsonl")
    assert q.returncode == 0, q.stdout + q.stderr
    # (AdamW's moments depend on the gradients only: they stay equal)
    assert "NOT faithful: param differs from the ledger's line (overrides: train.lr=0.001)" in q.stdout
    head_lr, _ = read_one(tmp_path / "lr.jsonl")
    assert not head_lr["faithful"] and head_lr["differs"] == ["param"]
    # every module output is equal (the forward and backward did not change), and the step fields say what did
    d = diff(tmp_path / "t2.jsonl", tmp_path / "lr.jsonl")
    assert d.returncode == 1 and "step fingerprints differ: param\n" in d.stdout, d.stdout + d.stderr
    assert "first module that differs" not in d.stdout


def test_recorder_changes_no_bit_and_leaves_nothing_behind():
    """The hooks and the dispatch mode see the step without changing it, and are gone after it (a normal run,
    which never imports dettrain.tools (tests/test_layout.py), has none)."""
    import torch
    from torch import nn

    from dettrain.tools.trace import Recorder

    def step(model, recorder=None):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
        if recorder is not None:
            recorder.start()
        try:
            loss = model(x).square().mean()
            loss.backward()
        finally:
            if recorder is not None:
                recorder.stop()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 2))

    plain, traced = build(), build()
    rec = Recorder(traced, ops=True)
    la, ga = step(plain)
    lb, gb = step(traced, rec)
    assert torch.equal(la, lb) and all(torch.equal(a, b) for a, b in zip(ga, gb))
    kinds = {(r["kind"], r["phase"], r["module"]) for r in rec.records}
    assert {("module", "forward", "0"), ("module", "backward", "2"), ("module", "forward", "")} <= kinds
    assert any(r["kind"] == "op" and r["op"].startswith("addmm") and r["module"] == "0" for r in rec.records)
    for m in traced.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks
    assert torch._C._len_torch_dispatch_stack() == 0


def test_a_compiled_run_replays_compiled_and_faithful_into_its_run_dir(tmp_path):
    """train.compile=true (the default on CUDA): the replay builds the run as training did (compiled, the same
    graphs), so the traced step equals the ledger's and two replays are identical; the modules inside a compiled
    block are recorded as the block.  With --ops the traced step runs eager, and the output says so.  The default
    output goes into the run, not the current directory."""
    run = tmp_path / "compiled"
    train(run, "det.tier=3", "train.compile=true", "ckpt.every=2")
    p = trace(run, "--step", 3, "--repeat", 2)  # checkpoint step_2, replays step 2 compiled, traces step 3
    assert p.returncode == 0, p.stdout + p.stderr
    assert "faithful: step fingerprints equal the ledger's" in p.stdout and "the step runs compiled" in p.stdout
    assert "replay 0 vs replay 1:\nIDENTICAL" in p.stdout
    assert (run / "trace_step3.jsonl").is_file() and not (REPO / "trace_step3.jsonl").exists()
    head, recs = read_one(run / "trace_step3.jsonl")
    assert head["faithful"] and head["config"]["train"]["compile"] is True
    assert [head["step_record"][f] for f in FIELDS] == [ledger_step(run, 3)[f] for f in FIELDS]
    fwd = {r["module"] for r in recs if r["phase"] == "forward"}
    assert {"layers.0", "layers.1", "tok_emb", "norm", ""} <= fwd and "layers.0.attn" not in fwd
    assert any(r["module"] == "layers.1" and r["phase"] == "backward" for r in recs)
    q = trace(run, "--step", 3, "--ops", "--out", tmp_path / "ops.jsonl")
    assert q.returncode == 0, q.stdout + q.stderr
    assert "--ops: the traced step runs eager" in q.stdout
    _, ops = read_one(tmp_path / "ops.jsonl")
    assert any(r["kind"] == "op" and r["module"] == "layers.0.ffn.w2" for r in ops)


def test_default_output_goes_into_the_traced_run(tmp_path):
    from dettrain.tools.trace import out_path

    a, b = tmp_path / "a", tmp_path / "b"
    assert out_path(None, a, 3, "", [str(a)]) == a / "trace_step3.jsonl"
    assert [out_path(None, r, 3, lab, [str(a), str(b)]) for r, lab in ((a, "A"), (b, "B"))] == \
        [a / "trace_step3.jsonl", b / "trace_step3.jsonl"]
    assert [out_path(None, a, 3, lab, [str(a), str(a)]) for lab in "AB"] == \
        [a / "trace_step3.A.jsonl", a / "trace_step3.B.jsonl"]  # one run twice: two files
    assert out_path("x.jsonl", a, 3, "", [str(a)]) == Path("x.jsonl")
    assert out_path("d", a, 3, "B", [str(a), str(b)]) == Path("d") / "B.jsonl"


# ---- naming the op ------------------------------------------------------------------------------------------
def test_repeat_names_the_nondeterministic_module_and_op(tmp_path):
    run = tmp_path / "noisy"
    train(run, *CUSTOM, "model._target_=custom_models.NoisyLM", "det.tier=3", tiny=False, env=ENV)
    out = tmp_path / "n.jsonl"
    p = trace(run, "--step", 1, "--repeat", 2, "--ops", "--keep-values", "--out", out)
    assert p.returncode == 1, p.stdout + p.stderr  # the two replays differ
    assert "first module that differs: noisy (call 0) forward output" in p.stdout
    assert "first op that differs: noisy (call 0) forward aten.randn" in p.stdout
    assert "suggestion: a random draw that replays differently" in p.stdout
    res = compare_traces(read_trace(str(out)), read_trace(str(out) + ".repeat1"))
    r = res["ranks"][0]
    assert r["first_op"]["a"]["module"] == "noisy" and r["first_op"]["a"]["op"].startswith("randn")
    assert r["first_module"]["a"]["module"] == "noisy"
    # everything before it was equal: the embedding's op and output are the same in both replays
    _, ra = read_one(out)
    _, rb = read_one(Path(str(out) + ".repeat1"))
    first = r["first_op"]["a"]["seq"]
    assert first > 0 and [x["fp"] for x in ra[:first]] == [x["fp"] for x in rb[:first]]
    v = r["first_op"]["values"]  # both replays kept the noise: its difference in values and ULPs
    assert v is not None and v["max_abs"] > 0 and v["max_ulps"] > 0 and v["n_differ"] > 0


def test_thread_count_dependent_sum_is_named_between_1_and_2_threads(tmp_path):
    from custom_models import THREAD_SUM_SEED

    one, two = sums_with_1_and_2_threads(THREAD_SUM_SEED)
    assert one.item() != two.item()  # the premise on this machine: the model's sum depends on the thread count
    run = tmp_path / "thr"
    train(run, *CUSTOM, "model._target_=custom_models.ThreadSumLM", "det.tier=0", tiny=False, env=ENV)
    for n in (1, 2):
        p = trace(run, "--step", 1, "--ops", f"det.threads={n}", "--out", tmp_path / f"t{n}.jsonl")
        assert p.returncode == 0, p.stdout + p.stderr
        head = read_one(tmp_path / f"t{n}.jsonl")[0]
        assert head["threads"] == n
        if n == 1:  # the run's own setting: a faithful replay through the DDP engine (tier 0)
            assert head["engine"] == "ddp" and head["faithful"], head["differs"]
    d = diff(tmp_path / "t1.jsonl", tmp_path / "t2.jsonl")
    assert d.returncode == 1, d.stdout + d.stderr
    assert "threads: A 1 | B 2" in d.stdout
    assert "first op that differs: total (call 0) forward aten.sum" in d.stdout
    assert "first module that differs: total (call 0) forward output" in d.stdout
    assert "pin det.threads" in d.stdout


# ---- several ranks ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("engine", ["flat", "fsdp2"])
def test_per_rank_traces_at_2_ranks(tmp_path, engine):
    run = tmp_path / engine
    train(run, "det.tier=3", f"dist.engine={engine}", "train.steps=2", "ckpt.every=1", nproc=2)
    if engine == "flat":  # two runs' step (here the same run twice): traced one after the other, then compared
        p = trace(run, run, "--step", 1, "--ops", "--out", tmp_path / "ab", nproc=2)
        files = {s: [tmp_path / "ab" / f"{s}.jsonl.rank{r}" for r in (0, 1)] for s in "AB"}
        compared = (tmp_path / "ab" / "A.jsonl", tmp_path / "ab" / "B.jsonl")
    else:  # two replays in one process
        p = trace(run, "--step", 1, "--ops", "--repeat", 2, "--out", tmp_path / "t.jsonl", nproc=2)
        files = {"A": [tmp_path / f"t.jsonl.rank{r}" for r in (0, 1)],
                 "B": [tmp_path / f"t.jsonl.rank{r}.repeat1" for r in (0, 1)]}
        compared = (tmp_path / "t.jsonl", None)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "rank 0: IDENTICAL" in p.stdout and "rank 1: IDENTICAL" in p.stdout
    want = ledger_step(run, 1)
    for side in "AB":
        heads = [read_one(f) for f in files[side]]
        assert [h["rank"] for h, _ in heads] == [0, 1] and all(h["world"] == 2 for h, _ in heads)
        assert all(h["faithful"] and h["engine"] == engine for h, _ in heads)
        assert all([h["step_record"][f] for f in FIELDS] == [want[f] for f in FIELDS] for h, _ in heads)
        assert all(any(r["kind"] == "op" for r in recs) for _, recs in heads)
    # each rank ran its own micro-batches: the ranks' traces differ from each other
    assert [r["fp"] for r in read_one(files["A"][0])[1]] != [r["fp"] for r in read_one(files["A"][1])[1]]
    if compared[1] is not None:  # dettrain diff of the base names compares rank by rank
        d = diff(*compared)
        assert d.returncode == 0 and "rank 1: IDENTICAL" in d.stdout, d.stdout + d.stderr


# ---- bad input ---------------------------------------------------------------------------------------------
def test_bad_input_exits_2_with_one_line_and_from_start_replays(tmp_path):
    run = tmp_path / "run"
    train(run, "det.tier=3", "train.steps=2")  # only the final checkpoint (step_2)
    cases = [((run, "--step", 1), "no checkpoint at or before step 1"),
             ((run, "--step", 9), "holds steps 0..1"),
             ((tmp_path / "nope", "--step", 0), "no such run dir"),
             ((run, "--step", 0, "det.tier=zz"), "det.tier"),
             ((run, "--step", 0, "--keep-values", "--values-mb", "-1"), "--values-mb -1: give the byte budget"),
             ((run, "--step", 0, "--keep-values", "--values-mb", "0"), "--values-mb 0: give the byte budget")]
    for args, msg in cases:
        p = trace(*args, "--out", tmp_path / "x.jsonl")
        assert p.returncode == 2, (args, p.stdout, p.stderr)
        assert msg in p.stderr and len(p.stderr.strip().splitlines()) == 1 and "Traceback" not in p.stderr, p.stderr
    assert not (tmp_path / "x.jsonl").exists()
    # a trace and a run dir are not comparable: bad input
    p = trace(run, "--step", 1, "--from-start", "--out", tmp_path / "s.jsonl")
    assert p.returncode == 0 and "faithful: step fingerprints" in p.stdout, p.stdout + p.stderr
    head, _ = read_one(tmp_path / "s.jsonl")
    assert head["checkpoint"] is None and head["replayed"] == [0] and head["faithful"]
    d = diff(tmp_path / "s.jsonl", run)
    assert d.returncode == 2 and len(d.stderr.strip().splitlines()) == 1, d.stderr
    # --out never overwrites a file the tool did not write
    (tmp_path / "mine.txt").write_text("keep me")
    p = trace(run, "--step", 1, "--from-start", "--out", tmp_path / "mine.txt")
    assert p.returncode == 2 and "is not a trace this tool wrote" in p.stderr
    assert (tmp_path / "mine.txt").read_text() == "keep me"
    assert json.loads((tmp_path / "s.jsonl").read_text().split("\n")[0])["kind"] == "trace_header"


# ---- issue 43: --out that cannot be written ------------------------------------------------------------------------
def test_trace_out_a_file_in_two_run_mode_and_a_full_disk_are_one_line(llama_run, tmp_path):
    """Two runs write a directory: an existing file as --out is refused before any work, and left as it was.  A
    trace onto a full tmpfs: exit 2 naming the file and 'No space left on device', and no .tmp is left."""
    mine = tmp_path / "mine.txt"
    mine.write_text("keep me")
    p = trace(llama_run, llama_run, "--step", 1, "--out", mine)
    assert p.returncode == 2 and f"--out {mine} is a file" in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert mine.read_text() == "keep me"
    with tmpfs(tmp_path / "mnt", leave=0) as mnt:
        p = trace(llama_run, "--step", 2, "--keep-values", "--out", mnt / "t.jsonl")
        assert p.returncode == 2 and "Traceback" not in p.stderr and "No space left on device" in p.stderr, p.stderr
        assert str(mnt / "t.jsonl") in p.stderr and sorted(x.name for x in mnt.iterdir()) == ["filler"]
