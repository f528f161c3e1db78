"""dettrain.memory: the estimate agrees with measured FSDP2 runs, the engine's extra buffers follow the tier, the
7B plan fits 8 x 80 GB at tiers 3 and 4, bad input exits 2."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys

import pytest
from conftest import REPO, gpu

from dettrain.models.llama import ModelConfig, build_model
from dettrain.tools.memory import (
    GIB,
    Plan,
    Report,
    add_engine_extras,
    main,
    plan_memory,
    render,
    shard_elements,
    summary,
)

# 4 layers of width 128 on 128-token samples, 4 micro-batches of 2 per step: parameters, gradients, optimizer
# state and activations all count
SMALL = ["model.dim=128", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=352",
         "model.seq_len=128", "train.global_batch=8", "train.micro_batch=2"]


def step_peak(report: Report) -> int:
    """The planner's peak of stock FSDP2 (before dettrain's extra buffers)."""
    return sum(report.breakdown.values()) + report.overhead


def last_line_gib(stdout: str) -> float:
    last = stdout.strip().splitlines()[-1]
    m = re.fullmatch(r"peak per rank: (\d+\.\d{1,2}) GiB", last)
    assert m, f"last line is not 'peak per rank: <X> GiB': {last!r}"
    return float(m.group(1))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_estimate_agrees_with_a_measured_gloo_run(tmp_path, precision):
    overrides = [*SMALL, f"train.precision={precision}"]
    p = subprocess.run([sys.executable, str(REPO / "tests" / "memory_worker.py"), str(tmp_path / "init"),
                        *overrides], cwd=REPO, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-4000:]
    measured = json.loads(p.stdout.strip().splitlines()[-1])["peak"]
    _, report = plan_memory(overrides, 1, device="cpu", mode="estimate")
    est = step_peak(report)
    assert measured > 1 << 20
    assert abs(est - measured) <= 0.10 * measured, (est, measured, report.breakdown)


def test_fake_estimate_agrees_with_real_steps_under_the_fake_group():
    # two ranks: sharded parameters, gradients and moments are half size in both runs
    _, est = plan_memory(SMALL, 2, device="cpu", mode="estimate")
    _, real = plan_memory(SMALL, 2, device="cpu", mode="measure", timed_steps=1)
    assert real.step_s is not None and real.step_s > 0
    assert abs(step_peak(est) - step_peak(real)) <= 0.10 * step_peak(real), (est.breakdown, real.breakdown)
    _, one = plan_memory(SMALL, 1, device="cpu", mode="estimate")
    assert est.breakdown["optimizer state"] == pytest.approx(one.breakdown["optimizer state"] / 2, rel=0.02)


def test_measured_tier3_runs_the_engines_canonical_reduce_scatter(monkeypatch, capsys):
    """At tiers 3-4 the measured mode reduce-scatters through FSDP2Engine's own CanonicalReduceScatter (its sums in
    the time, its receive buffer in the peak), so the analytic receive-buffer extra is not added on top."""
    from dettrain.sync import engines

    calls = []
    real = engines.CanonicalReduceScatter.__call__
    monkeypatch.setattr(engines.CanonicalReduceScatter, "__call__",
                        lambda self, *a, **k: (calls.append(1), real(self, *a, **k))[1])
    plan, report = plan_memory([*SMALL, "det.tier=3"], 2, device="cpu", mode="measure", timed_steps=1)
    assert calls and report.canonical_rs_measured
    assert not any("all_to_all" in k for k in report.extras)
    _, est = plan_memory([*SMALL, "det.tier=3"], 2, device="cpu", mode="estimate")
    assert not est.canonical_rs_measured and any("all_to_all" in k for k in est.extras)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=gpu)])
def test_measure_runs_the_trainers_own_step(monkeypatch, device):
    """The measured mode runs the trainer's own steps (``Trainer._step`` and its line: loss and the grad, param and
    opt fingerprints read on the host) with the registry's FSDP2Engine inside (begin_step, backward per micro-batch,
    reduce, clip_, step) at every step it runs, and at tier 4 adds only the counter partials that its
    two-micro-batch step did not hold itself.  On CUDA (eager: the tracked path) the allocator's peak is reported."""
    from dettrain.loop.trainer import _Queued
    from dettrain.sync.engines import FSDP2Engine, lookup

    assert lookup("fsdp2") is FSDP2Engine
    calls: list[tuple] = []
    for meth in ("begin_step", "backward", "reduce", "clip_", "step"):
        real = getattr(FSDP2Engine, meth)
        monkeypatch.setattr(FSDP2Engine, meth, lambda self, *a, _m=meth, _r=real, **k: (
            calls.append((_m, *a[:1])), _r(self, *a, **k))[1])
    lines: list[dict] = []
    real_line = _Queued.line  # each step of the trainer ends in its line (Trainer._step, then _Queued.line)
    monkeypatch.setattr(_Queued, "line", lambda self: (
        lines.append(real_line(self)), calls.append(("line",)), lines[-1])[0])
    overrides = [*SMALL, "det.tier=4", "train.global_batch=16", "train.compile=false"]  # M = 8 on 2 ranks: 4 rounds
    plan, report = plan_memory(overrides, 2, device=device, mode="measure", timed_steps=1)
    names = [c[0] for c in calls]
    two = ["begin_step", "backward", "backward", "reduce", "clip_", "step", "line"]
    assert names == two * 4, names  # untracked, tracked, warm-up, one timed step: each the trainer's
    assert [c[1] for c in calls if c[0] == "begin_step"] == [2, 2, 2, 2]
    assert [line["step"] for line in lines] == [0, 1, 2, 3]
    assert all(isinstance(line[k], str) and line[k] for line in lines for k in ("grad", "param", "opt")), lines[0]
    assert len({line["param"] for line in lines}) == 4  # each step updated the parameters
    assert (plan.partials, plan.partials_run, report.partials_measured) == (2, 1, 1)
    partials = sum(v for k, v in report.extras.items() if k.startswith("tier-4 partials"))
    assert partials == (2 - 1) * 4 * report.n_shard
    assert report.device == device and step_peak(report) >= 12 * report.n_shard  # fp32 shards + two moments
    assert bool(report.overhead_label) == (device == "cuda")  # the allocator's peak, CUDA only


