"""``resolve(cfg, device)`` (dettrain/loop/resolve.py) decides train.precision, train.compile, det.batch_invariant and
det.attention once, for the trainer, the memory planner and the verification script alike.

Promises checked: the ``auto`` values per device (bf16 on CUDA, fp32 elsewhere; compile on CUDA only with Triton;
batch-invariant kernels only on CUDA); det.batch_invariant's default follows the *resolved* train.compile (tier 4
on CUDA: on when eager, off when compiled) and det.attention follows the resolved det.batch_invariant; an impossible
combination is a UserError naming the key; the memory planner's plan carries the same precision and compile.
Deciding creates no tensor, so a CUDA device object is enough to check the CUDA rules on a CPU machine.
"""

from __future__ import annotations

import pytest
import torch

from dettrain.config import Config, TrainConfig
from dettrain.determinism import DetConfig
from dettrain.errors import UserError
from dettrain.kernels import HAVE_TRITON
from dettrain.loop.resolve import resolve, resolve_precision
from dettrain.tools.memory import resolve_plan

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def cfg(tier: int = 3, compile: bool | str = "auto", precision: str = "auto", batch_invariant: bool | None = None,
        attention: str = "auto") -> Config:
    return Config(train=TrainConfig(compile=compile, precision=precision),
                  det=DetConfig(tier=tier, batch_invariant=batch_invariant, attention=attention))


def test_auto_values_per_device():
    r = resolve(cfg(tier=4), CPU)
    assert (r.precision, r.compile, r.batch_invariant, r.attention.resolved) == ("fp32", False, False, "torch")
    assert not r.mixed_precision
    r = resolve(cfg(tier=4), CUDA)
    assert r.precision == "bf16" and r.mixed_precision and r.compile is HAVE_TRITON
    assert resolve_precision("bf16", CPU) == "bf16" and resolve_precision("fp32", CUDA) == "fp32"
    assert resolve(cfg(precision="bf16"), CPU).mixed_precision


def test_batch_invariant_follows_the_resolved_compile():
    # tier 4 on CUDA: batch-invariant kernels by default only when eager (compiled, Inductor cannot fuse across them)
    assert resolve(cfg(tier=4, compile=False), CUDA).batch_invariant is True
    assert resolve(cfg(tier=4, compile=True), CUDA).batch_invariant is False
    assert resolve(cfg(tier=4, compile="auto"), CUDA).batch_invariant is (not HAVE_TRITON)
    assert resolve(cfg(tier=4, compile=True, batch_invariant=True), CUDA).batch_invariant is True
    assert resolve(cfg(tier=3, compile=False), CUDA).batch_invariant is False
    assert resolve(cfg(tier=4, compile=False), CPU).batch_invariant is False  # CPU: only when asked
    assert resolve(cfg(tier=4, compile=False, batch_invariant=True), CPU).batch_invariant is True  # rowwise.py


def test_attention_follows_the_resolved_batch_invariant():
    on = resolve(cfg(tier=4, compile=False), CUDA).attention
    off = resolve(cfg(tier=1, compile=False), CUDA).attention
    if HAVE_TRITON:
        assert (on.resolved, on.reason) == ("dettrain", "auto: det.batch_invariant")
        assert off.resolved == "torch" and "tier < 2" in off.reason
    else:
        assert on.resolved == off.resolved == "torch" and "no Triton" in on.reason
    with pytest.raises(UserError, match="det.attention=torch with det.batch_invariant=true"):
        resolve(cfg(tier=4, batch_invariant=True, attention="torch"), CUDA)


@pytest.mark.parametrize("device", [CPU, CUDA], ids=["cpu", "cuda"])
@pytest.mark.parametrize("precision,compile", [("auto", "auto"), ("fp32", True), ("bf16", False)])
def test_memory_plan_takes_the_same_decisions(device, precision, compile):
    c = cfg(tier=4, compile=compile, precision=precision)
    c.dist.engine = "fsdp2"
    r, plan = resolve(c, device), resolve_plan(c, 2, device)
    assert plan.mixed_precision == r.mixed_precision
    assert plan.compile == (r.compile and device.type == "cuda")  # the planner never compiles on a CPU


