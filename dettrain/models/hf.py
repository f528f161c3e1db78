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

Pretrained start: ``model.pretrained=DIR_OR_HUB_ID`` (``model=hf_llama model.pretrained=org/name``, any preset)
loads the config and the safetensors weights of a ``save_pretrained`` directory or of a Hub id resolved through the
Hugging Face cache (dettrain/hub.py: ``HF_HOME``, ``HF_HUB_OFFLINE`` honoured, downloaded when online).  The
checkpoint's config.json decides the architecture: the preset's shape keys (hidden_size, num_hidden_layers ...) are
not used, ``model.vocab_size`` is set to the checkpoint's (config.py) and ``model.seq_len`` stays the training
context.  The parameters are the file's bytes, not dettrain's seeded init (a parameter the file lacks is refused),
loaded as fp32 master weights: a bf16 checkpoint is upcast, exactly (every bf16 value is an fp32 value).  The
weights' sha256 (of each safetensors file, computed once by rank 0) is the ledger header's ``pretrained``.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dettrain.errors import UserError
from dettrain.models.attention import HF_NAME, plain_inputs, register_hf


class HFCausalLM(nn.Module):
    """A transformers causal LM whose forward maps token ids (B, T) to logits (B, T, V)."""

    def __init__(self, hf: nn.Module, pretrained: tuple[str, Path] | None = None) -> None:
        super().__init__()
        self.hf = hf
        self.pretrained = pretrained  # (model.pretrained as given, the directory its weights were read from)
        self._identity: dict | None = None

    def pretrained_identity(self) -> dict | None:
        """What the ledger header records of a pretrained start (None for a model built from a config): the source
        as given, its directory, the Hub commit, and the sha256 of every safetensors file, hashed on first call."""
        if self.pretrained is None:
            return None
        if self._identity is None:
            from dettrain.checkpoint.storage import _sha256_file
            from dettrain.hub import snapshot_revision

            spec, path = self.pretrained
            self._identity = {"source": spec, "path": str(path), "revision": snapshot_revision(path),
                              "sha256": {f.name: _sha256_file(f) for f in sorted(path.glob("*.safetensors"))}}
        return self._identity

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # token ids only: no padding mask and the default positions, which dettrain.models.attention's mask function may
        # rely on (a plain causal batch reaches the attention as mask None, compiled too)
        plain_inputs(True)
        try:
            return self.hf(input_ids=tokens, use_cache=False, return_dict=True).logits
        finally:
            plain_inputs(False)


def from_config(vocab_size: int, seq_len: int, model_type: str = "llama", attn_implementation: str | None = None,
                pretrained: str | None = None, **config: Any) -> HFCausalLM:
    """Build ``AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **config))`` in fp32, wrapped;
    ``attn_implementation`` None selects dettrain's (det.attention routes it), eager and sdpa are kept.
    ``pretrained``: the config and weights of that directory or Hub id instead (``config`` is not used)."""
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
    if pretrained:
        return _from_pretrained(pretrained, vocab_size, attn_implementation)
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


_CONFIG_ONLY = [False]


@contextmanager
def config_only():
    """Inside: a pretrained model is built from its config.json without reading its weights (export fills in the
    checkpoint's parameters)."""
    _CONFIG_ONLY[0] = True
    try:
        yield
    finally:
        _CONFIG_ONLY[0] = False


def pretrained_config(spec: str):
    """(the directory of ``model.pretrained``, its transformers config with the KV cache off)."""
    from transformers import AutoConfig

    from dettrain.hub import resolve

    path = resolve(spec, "model.pretrained")
    try:
        cfg = AutoConfig.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - transformers raises OSError/ValueError/KeyError for a bad config.json
        raise UserError(f"model.pretrained={spec!r}: {path} has no config.json transformers reads "
                        f"({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}); pass a "
                        "save_pretrained directory") from None
    cfg.use_cache = False
    return path, cfg


def pretrained_vocab_size(spec: str) -> int:
    """The vocabulary of ``model.pretrained`` (what config.py sets ``model.vocab_size`` to)."""
    return int(pretrained_config(spec)[1].vocab_size)


def _from_pretrained(spec: str, vocab_size: int, attn_implementation: str) -> HFCausalLM:
    """The checkpoint's model with its weights in fp32 (on the meta device, or in ``config_only``: shapes only)."""
    from transformers import AutoModelForCausalLM

    path, hf_cfg = pretrained_config(spec)
    _check_causal_lm(hf_cfg.model_type)
    if hf_cfg.vocab_size != vocab_size:
        raise UserError(f"model.vocab_size={vocab_size} differs from the vocabulary of model.pretrained={spec!r} "
                        f"({hf_cfg.vocab_size}); leave model.vocab_size unset, it is taken from the checkpoint")
    if torch.empty(0).device.type == "meta" or _CONFIG_ONLY[0]:
        model = AutoModelForCausalLM.from_config(hf_cfg, attn_implementation=attn_implementation, dtype=torch.float32)
        return HFCausalLM(model, (spec, path))
    if not any(path.glob("*.safetensors")):
        raise UserError(f"model.pretrained={spec!r}: {path} holds no .safetensors weights (pickled .bin weights "
                        "are not loaded); save the model with save_pretrained(safe_serialization=True)")
    # read on the CPU (the harness moves the module to its device); fp32 master weights whatever the file holds
    with torch.device("cpu"):
        model, info = AutoModelForCausalLM.from_pretrained(
            str(path), config=hf_cfg, attn_implementation=attn_implementation, dtype=torch.float32,
            local_files_only=True, use_safetensors=True, output_loading_info=True)
    missing = sorted(info.get("missing_keys") or [])
    if missing:  # they would start from an init, not from the file: not the pretrained model
        raise UserError(f"model.pretrained={spec!r}: {len(missing)} parameter(s) are not in its weights "
                        f"({', '.join(missing[:3])}); pass a complete save_pretrained checkpoint of a causal LM")
    return HFCausalLM(model, (spec, path))
