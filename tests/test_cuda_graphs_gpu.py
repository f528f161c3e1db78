"""train.cuda_graphs and the host-sync-free step on the GPU (skipped on CI, which has none).

Promises checked:
  * a training step at the default config (compile auto, so CUDA graphs where the engine allows them) over 8
    micro-batches synchronises with the host only in its step line (``StepRecorder.line``, which reads the
    fingerprints and the loss): ``torch.cuda.set_sync_debug_mode("error")`` is on from the step's start until that
    call, so any earlier sync raises; tiers 0 (DDP), 3 (flat) and 4 (flat, binary counter), and FSDP2 on one rank
    at tiers 3 and 4;
  * CUDA graphs change no bit: ``train.cuda_graphs=true`` and ``false`` write identical ledgers at tiers 3 and 4, with
    dropout on (its masks are drawn inside the replayed graphs, keyed by step and micro-batch), on the flat engine
    and on FSDP2 (one rank, where its gathered parameters keep their memory: engines/fsdp2.py ``keep_gathered``).
    FSDP2 equals the flat engine at tier 4 only in fp32 compute (docs/engines.md), where FSDP2 does not replay
    graphs; in bf16 each engine keeps its own bits, so FSDP2's graphs are checked against FSDP2 without them;
  * the tier-0 DDP engine runs under CUDA graphs (its gradients exist before the first backward, so autograd never
    adopts a graph's output as .grad) and reruns at tier 2 identically.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch
from conftest import TINY, gpu, step_fields, train

pytestmark = gpu

GPU_JOB = ["train.global_batch=16", "train.micro_batch=2", "train.steps=4"]  # 8 micro-batches a step


@pytest.mark.parametrize("tier,engine", [(0, None), (3, None), (4, None), (3, "fsdp2"), (4, "fsdp2")])
def test_step_has_no_host_sync_before_its_line(tier, engine, monkeypatch):
    pytest.importorskip("triton", reason="compile auto needs Triton on CUDA")
    from hydra import compose, initialize_config_dir

    from dettrain import dist as D
    from dettrain.config import conf_dir, register, to_config
    from dettrain.determinism import apply_tier, seed_process
    from dettrain.loop import step_record
    from dettrain.loop.trainer import Trainer

    register()
    overrides = [o for o in TINY if not o.startswith(("train.steps", "train.global", "train.micro"))]
    with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
        cfg = to_config(compose(config_name="config", overrides=[
            *overrides, *GPU_JOB, f"det.tier={tier}", *([f"dist.engine={engine}"] if engine else [])]))
    apply_tier(cfg.det)
    seed_process(cfg.seed, 0)
    info = D.DistInfo(0, 1, 0, torch.device("cuda:0"), None)
    original = step_record.StepRecorder.line
    reached = []

    def line(self, *args, **kwargs):  # the step's one sync point: syncs are allowed from here on
        torch.cuda.set_sync_debug_mode(0)
        reached.append(True)
        return original(self, *args, **kwargs)

    with tempfile.TemporaryDirectory() as tmp:
        tr = Trainer(cfg, info, Path(tmp))
        assert tr.cuda_graphs  # ddp, flat and FSDP2 on one rank replay CUDA graphs at the default config
        it = iter(tr.sampler)
        for _ in range(3):  # compile, record the graphs, first replays
            tr.train_step(next(it))
            tr.step += 1
        monkeypatch.setattr(step_record.StepRecorder, "line", line)
        micro = next(it)
        assert len(micro) == 8
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            rec = tr.train_step(micro)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        assert reached == [True]
        assert rec["step"] == 3 and len(rec["param"]) == 16
        tr.engine.close()


@pytest.mark.parametrize("engine", ["flat", "fsdp2"])
@pytest.mark.parametrize("tier", [3, 4])
def test_cuda_graphs_change_no_bit(tmp_path, tier, engine):
    pytest.importorskip("triton", reason="compile auto needs Triton on CUDA")
    job = [*GPU_JOB, f"det.tier={tier}", "model.dropout=0.1", f"dist.engine={engine}"]
    on = train(tmp_path / "on", *job, "train.cuda_graphs=true")
    off = train(tmp_path / "off", *job, "train.cuda_graphs=false")
    assert "replayed as CUDA graphs" in on.stdout + on.stderr
    assert "replayed as CUDA graphs" not in off.stdout + off.stderr
    assert step_fields(tmp_path / "on") == step_fields(tmp_path / "off")


def test_ddp_engine_reruns_identically_under_cuda_graphs(tmp_path):
    pytest.importorskip("triton", reason="compile auto needs Triton on CUDA")
    job = [*GPU_JOB, "det.tier=2", "train.cuda_graphs=true"]
    train(tmp_path / "a", *job)
    train(tmp_path / "b", *job)
    assert step_fields(tmp_path / "a") == step_fields(tmp_path / "b")