def test_the_stock_baseline_is_stock_fsdp2_played_for_real(monkeypatch):
    """--stock runs stock FSDP2 (torch's AdamW, no dettrain engine, tier-0 settings whatever det.tier says) through
    the measured sequence; on the CPU its tracked step peak is, to the byte, the estimate's (the same stock step
    under FakeTensorMode), and no engine extras are added."""
    import torch

    from dettrain.sync.engines import FSDP2Engine

    def no_engine(*a, **k):
        raise AssertionError("the stock baseline built dettrain's engine")

    monkeypatch.setattr(FSDP2Engine, "__init__", no_engine)
    seen = []
    real_step = torch.optim.AdamW.step
    monkeypatch.setattr(torch.optim.AdamW, "step", lambda self, *a, **k: (
        seen.append(torch.are_deterministic_algorithms_enabled()), real_step(self, *a, **k))[1])
    overrides = [*SMALL, "det.tier=3"]
    settings = (torch.get_num_threads(), torch.are_deterministic_algorithms_enabled(),
                torch.get_float32_matmul_precision(), torch.backends.cudnn.benchmark)
    plan, stock = plan_memory(overrides, 2, device="cpu", mode="measure", timed_steps=1, stock=True)
    # tier 0's settings (fp32 matmul precision "high", cuDNN benchmark) stay inside the measured run
    assert (torch.get_num_threads(), torch.are_deterministic_algorithms_enabled(),
            torch.get_float32_matmul_precision(), torch.backends.cudnn.benchmark) == settings
    assert stock.variant == "stock" and stock.extras == {} and stock.step_s > 0
    assert seen and not any(seen)  # torch's AdamW stepped, with deterministic algorithms off
    monkeypatch.undo()
    _, est = plan_memory(SMALL, 2, device="cpu", mode="estimate")
    assert step_peak(stock) == step_peak(est) and stock.breakdown == est.breakdown
    assert stock.n_shard == est.n_shard and stock.peak < est.peak  # the estimate adds the engine's extras
    assert "stock FSDP2, the baseline" in render(plan, stock, overrides)


