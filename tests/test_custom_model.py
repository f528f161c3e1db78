"""model=custom: your own nn.Module through Hydra's instantiate, from your own --config-dir, at every tier."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from conftest import REPO, step_fields
from conftest import train as _train

from dettrain.config import register, to_container
from dettrain.errors import UserError
from dettrain.models.custom import CustomModelConfig
from dettrain.models.llama import build_model, init_by_name
from dettrain.record.ledger import read_ledger

register()
TESTS = Path(__file__).resolve().parent
# the embedded corpus, 4 steps of 4 micro-batches of 2 samples; no LLaMA keys (the custom node has none)
RUN = ["train.steps=4", "train.global_batch=8", "train.micro_batch=2", "data.max_bytes=300000",
       "log.wandb.mode=disabled", "log.every=1"]

MINE = """\
# @package _global_
defaults:
  - override /model: custom

exp_name: mine
model:
  _target_: custom_models.gru_lm
  seq_len: 32
  hidden: 24
  seed: ${seed}
"""


def user_config_dir(tmp_path: Path, text: str = MINE) -> Path:
    d = tmp_path / "myconf"
    (d / "exp").mkdir(parents=True)
    (d / "exp" / "mine.yaml").write_text(text)
    return d


def train(run_dir, *overrides, **kw):
    """A job whose factory lives in tests/custom_models.py, importable by the subprocess through PYTHONPATH."""
    env = {"PYTHONPATH": os.pathsep.join([str(TESTS), str(REPO), os.environ.get("PYTHONPATH", "")])}
    return _train(run_dir, *overrides, tiny=False, env=env, **kw)


def test_gru_from_own_config_dir_is_world_size_invariant_at_tier_4(tmp_path):
    conf = user_config_dir(tmp_path)
    train(tmp_path / "w1", "+exp=mine", "det.tier=4", *RUN, config_dir=conf)
    train(tmp_path / "w2", "+exp=mine", "det.tier=4", *RUN, config_dir=conf, nproc=2)
    h1, s1 = read_ledger(tmp_path / "w1")
    h2, s2 = read_ledger(tmp_path / "w2")
    assert h1["world_size"] == 1 and h2["world_size"] == 2
    # it trained the GRU with the YAML's keys, recorded flat as written
    m = h1["config"]["model"]
    assert m["_target_"] == "custom_models.gru_lm" and m["hidden"] == 24 and m["seq_len"] == 32
    assert "dim" not in m
    assert h1["n_params"] == 256 * 24 + 2 * 3 * 24 * (24 + 24 + 2) // 2 + 24 * 256 + 256
    assert [s["step"] for s in s1] == [0, 1, 2, 3]
    assert s1 == s2  # whole step lines: loss, batch, gradient, parameter and optimizer fingerprints, lr, grad norm
    assert s1[0]["loss"] > s1[-1]["loss"]  # it learns


@pytest.mark.parametrize("tier", [0, 1, 2, 3])
def test_mlp_trains_at_every_tier_and_reruns_identically_from_tier_1(tmp_path, tier):
    args = ["model=custom", "model._target_=custom_models.MLPLM", "model.seq_len=32", "+model.width=16",
            f"det.tier={tier}", *RUN]
    train(tmp_path / "a", *args)
    _, a = read_ledger(tmp_path / "a")
    assert len(a) == 4
    if tier >= 1:
        train(tmp_path / "b", *args)
        _, b = read_ledger(tmp_path / "b")
        assert a == b


def test_cli_overrides_reach_the_factory_and_the_config_hash(tmp_path):
    conf = user_config_dir(tmp_path)
    train(tmp_path / "a", "+exp=mine", "model.hidden=8", *RUN[:1], "train.steps=1", *RUN[1:], config_dir=conf)
    h, _ = read_ledger(tmp_path / "a")
    assert h["config"]["model"]["hidden"] == 8
    assert h["n_params"] == 256 * 8 + 3 * 8 * (8 + 8 + 2) + 8 * 256 + 256


BAD = [
    (["model=custom"], "model._target_ is not set"),
    (["model=custom", "model._target_=custom_models.nope"], "cannot be imported"),
    (["model=custom", "model._target_=custom_models.gru_lm", "+model.depth=3"], "does not take the keys"),
    (["model=custom", "model._target_=custom_models.wrong_shape"], "logits"),
    (["model=custom", "model._target_=custom_models.gru_lm", "model.seq_len=long"], "model.seq_len"),
    # issue 23: a time-major (T, B, V) output, at start-up and (batch-first only in eval mode) in the loss path
    (["model=custom", "model._target_=custom_models.TimeMajor"], "tokens (2, 3) gave (3, 2, 256)"),
    (["model=custom", "model._target_=custom_models.TimeMajorInTraining", "model.seq_len=32"],
     "it must return (B, T, model.vocab_size) = (2, 32, 256)"),
    (["model=custom", "model._target_=custom_models.NoParams"], "no trainable parameters"),
    (["model=custom", "model._target_=custom_models.MLPLM", "model.allow_unused=maybe"], "model.allow_unused"),
]


@pytest.mark.parametrize("overrides,message", BAD, ids=[b[1] for b in BAD])
def test_bad_custom_model_exits_2_with_a_clear_message(tmp_path, overrides, message):
    p = train(tmp_path / "run", *overrides, *RUN, check=False)
    assert p.returncode == 2, p.stderr[-3000:]
    assert message in p.stderr and "Traceback" not in p.stderr


FACTORIES = [  # (target, its own keys, the keys it must receive)
    ("custom_models.gru_lm", {"hidden": 8}, ["hidden", "seq_len", "vocab_size"]),  # takes both
    ("custom_models.PlainLM", {"dim": 8}, ["dim", "vocab_size"]),  # nn.Module(vocab_size, dim): no seq_len
    ("custom_models.fixed_vocab_lm", {"width": 4}, ["width"]),  # takes neither
    ("custom_models.kwargs_lm", {"dim": 4}, ["dim", "seq_len", "vocab_size"]),  # **kwargs: both
]


@pytest.mark.parametrize("target,own,received", FACTORIES, ids=[f[0].split(".")[1] for f in FACTORIES])
def test_factory_receives_vocab_size_and_seq_len_only_if_its_signature_takes_them(target, own, received):
    import sys

    import custom_models
    from hydra.utils import get_object

    from dettrain.models.custom import validate_custom

    sys.path.insert(0, str(TESTS))
    cfg = CustomModelConfig(_target_=target, vocab_size=256, seq_len=16, kwargs=own)
    assert sorted(cfg.factory_kwargs(get_object(target))) == received
    validate_custom(cfg)
    model = build_model(cfg, seed=0, device="cpu")  # built, and its logits (1, t, 256) checked
    assert model(torch.zeros(2, 16, dtype=torch.long)).shape == (2, 16, 256)
    if target.endswith("kwargs_lm"):  # what the factory saw, recorded by itself
        assert custom_models.kwargs_lm.received == received
    # the harness still reads both keys from the node, whatever the factory takes
    assert to_container_ok_keys(cfg) >= {"vocab_size", "seq_len", *own}


def to_container_ok_keys(cfg: CustomModelConfig) -> set:
    from dettrain.config import Config

    return set(to_container(Config(model=cfg))["model"])


def test_a_key_the_factory_does_not_take_is_still_refused():
    import sys

    from dettrain.models.custom import validate_custom

    sys.path.insert(0, str(TESTS))
    cfg = CustomModelConfig(_target_="custom_models.PlainLM", vocab_size=256, seq_len=16, kwargs={"depth": 3})
    with pytest.raises(UserError, match=r"does not take the keys of model\.\*.*depth"):
        validate_custom(cfg)
    validate_custom(CustomModelConfig(_target_="custom_models.PlainLM", vocab_size=256, seq_len=16))  # seq_len: fine


def test_plain_module_without_seq_len_trains_through_the_cli(tmp_path):
    """``nn.Module(vocab_size, dim)`` as model._target_, no wrapper: trains, and the run records model.seq_len."""
    train(tmp_path / "p", "model=custom", "model._target_=custom_models.PlainLM", "model.seq_len=32", "+model.dim=8",
          "det.tier=1", *RUN)
    h, steps = read_ledger(tmp_path / "p")
    assert h["config"]["model"]["seq_len"] == 32 and h["config"]["model"]["dim"] == 8
    assert h["n_params"] == 256 * 8 + 8 * 256 + 256 and len(steps) == 4


def test_factory_runs_under_an_rng_seeded_without_the_rank():
    """PyTorch's default init (global RNG) gives the same values whatever the process RNG state was."""
    cfg = CustomModelConfig(_target_="custom_models.MLPLM", vocab_size=50, seq_len=8, kwargs={"width": 8})
    import sys

    sys.path.insert(0, str(TESTS))
    torch.manual_seed(1)
    a = build_model(cfg, seed=5, device="cpu")
    torch.manual_seed(2)  # what seed_process does differently on another rank
    b = build_model(cfg, seed=5, device="cpu")
    c = build_model(cfg, seed=6, device="cpu")
    for (n, p), (_, q), (_, r) in zip(a.named_parameters(), b.named_parameters(), c.named_parameters()):
        assert torch.equal(p, q), n
        assert not torch.equal(p, r), n
    assert to_container_ok(cfg)