def _graphs(setting, device, tier=3, compile=True, engine="auto", world=1, **dist):
    c = cfg(tier=tier, compile=compile)
    c.train.cuda_graphs = setting
    c.dist.engine = engine
    for k, v in dist.items():
        setattr(c.train if k == "precision" else c.dist, k, v)
    return resolve(c, device, world).cuda_graphs


def test_cuda_graphs_follow_compile_device_and_engine():
    # auto: on wherever the compiled modules run on CUDA with an engine that keeps its parameters and gradients in
    # place: ddp and flat always, FSDP2 on one rank (its gathered parameters keep their memory there) in bf16
    assert _graphs("auto", CUDA, tier=3) and _graphs("auto", CUDA, tier=0) and _graphs("auto", CUDA, tier=4)
    assert _graphs("auto", CUDA, tier=3, world=4)
    assert _graphs("auto", CUDA, tier=3, engine="fsdp2") and _graphs("auto", CUDA, tier=4, engine="fsdp2")
    assert not _graphs("auto", CUDA, tier=3, engine="fsdp2", world=2)
    assert not _graphs("auto", CUDA, tier=3, engine="fsdp2", reshard_after_forward=True)
    assert not _graphs("auto", CUDA, tier=3, engine="fsdp2", precision="fp32")
    assert not _graphs("auto", CUDA, compile=False) and not _graphs("auto", CPU)
    assert not _graphs("false", CUDA) and _graphs("true", CUDA)


def test_resolve_takes_the_world_from_the_launcher(monkeypatch):
    c = cfg(tier=3, compile=True)
    c.dist.engine = "fsdp2"
    monkeypatch.setenv("WORLD_SIZE", "2")  # what torchrun sets in every rank
    assert not resolve(c, CUDA).cuda_graphs
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert resolve(c, CUDA).cuda_graphs


def test_cuda_graphs_true_where_they_cannot_run_is_refused_naming_the_key():
    for device, compile, engine, extra, why in (
            (CPU, True, "auto", {}, "the device is cpu"),
            (CUDA, False, "auto", {}, "train.compile resolves to false"),
            (CUDA, True, "fsdp2", {"world": 2}, "dist.engine resolves to fsdp2 on 2 ranks"),
            (CUDA, True, "fsdp2", {"reshard_after_forward": True}, "dist.reshard_after_forward=true"),
            (CUDA, True, "fsdp2", {"precision": "fp32"}, "train.precision=fp32")):
        with pytest.raises(UserError, match="train.cuda_graphs=true") as e:
            _graphs("true", device, compile=compile, engine=engine, **extra)
        assert why in str(e.value) and "train.cuda_graphs=auto or false" in str(e.value)
    with pytest.raises(UserError, match="must be auto, true or false"):
        _graphs("sometimes", CUDA)


def test_cuda_graphs_are_left_out_of_the_config_hash():
    from dettrain.config import config_hash, to_container

    a, b = cfg(), cfg()
    b.train.cuda_graphs = "false"
    assert to_container(a) != to_container(b) and config_hash(to_container(a)) == config_hash(to_container(b))


def test_overlap_steps_defaults_to_auto_on_for_cuda_and_a_bad_value_names_the_key():
    from dettrain.config import config_hash, to_container

    def overlap(setting, device):
        c = cfg()
        c.train.overlap_steps = setting
        return resolve(c, device).overlap_steps

    # the default is auto: on for CUDA, off on a CPU (where kernels run as they are called)
    assert resolve(cfg(), CUDA).overlap_steps and not resolve(cfg(), CPU).overlap_steps
    assert overlap("auto", CUDA) and not overlap("auto", CPU)
    assert overlap("true", CPU) and overlap(True, CPU) and not overlap("false", CUDA) and not overlap(False, CUDA)
    with pytest.raises(UserError, match=r"train.overlap_steps='sometimes' must be auto, true or false"):
        overlap("sometimes", CPU)
    a, b = cfg(), cfg()
    b.train.overlap_steps = "false"  # timing only: a resume may switch it freely
    assert to_container(a) != to_container(b) and config_hash(to_container(a)) == config_hash(to_container(b))
