"""Transformers causal LMs (tiny Llama, Qwen2 and Mistral configs, built from the config) train through dettrain's
path at tiers 3-4: tier 4 gives the same whole step lines on 1 and 2 Gloo ranks for each model type (and with FSDP2
sharding the HF blocks one by one, the flat engine's), the presets and
``model=hf_llama model.model_type=...`` build the model type they name, and a type without a causal LM is refused."""

from __future__ import annotations

import pytest
import torch
from conftest import hub_repo, step_fields, train

from dettrain.errors import UserError
from dettrain.models.custom import CustomModelConfig
from dettrain.models.llama import build_model
from dettrain.record.ledger import read_ledger

transformers = pytest.importorskip("transformers")

# the tiny shape for every model type (the preset after model= picks the type)
TINY_SHAPE = ["model.seq_len=32", "model.hidden_size=32", "model.intermediate_size=64",
              "model.num_hidden_layers=2", "model.num_attention_heads=4", "model.num_key_value_heads=2",
              "train.steps=4", "train.global_batch=8", "train.micro_batch=2", "data.max_bytes=300000",
              "log.wandb.mode=disabled", "log.every=1"]
TINY_HF = ["model=hf_llama", *TINY_SHAPE]


def test_hf_llama_is_world_size_invariant_at_tier_4(tmp_path):
    train(tmp_path / "w1", *TINY_HF, "det.tier=4", tiny=False)
    train(tmp_path / "w2", *TINY_HF, "det.tier=4", tiny=False, nproc=2)
    h1, s1 = read_ledger(tmp_path / "w1")
    h2, s2 = read_ledger(tmp_path / "w2")
    assert h1["config"]["model"]["_target_"] == "dettrain.models.hf.from_config" and h2["world_size"] == 2
    assert len(s1) == 4 and s1 == s2
    assert s1[0]["loss"] > s1[-1]["loss"]


def test_hf_llama_at_tier_3_does_not_depend_on_the_bucket_size(tmp_path):
    train(tmp_path / "a", *TINY_HF, "det.tier=3", "dist.bucket_mb=0.01", tiny=False, nproc=2)
    train(tmp_path / "b", *TINY_HF, "det.tier=3", "dist.bucket_mb=25", tiny=False, nproc=2)
    _, a = read_ledger(tmp_path / "a")
    _, b = read_ledger(tmp_path / "b")
    assert len(a) == 4 and a == b


def test_hf_llama_sharded_block_by_block_by_fsdp2_equals_flat_at_tier_4(tmp_path):
    """FSDP2 shards hf.model.layers one by one (fsdp.transformer_blocks): 2 ranks give the flat engine's bits."""
    train(tmp_path / "flat", *TINY_HF, "det.tier=4", tiny=False)
    train(tmp_path / "fsdp2", *TINY_HF, "det.tier=4", "dist.engine=fsdp2", tiny=False, nproc=2)
    flat = step_fields(tmp_path / "flat")
    assert len(flat) == 4 and flat == step_fields(tmp_path / "fsdp2")
    assert read_ledger(tmp_path / "fsdp2")[0]["engine"] == "fsdp2"


def test_from_config_returns_logits_and_matches_its_llama():
    cfg = CustomModelConfig(_target_="dettrain.models.hf.from_config", vocab_size=64, seq_len=16,
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


# Mistral's sliding window shorter than the 32-token samples, so that it masks
OTHER_TYPES = {"qwen2": ["model=hf_qwen2"], "mistral": ["model=hf_mistral", "model.sliding_window=16"]}


@pytest.mark.parametrize("model_type", sorted(OTHER_TYPES))
def test_qwen2_and_mistral_are_world_size_invariant_at_tier_4(tmp_path, model_type):
    over = [*OTHER_TYPES[model_type], *TINY_SHAPE, "det.tier=4"]
    train(tmp_path / "w1", *over, tiny=False)
    train(tmp_path / "w2", *over, tiny=False, nproc=2)
    h1, _ = read_ledger(tmp_path / "w1")
    assert h1["config"]["model"]["model_type"] == model_type and h1["config"]["model"]["num_hidden_layers"] == 2
    s1 = step_fields(tmp_path / "w1")  # whole step lines
    assert len(s1) == 4 and s1 == step_fields(tmp_path / "w2")
    _, steps = read_ledger(tmp_path / "w1")
    assert steps[0]["loss"] > steps[-1]["loss"]


def _compose(overrides: list[str]):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from dettrain.config import conf_dir, register, to_config

    register()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        return to_config(compose(config_name="config", overrides=overrides))


@pytest.mark.parametrize("overrides,cls", [
    (["model=hf_llama", "model.model_type=qwen2"], "Qwen2ForCausalLM"),
    (["model=hf_llama", "model.model_type=mistral"], "MistralForCausalLM"),
    (["model=hf_qwen2"], "Qwen2ForCausalLM"),
    (["model=hf_mistral"], "MistralForCausalLM"),
], ids=["hf_llama-qwen2", "hf_llama-mistral", "hf_qwen2", "hf_mistral"])
def test_model_type_builds_its_architecture_from_config(overrides, cls):
    cfg = _compose([*overrides, "model.num_hidden_layers=1", "model.hidden_size=32", "model.intermediate_size=64"])
    m = build_model(cfg.model, seed=0)
    assert type(m.hf).__name__ == cls and not m.hf.config.use_cache
    assert m.hf.config.max_position_embeddings == cfg.model.seq_len == 128
    if cls.startswith("Qwen2"):  # Qwen2's q/k/v projections have biases, Llama's do not
        assert m.hf.model.layers[0].self_attn.q_proj.bias is not None
    if "model=hf_mistral" in overrides:
        assert m.hf.config.sliding_window == 64
    tok = torch.randint(0, 256, (1, 8))
    with torch.no_grad():
        assert m(tok).shape == (1, 8, 256)


def test_model_type_without_a_causal_lm_is_refused():
    from dettrain.models.hf import from_config

    with pytest.raises(UserError, match=r"model.model_type='t5' has no causal LM .*llama, qwen2, mistral"):
        from_config(64, 16, model_type="t5")


# ---- pretrained start: model.pretrained=DIR_OR_HUB_ID -----------------------------------------------------------
HUB_ID, HUB_REV = "org/tiny-llama", "0123456789abcdef0123456789abcdef01234567"
PRETRAINED_RUN = ["model=hf_llama", f"model.pretrained={HUB_ID}", "model.seq_len=32", "train.steps=3",
                  "train.global_batch=8", "train.micro_batch=2", "data.max_bytes=300000",
                  "log.wandb.mode=disabled", "log.every=1"]


def pretrained_llama(seed: int = 7):
    """A tiny LlamaForCausalLM whose weights no init of dettrain's gives (a scaled head: loss far from ln V)."""
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)
    return model