def to_container_ok(cfg: CustomModelConfig) -> bool:
    from dettrain.config import Config

    d = to_container(Config(model=cfg))["model"]
    return d == {"_target_": "custom_models.MLPLM", "name": "custom", "vocab_size": 50, "seq_len": 8, "width": 8}


def test_init_by_name_depends_on_name_and_seed_not_order():
    a = torch.nn.ModuleDict({"x": torch.nn.Linear(4, 3), "y": torch.nn.Linear(3, 2)})
    b = torch.nn.ModuleDict({"y": torch.nn.Linear(3, 2), "x": torch.nn.Linear(4, 3)})  # other order
    init_by_name(a, seed=0, std=0.5)
    init_by_name(b, seed=0, std=0.5)
    for name in ("x.weight", "y.weight"):
        assert torch.equal(a.get_parameter(name), b.get_parameter(name))
    # 1-D parameters (biases) are left as built unless the rule says otherwise
    bias = b.x.bias.clone()
    init_by_name(b, seed=1, std=0.5)
    assert torch.equal(b.x.bias, bias) and not torch.equal(a.x.weight, b.x.weight)
    init_by_name(b, seed=0, std=lambda name, p: 0.1 if name.endswith("bias") else None)
    assert not torch.equal(b.x.bias, bias)


