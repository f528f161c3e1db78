"""Every tool on the GPU at its defaults (skipped on CI, which has none): a run of the default config on CUDA (tiny
LLaMA, tier 3, train.compile=auto, ckpt.final) and then each tool on it as a user types it, with no option beyond the
run dir and --out: ``diff`` of two default runs (identical), ``trace --repeat 2`` (faithful, replays identical),
``checkpoint status`` / ``to-torch``, ``export`` (transformers loads it and gives dettrain's logits), ``verify`` (the
default tier's promise holds on this device) and the live check (``det.reference``: silent on an identical rerun,
exit 3 at step 0 on a changed seed with ``det.on_divergence=stop``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, gpu, step_fields, train

from dettrain.record.ledger import read_ledger

pytestmark = gpu

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def tool(module: str, *args: str | Path, timeout: int = 1200) -> subprocess.CompletedProcess:
    """``python -m dettrain.<module> ARGS`` as a user runs it."""
    return subprocess.run([sys.executable, "-m", module, *map(str, args)], cwd=REPO, env=ENV, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Two runs of the default config (nothing but run_dir given), on the GPU."""
    root = tmp_path_factory.mktemp("tools_gpu")
    for name in ("a", "b"):
        train(root / name, tiny=False, timeout=1800)
    return {"a": root / "a", "b": root / "b", "root": root}


def test_default_run_is_on_cuda_compiled_and_reruns_identically(runs):
    header, steps = read_ledger(runs["a"])
    assert header["device"].startswith("cuda") and header["config"]["train"]["compile"] == "auto"
    assert header["compile"]["enabled"] is True  # auto compiles on CUDA
    assert len(steps) == header["config"]["train"]["steps"]
    assert step_fields(runs["a"]) == step_fields(runs["b"])
    p = tool("dettrain.diff", runs["a"], runs["b"])
    assert p.returncode == 0 and "IDENTICAL" in p.stdout, p.stdout + p.stderr


def test_trace_repeat_2_is_faithful_and_identical(runs, tmp_path):
    out = tmp_path / "t.jsonl"
    # the default run keeps only its final checkpoint: step 1 is replayed from step 0 (the model of the seed)
    p = tool("dettrain.trace", runs["a"], "--step", 1, "--from-start", "--repeat", 2, "--out", out)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "faithful: step fingerprints equal the ledger's" in p.stdout and "IDENTICAL" in p.stdout, p.stdout
    assert out.is_file() and out.with_name(out.name + ".repeat1").is_file()


def test_checkpoint_status_and_to_torch(runs, tmp_path):
    p = tool("dettrain.checkpoint", "status", runs["a"])
    assert p.returncode == 0 and p.stdout.startswith("complete: "), p.stdout + p.stderr
    out = tmp_path / "model.pt"
    p = tool("dettrain.checkpoint", "to-torch", runs["a"], "--out", out)
    assert p.returncode == 0, p.stderr
    state = torch.load(out, weights_only=True)
    assert state and all(v.dtype == torch.float32 and v.device.type == "cpu" for v in state.values())


def test_export_loads_in_transformers_with_dettrains_logits(runs, tmp_path):
    transformers = pytest.importorskip("transformers")
    from dettrain.models.llama import build_model
    from dettrain.tools.export import load_llama

    out = tmp_path / "hf"
    p = tool("dettrain.export", runs["a"], "--out", out)
    assert p.returncode == 0, p.stderr
    ck = sorted((runs["a"] / "checkpoints").glob("step_*"))[-1]
    cfg, params, _ = load_llama(ck)
    ours = build_model(cfg, seed=0, device="cpu")
    ours.load_state_dict(params, strict=True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    tokens = torch.randint(0, cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (ours.eval()(tokens) - hf(tokens, use_cache=False).logits).abs().max().item() < 1e-4


def test_verify_at_its_defaults_holds_the_default_tier(tmp_path):
    out = tmp_path / "verify.json"
    p = tool("dettrain.verify", "--json", out)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-3000:]
    assert json.loads(out.read_text())  # the report a user reads (docs/determinism.md)


def test_live_check_silent_on_a_rerun_and_stops_a_changed_seed(runs):
    same, other = runs["root"] / "live_same", runs["root"] / "live_seed"
    train(same, f"det.reference={runs['a']}", tiny=False, timeout=1800)
    assert step_fields(same) == step_fields(runs["a"])
    assert not [x for x in map(json.loads, (same / "ledger.jsonl").read_text().splitlines())
                if x.get("kind") == "event" and x.get("event") == "divergence"]
    p = train(other, "seed=1", f"det.reference={runs['a']}", "det.on_divergence=stop", tiny=False, check=False,
              timeout=1800)
    assert p.returncode == 3, p.stdout[-3000:] + p.stderr[-3000:]
    assert [s["step"] for s in read_ledger(other)[1]] == [0]