def hub_cache(root, model, repo_id: str = HUB_ID):
    """An HF_HOME holding ``model``'s save_pretrained (bf16 weights on disk) as the Hub id ``repo_id``."""
    model.to(torch.bfloat16).save_pretrained(root / "src")
    model.to(torch.float32)
    return root / "home", hub_repo(root / "home", repo_id, root / "src", rev=HUB_REV)


def first_step_loss(model, seq_len: int = 32) -> float:
    """Step 0's loss of ``model`` on the trainer's step-0 micro-batches (seed 0, global batch 8 of 2 each): the
    mean over micro-batches of the mean token cross-entropy, as the trainer defines it."""
    import dettrain

    mbs = next(iter(dettrain.sampler(None, seq_len=seq_len, seed=0, global_batch=8, micro_batch=2,
                                     max_bytes=300000)))
    with torch.no_grad():
        losses = [torch.nn.functional.cross_entropy(model(mb.tokens[:, :-1]).logits.float().flatten(0, 1),
                                                    mb.tokens[:, 1:].flatten()) for mb in mbs]
    return float(torch.stack(losses).mean())


def test_pretrained_start_from_the_hub_cache_loads_the_files_weights(tmp_path):
    """model.pretrained=org/name, offline from a Hugging Face cache built here: step 0's loss is the loss of the HF
    model loaded directly from that snapshot (the weights came from the file, bf16 upcast to fp32), the ledger
    header records the safetensors file's sha256 and the snapshot's commit, and tier 4 gives the same steps on
    1 and 2 ranks."""
    import hashlib

    home, snap = hub_cache(tmp_path / "hf", pretrained_llama())
    env = {"HF_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    train(tmp_path / "w1", *PRETRAINED_RUN, "det.tier=4", tiny=False, env=env)
    train(tmp_path / "w2", *PRETRAINED_RUN, "det.tier=4", tiny=False, env=env, nproc=2)
    header, steps = read_ledger(tmp_path / "w1")
    direct = transformers.AutoModelForCausalLM.from_pretrained(str(snap), dtype=torch.float32)
    want = first_step_loss(direct)
    assert want > 8.0  # far from ln(256) = 5.5: a fresh init would not give it
    assert steps[0]["loss"] == pytest.approx(want, rel=1e-5, abs=0)
    assert header["config"]["model"]["vocab_size"] == 256 and header["config"]["model"]["pretrained"] == HUB_ID
    sha = hashlib.sha256((snap / "model.safetensors").read_bytes()).hexdigest()
    assert header["pretrained"]["sha256"] == {"model.safetensors": sha}
    assert header["pretrained"]["revision"] == HUB_REV and header["pretrained"]["source"] == HUB_ID
    assert len(steps) == 3 and step_fields(tmp_path / "w1") == step_fields(tmp_path / "w2")
    assert steps[-1]["loss"] < steps[0]["loss"]


def test_pretrained_weights_missing_a_parameter_or_only_pickled_are_refused(tmp_path):
    """A parameter the file lacks would start from an init, not from the file: refused, named; so is a directory
    with only pickled .bin weights (never unpickled)."""
    from safetensors.torch import load_file, save_file

    from dettrain.models.hf import from_config

    d = tmp_path / "m"
    pretrained_llama().save_pretrained(d)
    tensors = load_file(str(d / "model.safetensors"))
    del tensors["lm_head.weight"]
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(UserError, match=r"1 parameter\(s\) are not in its weights \(lm_head.weight\)"):
        from_config(256, 32, pretrained=str(d))
    (d / "model.safetensors").rename(d / "pytorch_model.bin")
    with pytest.raises(UserError, match="holds no .safetensors weights"):
        from_config(256, 32, pretrained=str(d))
