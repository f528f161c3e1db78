"""A recurrent language model trained by dettrain's harness: the factory of examples/conf/exp/gru.yaml.

    PYTHONPATH=examples python -m dettrain --config-dir examples/conf +exp=gru

The factory gets every key of the ``model`` node except ``_target_`` and ``name`` as a keyword argument
(``vocab_size`` and ``seq_len`` included) and returns an ``nn.Module`` mapping token ids (B, T) to logits (B, T, V).
``seed: ${seed}`` in the YAML hands it the run's seed for ``init_by_name``: every weight matrix drawn from a
generator keyed by (seed, parameter name).  Contract and promises: docs/custom_models.md.
"""

from __future__ import annotations

import torch
from torch import nn

from dettrain.models.llama import init_by_name


class GRULM(nn.Module):
    """Embedding -> GRU -> (dropout) -> linear head: tokens (B, T) -> logits (B, T, V)."""

    def __init__(self, vocab_size: int, hidden: int, layers: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab_size, hidden)
        self.gru = nn.GRU(hidden, hidden, num_layers=layers, batch_first=True)
        self.drop = nn.Dropout(dropout)
        self.head = nn.Linear(hidden, vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        y, _ = self.gru(self.emb(tokens))
        return self.head(self.drop(y))


def gru_lm(vocab_size: int, seq_len: int, hidden: int = 128, layers: int = 2, seed: int = 0,
           init_std: float = 0.05) -> GRULM:
    """``seq_len`` is unused: a recurrent model takes any length."""
    del seq_len
    model = GRULM(vocab_size, hidden, layers)
    init_by_name(model, seed, std=init_std)  # weight matrices; biases keep PyTorch's (seeded) init
    return model
