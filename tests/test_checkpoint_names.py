"""Checkpoints loadable by name (issue 25): every engine's checkpoint is read by plain torch DCP, in a fresh process
that imports no dettrain code, as one tensor per parameter name (``model/<name>``) and per optimizer moment
(``optim/<name>/exp_avg``, ``optim/<name>/exp_avg_sq``); the tensors hash to the ledger's ``param`` and ``opt`` of
the step; ``dettrain checkpoint to-torch`` writes the same parameters into one torch.save file; ckpt.final saves a
run that completes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, train

from dettrain.config import model_config
from dettrain.models.llama import build_model
from dettrain.record.fingerprint import combine, fingerprint, format_fp
from dettrain.record.ledger import LEDGER_NAME, read_ledger

# small buckets: shard boundaries cut parameters mid-row, so a name's tensor is pieced from several ranks' boxes
ENGINES = {
    "ddp": ["det.tier=2"],
    "flat": ["det.tier=4", "dist.bucket_mb=0.05"],
    "flat-zero1": ["det.tier=4", "dist.bucket_mb=0.05", "dist.shard_optimizer=true"],
    "fsdp2": ["det.tier=4", "dist.engine=fsdp2"],
}

# plain torch only: what a torchtitan user would run on the checkpoint directory
PLAIN_DCP = r"""
import sys, torch, torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
ck, out = sys.argv[1], sys.argv[2]
md = FileSystemReader(ck).read_metadata()
sd = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype) for k, v in md.state_dict_metadata.items()
      if isinstance(v, TensorStorageMetadata)}
dcp.load(sd, checkpoint_id=ck)
torch.save(sd, out + ".load.pt")
dcp_to_torch_save(ck, out + ".whole.pt")
"""


def canonical_offsets(model: torch.nn.Module) -> tuple[dict[str, int], int]:
    """Each parameter's offset in the fingerprints' index space (FlatLayout at world 1: parameters in reverse
    registration order, packed), computed here from the model, not by dettrain.sync.collectives."""
    offsets, off = {}, 0
    for n, p in reversed(list(model.named_parameters())):
        offsets[n] = off
        off += p.numel()
    return offsets, off


@pytest.mark.parametrize("engine", list(ENGINES))
def test_plain_dcp_reads_every_engine_by_name(tmp_path, engine):
    run = tmp_path / "run"
    train(run, "train.steps=3", *ENGINES[engine], nproc=2)  # no ckpt.every: ckpt.final writes step 3
    ck = run / "checkpoints" / "step_00000003"
    assert (ck / "dettrain.json").is_file()
    ev = [e for e in map(json.loads, (run / LEDGER_NAME).read_text().splitlines()) if e.get("event") == "checkpoint"]
    assert [(e["step"], e["reason"]) for e in ev] == [(3, "final")]

    out = tmp_path / "plain"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # no dettrain on the path
    p = subprocess.run([sys.executable, "-c", PLAIN_DCP, str(ck), str(out)], cwd=tmp_path, capture_output=True,
                       text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    loaded = torch.load(f"{out}.load.pt", weights_only=True)
    whole = torch.load(f"{out}.whole.pt", weights_only=True)

    header, steps = read_ledger(run)
    model = build_model(model_config(header["config"]["model"]), 0, "meta")
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert {k[len("model/"):]: tuple(v.shape) for k, v in loaded.items() if k.startswith("model/")} == shapes
    for n in shapes:
        for k in (f"model/{n}", f"optim/{n}/exp_avg", f"optim/{n}/exp_avg_sq"):
            assert loaded[k].dtype == torch.float32 and tuple(loaded[k].shape) == shapes[n], k
            assert torch.equal(loaded[k], whole[k]), k

    # the tensors by name are the trained ones: they hash to the ledger's param and opt after the last step
    offsets, N = canonical_offsets(model)
    assert format_fp(combine(fingerprint(loaded[f"model/{n}"].reshape(-1), offsets[n]) for n in shapes)) == \
        steps[-1]["param"]
    opt = combine([fingerprint(loaded[f"optim/{n}/exp_avg"].reshape(-1), offsets[n]) for n in shapes]
                  + [fingerprint(loaded[f"optim/{n}/exp_avg_sq"].reshape(-1), N + offsets[n]) for n in shapes])
    assert format_fp(opt) == steps[-1]["opt"]

    # to-torch: one torch.save file of the same parameters, never written over without --force
    f = tmp_path / "model.pt"
    cmd = [sys.executable, "-m", "dettrain.checkpoint", "to-torch", str(run), "--out", str(f)]
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    sd = torch.load(f, weights_only=True)
    assert sorted(sd) == sorted(shapes)
    assert all(torch.equal(sd[n], loaded[f"model/{n}"]) for n in shapes)
    before = f.read_bytes()
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and "already exists" in p.stderr and "--force" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr and f.read_bytes() == before
    p = subprocess.run([*cmd, "--force"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr


def test_ckpt_final_false_and_every_dividing_the_steps(tmp_path):
    """ckpt.final=false leaves a completed run without a checkpoint (as before); with ckpt.every dividing
    train.steps the last step is saved once, by ckpt.every."""
    train(tmp_path / "off", "train.steps=2", "ckpt.final=false")
    assert not (tmp_path / "off" / "checkpoints").exists() or not any((tmp_path / "off" / "checkpoints").iterdir())
    train(tmp_path / "every", "train.steps=2", "ckpt.every=2")
    evs = [e for e in map(json.loads, (tmp_path / "every" / LEDGER_NAME).read_text().splitlines())
           if e.get("event") == "checkpoint"]
    assert [(e["step"], e["reason"]) for e in evs] == [(2, "every")]
    assert sorted(p.name for p in (tmp_path / "every" / "checkpoints").iterdir()) == ["step_00000002"]


def test_to_torch_refuses_a_directory_and_a_missing_checkpoint(tmp_path):
    (tmp_path / "empty").mkdir()
    for args, want in (([str(tmp_path / "empty"), "--out", str(tmp_path / "x.pt")], "holds no checkpoint"),
                       ([str(tmp_path / "empty"), "--out", str(tmp_path / "empty")], "is a directory")):
        p = subprocess.run([sys.executable, "-m", "dettrain.checkpoint", "to-torch", *args], cwd=REPO,
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 2 and want in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert not Path(tmp_path / "x.pt").exists()


def test_boxes_tile_any_flat_range_of_a_tensor():
    """chunks.boxes: the boxes of a flat range [lo, hi) of a row-major tensor hold exactly the elements lo..hi-1,
    each box contiguous from its flat start (checked against torch's own indexing of an arange)."""
    import math
    import random

    from dettrain.checkpoint.chunks import boxes

    rng = random.Random(0)
    for _ in range(3000):
        shape = tuple(rng.randint(1, 4) for _ in range(rng.randint(0, 4)))
        n = math.prod(shape)
        lo = rng.randint(0, n)
        hi = rng.randint(lo, n)
        t = torch.arange(n).view(shape)
        seen = []
        for o, s, f in boxes(shape, lo, hi):
            v = t[tuple(slice(a, a + b) for a, b in zip(o, s))].reshape(-1)
            assert torch.equal(v, torch.arange(f, f + math.prod(s))), (shape, lo, hi, o, s, f)
            seen += v.tolist()
        assert seen == list(range(lo, hi)), (shape, lo, hi)
