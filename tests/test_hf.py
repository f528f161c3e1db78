"""A transformers causal LM (tiny LlamaConfig, built from the config) trains through dettrain's path at tiers 3-4."""

from __future__ import annotations

import pytest
import torch
from conftest import train

from dettrain.custom_model import CustomModelConfig
from dettrain.ledger import read_ledger
from dettrain.model import build_model

transformers = pytest.importorskip("transformers")

TINY_HF = ["model=hf_llama", "model.seq_len=32", "model.hidden_size=32", "model.intermediate_size=64",
           "model.num_hidden_layers=2", "model.num_attention_heads=4", "model.num_key_value_heads=2",
           "train.steps=4", "train.global_batch=8", "train.micro_batch=2", "data.max_bytes=300000",
           "log.wandb.mode=disabled", "log.every=1"]


def test_hf_llama_is_world_size_invariant_at_tier_4(tmp_path):
    train(tmp_path / "w1", *TINY_HF, "det.tier=4", tiny=False)
    train(tmp_path / "w2", *TINY_HF, "det.tier=4", tiny=False, nproc=2)
    h1, s1 = read_ledger(tmp_path / "w1")
    h2, s2 = read_ledger(tmp_path / "w2")
    assert h1["config"]["model"]["_target_"] == "dettrain.hf.from_config" and h2["world_size"] == 2
    assert len(s1) == 4 and s1 == s2
    assert s1[0]["loss"] > s1[-1]["loss"]


def test_hf_llama_at_tier_3_does_not_depend_on_the_bucket_size(tmp_path):
    train(tmp_path / "a", *TINY_HF, "det.tier=3", "dist.bucket_mb=0.01", tiny=False, nproc=2)
    train(tmp_path / "b", *TINY_HF, "det.tier=3", "dist.bucket_mb=25", tiny=False, nproc=2)
    _, a = read_ledger(tmp_path / "a")
    _, b = read_ledger(tmp_path / "b")
    assert len(a) == 4 and a == b


def test_from_config_returns_logits_and_matches_its_llama():
    cfg = CustomModelConfig(_target_="dettrain.hf.from_config", vocab_size=64, seq_len=16,
                            kwargs={"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1,
                                    "num_attention_heads": 2, "num_key_value_heads": 2,
                                    "attn_implementation": "eager"})
    m = build_model(cfg, seed=0)
    assert isinstance(m.hf, transformers.LlamaForCausalLM) and not m.hf.config.use_cache
    assert m.hf.config.max_position_embeddings == 16
    tok = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        assert torch.equal(m(tok), m.hf(tok).logits)
    # init comes from the seed (the harness seeds the factory), not from the process RNG
    torch.manual_seed(99)
    again = build_model(cfg, seed=0)
    other = build_model(cfg, seed=1)
    p0, p1, p2 = (dict(x.named_parameters()) for x in (m, again, other))
    name = "hf.model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(p0[name], p1[name]) and not torch.equal(p0[name], p2[name])
