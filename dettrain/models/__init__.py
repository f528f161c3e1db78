"""Models: dettrain's LLaMA (llama.py), Hugging Face causal LMs (hf.py), your own model through Hydra (custom.py),
and which attention every model runs (attention.py).  Here: what every model shares (the vocabulary limit)."""

from __future__ import annotations

from dettrain.errors import UserError

MAX_VOCAB = 1 << 32
"""Token ids are stored as at most uint32 (data.dtype), so no vocabulary is larger."""


def check_vocab_size(v: int) -> None:
    """A vocabulary that token files can hold (dettrain's LLaMA and custom models alike)."""
    if v > MAX_VOCAB:
        raise UserError(f"model.vocab_size={v} is larger than {MAX_VOCAB} (2^32: token ids are stored as at most "
                        "uint32); use the vocabulary of your tokenizer, or model.vocab_size=0 for data.path's sidecar")