def test_compare_stock_interleaves_fresh_processes_and_reports_the_ratio(tmp_path, capsys):
    """--compare-stock R: R rounds, each variant in its own process, stock first in odd rounds and last in even
    ones; the summary's per-round ratios and median are the JSON lines' tokens/s, engine over stock."""
    runs = tmp_path / "runs.jsonl"
    tiny = [*SMALL, "model.n_layers=2", "det.tier=3"]
    assert main(["--nproc", "2", "--device", "cpu", "--compare-stock", "2", "--steps", "1", "--json", str(runs),
                 *tiny]) == 0
    out = capsys.readouterr().out
    lines = [json.loads(x) for x in runs.read_text().splitlines()]
    assert [x["variant"] for x in lines] == ["stock", "engine", "engine", "stock"]
    assert [x["tier"] for x in lines] == [0, 3, 3, 0] and all(x["step_ms"] > 0 for x in lines)
    ratios = sorted([lines[1]["tokens_per_s"] / lines[0]["tokens_per_s"],
                     lines[2]["tokens_per_s"] / lines[3]["tokens_per_s"]])
    assert f"median {(ratios[0] + ratios[1]) / 2:.3f}x, spread {ratios[0]:.3f}-{ratios[1]:.3f}x" in out, out
    assert out.count("== round ") == 4 and out.count("peak per rank: ") == 4


