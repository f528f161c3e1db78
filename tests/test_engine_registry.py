"""A new engine is one class in one file (docs/engines.md): registered from outside dettrain, named by
``dist.engine=package.module:Class``, it trains, checkpoints and resumes through the real trainer, bit for bit."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import REPO, step_fields, train

from dettrain.errors import UserError

TESTS = Path(__file__).resolve().parent
ENV = {"PYTHONPATH": os.pathsep.join([str(TESTS), str(REPO), os.environ.get("PYTHONPATH", "")])}
PLUGIN = "dist.engine=engine_plugin:HalvingFlat"
JOB = ("det.tier=3", "train.steps=6", "ckpt.final=false")


def _header(run: Path) -> dict:
    from dettrain.record.ledger import read_ledger

    header, _ = read_ledger(run)
    return header


def test_a_registered_engine_checkpoints_and_resumes_bit_for_bit(tmp_path):
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    train(whole, PLUGIN, *JOB, nproc=2, env=ENV)
    train(cut, PLUGIN, *JOB, "train.stop_after=2", nproc=2, env=ENV)  # steps 0-2, then a checkpoint
    ck = cut / "checkpoints" / "step_00000003"
    meta = json.loads((ck / "dettrain.json").read_text())
    assert meta["optim"]["kind"] == "halving_flat"  # saved by the plugin's own state_dict
    # its own entry beside the flat engine's names, read back with plain DCP: the factor after 3 steps
    scale = torch.zeros((), dtype=torch.float64)
    dcp.load({"halving/lr_scale": scale}, checkpoint_id=ck, no_dist=True)
    assert float(scale) == 0.75**3
    assert [s[0] for s in step_fields(cut)] == [0, 1, 2]
    train(cut, PLUGIN, *JOB, "ckpt.resume=auto", nproc=2, env=ENV)
    assert step_fields(cut) == step_fields(whole)  # every field of every step
    assert _header(whole)["engine"] == _header(cut)["engine"] == "halving_flat"


def test_its_state_is_its_own(tmp_path):
    """The engine ran (its ledger differs from the flat engine's: its learning rate shrinks), and a flat
    checkpoint is refused by it with a line that names the engine that saved it."""
    flat, plug = tmp_path / "flat", tmp_path / "plug"
    train(flat, "dist.engine=flat", *JOB, "train.stop_after=1", nproc=2, env=ENV)
    train(plug, PLUGIN, *JOB, "train.stop_after=1", nproc=2, env=ENV)
    a, b = step_fields(flat), step_fields(plug)
    assert [s[0] for s in a] == [s[0] for s in b] == [0, 1]
    assert a[0] == b[0] and a[1] != b[1]  # step 0 runs at the full rate (factor 1), step 1 at 0.75 of it
    # one process: its exit status is dettrain's own (torchrun reports any worker's failure as 1)
    p = train(flat, PLUGIN, *JOB, "ckpt.resume=auto", env=ENV, check=False)
    assert p.returncode == 2, p.stderr[-3000:]
    assert "was saved by the flat engine and this run uses dist.engine=halving_flat" in p.stderr
    assert "Traceback" not in p.stderr


def test_registry_names_and_bad_paths():
    from dettrain.checkpoint import state
    from dettrain.sync import engines
    from dettrain.sync.engines import base

    assert engines.ENGINES == ("auto", "ddp", "flat", "fsdp2")
    assert list(engines.registered())[:3] == ["ddp", "flat", "fsdp2"]
    assert engines.saved_by("torch") is engines.DDPEngine and engines.saved_by("nobody") is engines.Engine
    assert base.OPTIM == state.OPTIM  # the key both sides agree on (the checkpoint package imports no engine)

    class Clash(engines.FlatEngine):
        name = "flat"

    with pytest.raises(ValueError, match="engine name 'flat' is taken"):
        engines.register(Clash)
    with pytest.raises(UserError, match=r"dist.engine='no_such_module:X' is not one of auto, ddp, flat, fsdp2"):
        engines.lookup("no_such_module:X")
    with pytest.raises(UserError, match="not a subclass of dettrain.sync.engines.Engine"):
        engines.lookup("dettrain.tiers:TierPolicy")
    with pytest.raises(UserError, match=r"dist.engine='zero3' is not one of"):
        engines.resolve_engine("zero3", 3)
    with pytest.raises(UserError, match="dist.engine=ddp cannot keep det.tier=3"):
        engines.resolve_engine("ddp", 3)