def test_user_error_type():
    from dettrain.models.custom import from_node

    with pytest.raises(UserError, match="model._target_"):
        from_node({"name": "custom", "_target_": "???"})


def test_verify_checks_a_custom_model(tmp_path):
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(REPO)])}
    p = subprocess.run([sys.executable, "-m", "dettrain.verify", "model=custom", "model._target_=custom_models.gru_lm",
                        "model.seq_len=16", "det.tier=2", "--sizes", "1,2", "--dtypes", "fp32", "--repeats", "2",
                        "--atomics-n", "1000", "--atomics-reruns", "2", "--json", str(tmp_path / "v.json")],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    import json

    res = json.loads((tmp_path / "v.json").read_text())
    assert res["model"]["_target_"] == "custom_models.gru_lm"
    assert [r["op"] for r in res["batch_invariance"]] == ["model forward (logits)"]
    assert "PASS" in p.stdout


def test_shipped_example_trains_as_the_readme_says(tmp_path):
    """examples/conf/exp/gru.yaml through the real CLI, with examples/ on PYTHONPATH (README, docs/custom_models.md)."""
    env = {"PYTHONPATH": os.pathsep.join([str(REPO / "examples"), str(REPO)])}
    _train(tmp_path / "g", "+exp=gru", "train.steps=2", "log.wandb.mode=disabled", "data.max_bytes=300000",
           config_dir=REPO / "examples" / "conf", tiny=False, env=env)
    h, steps = read_ledger(tmp_path / "g")
    assert h["config"]["model"]["_target_"] == "gru_lm.gru_lm" and h["config"]["exp_name"] == "gru"
    assert len(steps) == 2


# ---- parameters that never receive a gradient (issue 23) ---------------------------------------------------
UNUSED = ["model=custom", "model._target_=custom_models.WithUnused", "model.seq_len=32", *RUN, "log.tensor_every=1"]
ENGINES = {"ddp": ["dist.engine=ddp", "det.tier=1"], "flat": ["dist.engine=flat", "det.tier=4"],
           "fsdp2": ["dist.engine=fsdp2", "det.tier=4"]}


@pytest.mark.parametrize("engine", list(ENGINES))
def test_unused_parameters_are_refused_at_the_first_step(tmp_path, engine):
    p = train(tmp_path / "run", *UNUSED, *ENGINES[engine], check=False)
    assert p.returncode == 2, p.stderr[-3000:]
    err = p.stderr
    assert "Traceback" not in err
    (line,) = [ln for ln in err.splitlines() if ln.startswith("dettrain: error:")]
    assert "received no gradient in step 0" in line and "spare.weight" in line and "scale" in line
    assert "requires_grad_(False)" in line and "model.allow_unused=true" in line
    assert "emb.weight" not in line and "head.weight" not in line  # only the unused ones are named
    _, steps = read_ledger(tmp_path / "run")
    assert steps == []  # refused before the first optimizer step: nothing decayed, nothing recorded


@pytest.mark.parametrize("engine", list(ENGINES))
def test_allow_unused_leaves_them_out_of_update_and_decay(tmp_path, engine):
    """model.allow_unused=true on 2 ranks: the unused tensors keep their initial values at every step (their
    per-tensor fingerprints never change, though optim.weight_decay=0.1 would shrink them), and the run computes
    what the same model with those parameters frozen (requires_grad=False, the other fix) computes."""
    a = tmp_path / "allow"
    f = tmp_path / "frozen"
    train(a, *UNUSED, *ENGINES[engine], "model.allow_unused=true", nproc=2)
    train(f, *UNUSED, *ENGINES[engine], "+model.freeze=true", nproc=2)
    _, sa = read_ledger(a)
    _, sf = read_ledger(f)
    assert len(sa) == 4
    for name in ("spare.weight", "spare.bias", "scale"):
        assert len({s["tensors"]["param"][name] for s in sa}) == 1, name  # never updated, never decayed
        assert name not in sf[0]["tensors"]["param"]  # frozen: not trainable, not in the layout
    assert len({s["tensors"]["param"]["head.weight"] for s in sa}) == 4  # the used ones train
    fields = ("loss_bits", "grad_norm", "lr")
    assert [[s[k] for k in fields] for s in sa] == [[s[k] for k in fields] for s in sf]


def test_allow_unused_flat_and_fsdp2_agree_bit_for_bit(tmp_path):
    """At tier 4 the flat and FSDP2 engines leave the same parameters out, so their whole ledgers agree."""
    train(tmp_path / "flat", *UNUSED, *ENGINES["flat"], "model.allow_unused=true", nproc=2)
    train(tmp_path / "fsdp2", *UNUSED, *ENGINES["fsdp2"], "model.allow_unused=true")
    assert step_fields(tmp_path / "flat") == step_fields(tmp_path / "fsdp2")


# ---- issue 43: model buffers are part of the state ----------------------------------------------------------------
@pytest.mark.parametrize("nproc,tier", [(1, 3), (2, 3)])
def test_batchnorm_buffers_are_checkpointed_so_resumed_equals_uninterrupted(tmp_path, nproc, tier):
    """BatchNorm's running statistics live in buffers, not parameters: a checkpoint holds each rank's own
    (buffers/rank_XXXXX.pt, hashed like every file), so a run stopped after step 2 and resumed writes the whole
    uninterrupted ledger, val_loss_bits (the eval-mode forward reads the statistics) included."""
    args = ["model=custom", "model._target_=custom_models.BatchNormLM", "model.seq_len=32", f"det.tier={tier}", *RUN,
            "data.val_fraction=0.1", "eval.every=1", "eval.batches=2"]
    train(tmp_path / "full", *args, nproc=nproc)
    train(tmp_path / "cut", *args, "train.stop_after=1", nproc=nproc)  # steps 0 and 1, then step_00000002
    ck = tmp_path / "cut" / "checkpoints" / "step_00000002"
    assert sorted(p.name for p in (ck / "buffers").iterdir()) == [f"rank_{r:05d}.pt" for r in range(nproc)]
    saved = torch.load(ck / "buffers" / "rank_00000.pt", weights_only=True)
    assert sorted(saved) == ["norm.num_batches_tracked", "norm.running_mean", "norm.running_var"]
    assert int(saved["norm.num_batches_tracked"]) == 2 * 4 // nproc  # 2 steps of 4 micro-batches over the ranks
    train(tmp_path / "cut", *args, "ckpt.resume=auto", nproc=nproc)
    full = [s["val_loss_bits"] for s in read_ledger(tmp_path / "full")[1]]
    assert len(full) == 4 and full == [s["val_loss_bits"] for s in read_ledger(tmp_path / "cut")[1]]
    assert step_fields(tmp_path / "cut") == step_fields(tmp_path / "full")  # every field of every step line
    # to-torch writes the whole state dict, buffers included: it loads strictly into the model
    import subprocess
    import sys

    out = tmp_path / "model.pt"
    p = subprocess.run([sys.executable, "-m", "dettrain.checkpoint", "to-torch", str(tmp_path / "cut"), "--out",
                        str(out)], cwd=REPO, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(REPO)])})
    assert p.returncode == 0, p.stderr
    from custom_models import BatchNormLM

    BatchNormLM(256, 32).load_state_dict(torch.load(out, weights_only=True), strict=True)
