"""optim.no_decay: parameters it names get no weight decay, the same in every engine and on any sharding."""

from __future__ import annotations

import pytest
import torch
from conftest import step_fields, train

from dettrain import dist as D
from dettrain.models.llama import ModelConfig, build_model
from dettrain.sync.engines import DDPEngine, FlatEngine
from dettrain.sync.optim import FlatAdamW, OptimConfig, decays, unmatched_no_decay

PRESET = "optim.no_decay=[norm,bias,tok_emb]"


def test_patterns():
    cfg = OptimConfig(no_decay=["norm", "tok_emb", "layers.1.*.wq.weight"])
    assert not decays("layers.0.attn_norm.weight", cfg) and not decays("tok_emb.weight", cfg)
    assert not decays("layers.1.attn.wq.weight", cfg) and decays("layers.0.attn.wq.weight", cfg)
    assert decays("norm.weight", OptimConfig())  # the default decays everything
    assert unmatched_no_decay(["norm.weight"], OptimConfig(no_decay=["norm", "bias"])) == ["bias"]


def test_flat_adamw_zero_grad_no_decay_param_stays_exactly_unchanged():
    """Two parameters in one flat buffer, zero gradient: the no-decay one keeps every bit, the other shrinks by
    (1 - lr * wd); the same bits whether the buffer is updated as one region or as shards cut anywhere."""
    torch.manual_seed(0)
    p0 = torch.randn(100)
    cfg = OptimConfig(weight_decay=0.1)
    outs = []
    for regions in ([(0, 100)], [(0, 17), (17, 64), (64, 100)]):
        p, g = p0.clone(), torch.zeros(100)
        opt = FlatAdamW(p, g, regions, cfg, no_decay=[(30, 60)])
        opt.step(lr=0.5)
        outs.append(p)
    p = outs[0]
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(p[30:60], p0[30:60])
    assert torch.equal(p[:30], p0[:30] * (1 - 0.5 * 0.1)) and torch.equal(p[60:], p0[60:] * (1 - 0.5 * 0.1))
    assert (p[:30].abs() < p0[:30].abs()).all()


def _tiny_engine(kind: str, no_decay: list[str]):
    model = build_model(ModelConfig(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=64, seq_len=16,
                                    vocab_size=64), 0, "cpu")
    info = D.DistInfo(rank=0, world=1, local_rank=0, device=torch.device("cpu"), backend=None)
    optim = OptimConfig(weight_decay=0.1, no_decay=no_decay)
    if kind == "ddp":
        eng = DDPEngine(model, info, 2, optim, lr=0.5, bucket_mb=25.0)
    else:
        eng = FlatEngine(model, info, 4, optim, bucket_mb=25.0, shard=False)
    return model, eng


def test_every_engine_zero_grad_step_keeps_no_decay_params_and_shrinks_the_rest():
    for kind in ("ddp", "flat"):
        model, eng = _tiny_engine(kind, ["norm", "tok_emb"])
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        eng.begin_step(1)
        if kind == "ddp":
            for p in model.parameters():
                p.grad = torch.zeros_like(p)
        else:
            eng.reducer.grad.zero_()
        eng.step(0.5)
        after = dict(model.named_parameters())
        kept = {n for n in before if torch.equal(after[n].detach(), before[n])}
        assert kept == {n for n in before if "norm" in n or "tok_emb" in n}, (kind, kept)
        for n in before.keys() - kept:
            assert after[n].detach().abs().sum() < before[n].abs().sum(), (kind, n)


def test_flat_1_rank_equals_fsdp2_2_ranks_at_tier4_with_no_decay(tmp_path):
    flat = tmp_path / "flat"
    train(flat, "det.tier=4", "dist.engine=flat", PRESET, "log.tensor_every=1")
    train(tmp_path / "fsdp2", "det.tier=4", "dist.engine=fsdp2", PRESET, "log.tensor_every=1", nproc=2)
    a, b = step_fields(flat), step_fields(tmp_path / "fsdp2")
    assert len(a) == 4 and a == b  # whole step lines, per-tensor fingerprints included
    # not a no-op: the same run with every parameter decayed ends with other parameters
    train(tmp_path / "decay", "det.tier=4", "dist.engine=flat", "log.tensor_every=1")
    fields = ("step", "batch", "loss_bits", "param")
    c, d = step_fields(tmp_path / "decay", fields), step_fields(flat, fields)
    assert c[0][:3] == d[0][:3]  # same data, same first loss (the update has not happened yet)
    assert len(c) == 4 and all(x[3] != y[3] for x, y in zip(c, d))  # every step's parameters differ


def test_ddp_no_decay_changes_the_parameters(tmp_path):
    train(tmp_path / "a", "det.tier=2", "dist.engine=ddp", "train.steps=2")
    train(tmp_path / "b", "det.tier=2", "dist.engine=ddp", "train.steps=2", PRESET)
    pa, pb = step_fields(tmp_path / "a", ("param",)), step_fields(tmp_path / "b", ("param",))
    assert len(pa) == 2 and all(x != y for x, y in zip(pa, pb))


def test_adamw_many_refuses_lists_of_different_lengths():
    """A parameter without its gradient, moments or weight decay is a caller's bug: named, never half-updated."""
    from dettrain.kernels.optim import adamw_many_

    p = [torch.zeros(3), torch.zeros(2)]
    before = [t.clone() for t in p]
    with pytest.raises(ValueError, match="2 parameters, 1 gradients"):
        adamw_many_(p, [torch.ones(3)], [torch.zeros(3)] * 2, [torch.zeros(3)] * 2, beta1=0.9, beta2=0.95, lr=0.1,
                    weight_decays=[0.0, 0.0], eps=1e-8, step=1)
    assert all(torch.equal(a, b) for a, b in zip(p, before))


def test_flat_adamw_moments_are_made_at_the_first_step_not_during_its_backward(tmp_path):
    """Tier 3's moments (two fp32 copies of the model) are allocated when the first optimizer step needs them, as
    torch.optim.AdamW's are: the first step's forward and backward (with their compile on CUDA) run without them, so
    the run's peak is not raised above tier 0's by 2 x the parameter bytes."""
    from conftest import TINY
    from hydra import compose, initialize_config_dir

    from dettrain.config import conf_dir, register, to_config
    from dettrain.determinism import apply_tier, seed_process
    from dettrain.loop.trainer import Trainer

    register()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
        cfg = to_config(compose(config_name="config", overrides=[*TINY, "det.tier=3", f"run_dir={tmp_path}"]))
    apply_tier(cfg.det)
    seed_process(cfg.seed, 0)
    tr = Trainer(cfg, D.DistInfo(0, 1, 0, torch.device("cpu"), None), tmp_path)
    opt = tr.engine.opt
    assert isinstance(opt, FlatAdamW) and not opt.allocated
    seen: list[bool] = []
    it = iter(tr.sampler)
    line = tr.train_step(next(it), after_micro=lambda: seen.append(opt.allocated))
    assert seen == [False] * len(seen) and len(seen) == 4  # 8 / 2 micro-batches, none with moments
    assert opt.allocated and opt.exp_avg.abs().sum() > 0 and line["opt"]
    assert opt.exp_avg.numel() == opt.exp_avg_sq.numel() == sum(e - a for a, e in opt.regions)
