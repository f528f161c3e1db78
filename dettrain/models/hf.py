"""Hugging Face causal LMs as dettrain models: ``model._target_: dettrain.models.hf.from_config`` (built from a config,
nothing downloaded).

    python -m dettrain model=hf_llama                      # conf/model/hf_llama.yaml: a tiny LlamaConfig
    python -m dettrain model=hf_llama model.num_hidden_layers=4
    python -m dettrain model=hf_llama model.model_type=qwen2   # the same shape as Qwen2 (or model=hf_qwen2)
    python -m dettrain model=hf_mistral                    # Mistral, sliding-window attention (64 of 128 tokens)

Model types: any that ``transformers.AutoModelForCausalLM`` builds; tested at tiers 3-4 (tests/test_hf.py: 1 vs 2
ranks bitwise identical at tier 4 on CPU) are llama, qwen2 and mistral.  A type with no causal-LM class there (t5,
vit) is refused with the list of the tested ones.  Their blocks (``hf.model.layers``) are the units FSDP2 shards
and train.compile compiles one by one.

``from_config`` takes the keyword arguments of the architecture's config class (``model_type`` picks it: llama by
default, any ``transformers.AutoConfig`` model type works) plus dettrain's ``vocab_size`` and ``seq_len`` (the
default ``max_position_embeddings``), builds ``AutoModelForCausalLM.from_config`` in fp32 and wraps it so that
``forward(tokens)`` returns the logits tensor (B, T, V), with the KV cache off.  Its parameters keep their
transformers names under the prefix ``hf.`` (``hf.model.layers.0.self_attn.q_proj.weight``).

Determinism: transformers initialises weights from torch's global RNG, which dettrain seeds from (seed, "init")
before calling the factory (models/custom.py): the same values on every rank and world size.

Attention: ``model.attn_implementation`` null (the default) builds the model with ``"dettrain"``, registered with
transformers by ``attention.register_hf``: det.attention then decides per run, as for dettrain's own LLaMA
(auto: dettrain's deterministic Triton kernel at det.tier >= 2 on CUDA for every call it serves, transformers'
``sdpa`` path for the rest and on CPU, where the bits are those of ``sdpa``).  A pinned ``eager`` or ``sdpa`` is
kept (``sdpa`` calls torch's F.scaled_dot_product_attention, which det.attention still routes); both are
deterministic on the CPU for a fixed thread count, and on CUDA at det.tier >= 2 (torch's deterministic mode).
Needs ``pip install 'dettrain[hf]'``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dettrain.errors import UserError
from dettrain.models.attention import HF_NAME, plain_inputs, register_hf


class HFCausalLM(nn.Module):
    """A transformers causal LM whose forward maps token ids (B, T) to logits (B, T, V)."""

    def __init__(self, hf: nn.Module) -> None:
        super().__init__()
        self.hf = hf

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # token ids only: no padding mask and the default positions, which dettrain.models.attention's mask function may
        # rely on (a plain causal batch reaches the attention as mask None, compiled too)
        plain_inputs(True)
        try:
            return self.hf(input_ids=tokens, use_cache=False, return_dict=True).logits
        finally:
            plain_inputs(False)


def from_config(vocab_size: int, seq_len: int, model_type: str = "llama", attn_implementation: str | None = None,
                **config: Any) -> HFCausalLM:
    """Build ``AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **config))`` in fp32, wrapped;
    ``attn_implementation`` None selects dettrain's (det.attention routes it), eager and sdpa are kept."""
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError as e:
        raise UserError(f"model._target_=dettrain.models.hf.from_config needs transformers ({e}); "
                        "pip install 'dettrain[hf]'") from None
    if attn_implementation is None:
        attn_implementation = HF_NAME
    if attn_implementation not in (HF_NAME, "eager", "sdpa"):
        raise UserError(f"model.attn_implementation={attn_implementation!r}: use null (dettrain's, routed by "
                        "det.attention), eager or sdpa (deterministic with dettrain's tiers; other kernels are not "
                        "checked)")
    register_hf()
    config.setdefault("max_position_embeddings", seq_len)
    try:
        hf_cfg = AutoConfig.for_model(model_type, vocab_size=vocab_size, use_cache=False, **config)
    except (ValueError, TypeError, KeyError) as e:
        raise UserError(f"model.model_type={model_type!r} with keys {sorted(config)}: {e}") from None
    _check_causal_lm(model_type)
    model = AutoModelForCausalLM.from_config(hf_cfg, attn_implementation=attn_implementation, dtype=torch.float32)
    return HFCausalLM(model)


TESTED_MODEL_TYPES = ("llama", "qwen2", "mistral")
"""Model types whose tier-3/4 promises tests/test_hf.py checks (others train, their promises unchecked)."""


def _check_causal_lm(model_type: str) -> None:
    """Refuse a model type that ``AutoModelForCausalLM`` has no class for, naming the tested ones."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise UserError(f"model.model_type={model_type!r} has no causal LM in transformers (AutoModelForCausalLM); "
                        f"use a decoder such as {', '.join(TESTED_MODEL_TYPES)}")