def test_profile_writes_the_measured_steps_op_table(tmp_path, capsys):
    """--profile FILE: one more measured step under torch.profiler, its op table (FSDP2's reduction and the
    model's matmuls among the ops) in FILE and a Chrome trace beside it; refused where no kernel runs."""
    out = tmp_path / "prof.txt"
    argv = ["--nproc", "2", "--device", "cpu", "--mode", "measure", "--steps", "1", "--profile", str(out), *SMALL]
    assert main(argv) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("peak per rank: ")
    table = out.read_text()
    assert table.startswith("one measured step under torch.profiler, ops by self_cpu_time_total")
    assert "aten::mm" in table and "FSDP::post_backward_reduce" in table, table
    trace = json.loads((tmp_path / "prof.txt.trace.json").read_text())
    assert any(e.get("name") == "aten::mm" for e in trace["traceEvents"])
    assert main(["--nproc", "2", "--device", "cpu", "--profile", str(out), *SMALL]) == 2
    assert "--mode=measure" in capsys.readouterr().err
    assert main([*argv[:-len(SMALL) - 1], str(tmp_path / "no" / "p.txt"), *SMALL]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_shard_elements_pad_dim0_to_the_world():
    cfg = ModelConfig(dim=96, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=200, vocab_size=250, seq_len=16)
    model = build_model(cfg, 0, "meta")
    for world in (1, 2, 8):
        want = sum(math.ceil(p.shape[0] / world) * p[0].numel() for p in model.parameters())
        assert shard_elements(model, world) == want
    assert shard_elements(model, 8) > sum(p.numel() for p in model.parameters()) // 8  # 250 rows pad to 256


def plan_of(tier: int, world: int, M: int) -> Plan:
    return Plan("x", "m", world, tier, "fsdp2", 1, 16, M, True, False, True, False)


@pytest.mark.parametrize("tier, world, M, partials, accumulators",
                         [(4, 8, 256, 5, 5), (4, 2, 8, 2, 2), (4, 4, 4, 0, 0), (4, 1, 8, 2, 2), (3, 8, 256, 0, 0),
                          (3, 1, 8, 0, 0), (2, 8, 256, 0, 0)])
def test_engine_extras_follow_the_tier(tier, world, M, partials, accumulators):
    plan = plan_of(tier, world, M)
    assert (plan.partials, plan.accumulators) == (partials, accumulators)
    report = Report("t", params=1000, n_shard=1000, largest_group=3000, breakdown={"activations": 5})
    add_engine_extras(report, plan)
    shard_bytes = sum(v for k, v in report.extras.items() if "shard" in k)
    assert shard_bytes == accumulators * 4 * 1000
    comm = sum(v for k, v in report.extras.items() if "all_to_all" in k)
    # one rank: FSDP2 copies, no all_to_all; several: the rows travel in bf16 with bf16 compute (plan_of's)
    assert plan.mixed_precision
    assert comm == (2 * 3000 if tier >= 3 and world > 1 else 0)
    assert report.peak == 5 + shard_bytes + comm


@pytest.mark.parametrize("gpu_name, peak", [("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12),
                                             ("NVIDIA A100-SXM4-80GB", 312e12), ("Some Future GPU", None)])
def test_measured_mfu_is_over_the_gpu_that_ran(monkeypatch, gpu_name, peak):
    """The measured step's MFU divides by the dense bf16 peak of the GPU the step ran on (record/wandb_io's table),
    and the report names that GPU; a GPU not in the table gets no MFU rather than another GPU's."""
    import torch

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: gpu_name)
    plan = plan_of(3, 8, 256)
    report = Report("t", params=10**9, n_shard=1000, largest_group=3000, breakdown={"activations": 5}, step_s=0.5,
                    device="cuda")
    monkeypatch.setenv("DETTRAIN_FP_FUSED", "1")  # an experiment switch is recorded with the run's overrides
    m = summary(plan, report, ["det.tier=3"])
    assert m["gpu"] == gpu_name and m["overrides"] == ["det.tier=3"] and m["env"]["DETTRAIN_FP_FUSED"] == "1"
    tokens = plan.micro_per_rank_run * plan.micro_batch * plan.seq_len
    if peak is None:
        assert m["mfu"] is None and "MFU" not in render(plan, report, [])
    else:
        assert m["mfu"] == pytest.approx(6 * 10**9 * tokens / 0.5 / peak)
        assert f"/ {peak / 1e12:.0f} TFLOP/s, the dense bf16 peak of the {gpu_name})" in render(plan, report, [])


def test_offloaded_partials_are_planned_in_host_memory():
    """dist.offload_partials (tier 4, FSDP2 engine): the counter's partials leave the device plan for pinned host
    memory; the device keeps only the copies staged back (at most 256 MiB, and never more than the partials)."""
    tier4 = [*SMALL, "det.tier=4", "train.global_batch=16"]  # 4 rounds on 2 ranks: 2 partials
    plan, kept = plan_memory(tier4, 2, device="cpu", mode="estimate")
    plan_off, off = plan_memory([*tier4, "dist.offload_partials=true"], 2, device="cpu", mode="estimate")
    shard = 4 * kept.n_shard
    assert plan.partials == plan_off.partials == 2 and plan_off.offload_partials and not plan.offload_partials
    assert not any(k.startswith("tier-4 partials (") for k in off.extras)
    staged = off.extras["tier-4 partials staged back on the device (at most)"]
    assert staged == min(256 * 2**20, 2 * shard)
    assert list(off.host.values()) == [2 * shard] and kept.host == {}
    assert kept.peak - off.peak == 2 * shard - staged


def test_rounds_all_measures_the_whole_counter(monkeypatch):
    """--rounds all: the measured step runs every micro-batch of the rank (M / W), so tier 4's counter is in the
    measurement and nothing is added for it; with offload its partials are reported as host memory."""
    from dettrain.sync.engines import FSDP2Engine

    begun = []
    real = FSDP2Engine.begin_step
    monkeypatch.setattr(FSDP2Engine, "begin_step", lambda self, n: (begun.append(n), real(self, n))[1])
    overrides = [*SMALL, "det.tier=4", "train.global_batch=16", "train.compile=false"]  # 4 rounds on 2 ranks
    plan, report = plan_memory(overrides, 2, device="cpu", mode="measure", timed_steps=1, rounds="all")
    assert begun == [4, 4, 4, 4] and plan.micro_per_rank_run == 4
    assert (plan.partials, report.partials_measured) == (2, 2)
    assert sum(v for k, v in report.extras.items() if k.startswith("tier-4 partials")) == 0
    begun.clear()
    # the engine really keeps its counters on the host (the ledger tests cannot tell: the bits are the same)
    from dettrain.sync.offload import HostLevels

    puts = []
    real_put = HostLevels.put
    monkeypatch.setattr(HostLevels, "put",
                        lambda self, i, lv, dev, **k: (puts.append(lv), real_put(self, i, lv, dev, **k))[1])
    plan, report = plan_memory([*overrides, "dist.offload_partials=true"], 2, device="cpu", mode="measure",
                               timed_steps=1, rounds="all")
    assert begun == [4, 4, 4, 4] and report.partials_measured == 0 and report.extras == {}
    assert sum(report.host.values()) == 2 * 4 * report.n_shard
    # 4 steps of 4 rounds push rounds 0, 1, 2 (levels 0, 1, 0) of every parameter
    n_params = len(puts) // 12
    assert n_params > 0 and sorted(puts) == sorted([0, 1, 0] * 4 * n_params)


def test_tier4_cli_adds_the_partials(capsys):
    # M = 16 / 2 = 8 micro-batches on 2 ranks: 4 rounds, a counter of log2(4) = 2 fp32 shards
    assert main(["--nproc", "2", *SMALL, "det.tier=4", "train.global_batch=16"]) == 0
    out = capsys.readouterr().out
    _, report = plan_memory([*SMALL, "det.tier=4", "train.global_batch=16"], 2, device="cpu", mode="estimate")
    partials = next(v for k, v in report.extras.items() if k.startswith("tier-4 partials (2 x"))
    assert partials == 2 * 4 * report.n_shard
    assert "tier-4 partials (2 x fp32 shard" in out and "tier 4 (invariant)" in out
    assert last_line_gib(out) == pytest.approx(report.peak / GIB, abs=0.006)


@pytest.mark.parametrize("tier", [3, 4])
def test_llm_7b_fits_8_ranks_of_80_gb(tier):
    p = subprocess.run([sys.executable, "-m", "dettrain.memory", "+exp=llm_7b", "--nproc", "8", f"det.tier={tier}"],
                       cwd=REPO, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    assert "engine: fsdp2;" in p.stdout and f"tier {tier} " in p.stdout
    assert "6,738,415,616 parameters" in p.stdout
    peak = last_line_gib(p.stdout)
    assert 20 < peak <= 70, p.stdout
    if tier == 4:
        assert "tier-4 partials (5 x fp32 shard" in p.stdout  # log2(256 / 8)


@pytest.mark.parametrize("argv, needle", [
    (["+exp=llm_7b", "train.micro_batchh=1"], "train.micro_batchh"),
    (["+exp=no_such_exp"], "no_such_exp"),
    (["--nproc", "3", "train.global_batch=16", "train.micro_batch=8"], "train.global_batch=16"),
    (["--nproc", "0"], "--nproc=0"),
    (["--device", "cpu", "--stock"], "--mode=measure"),
    (["--device", "cpu", "--compare-stock", "2", "--stock"], "--compare-stock=2"),
    (["--device", "cpu", "--compare-stock", "2", "train.micro_batchh=1"], "train.micro_batchh"),
    (["--device", "cpu", "--mode", "measure", "--nproc", "2", "--rounds", "3", "det.tier=4",
      "train.global_batch=16", "train.micro_batch=2", "dist.engine=fsdp2"], "--rounds=3: det.tier=4"),
    (["--device", "cpu", "--mode", "measure", "--nproc", "2", "--rounds", "8", "train.global_batch=16",
      "train.micro_batch=2", "dist.engine=fsdp2"], "--rounds=8: the measured step runs 1 to M/W = 8/2 = 4"),
    (["--device", "cpu", "--rounds", "all", "dist.engine=fsdp2"], "--rounds=all sets the measured step"),
])
def test_bad_input_exits_2_with_a_message(capsys, argv, needle):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("dettrain.memory: error: ") and needle in err, err


def test_bad_override_through_the_command_line():
    p = subprocess.run([sys.executable, "-m", "dettrain.memory", "+exp=llm_7b", "--nproc", "8", "train.lr=fast"],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "train.lr" in p.stderr and "Traceback" not in p.stderr, p.stderr
