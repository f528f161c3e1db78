"""Small non-LLaMA language models for the custom-model tests (imported by subprocesses through PYTHONPATH)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from dettrain.model import init_by_name


class GRULM(nn.Module):
    """Embedding -> GRU -> linear head: a recurrent LM, nothing like dettrain's transformer."""

    def __init__(self, vocab_size: int, seq_len: int, hidden: int = 32, layers: int = 1) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab_size, hidden)
        self.gru = nn.GRU(hidden, hidden, num_layers=layers, batch_first=True)
        self.head = nn.Linear(hidden, vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        y, _ = self.gru(self.emb(tokens))
        return self.head(y)


def gru_lm(vocab_size: int, seq_len: int, hidden: int = 32, layers: int = 1, seed: int | None = None) -> GRULM:
    """The factory of ``model._target_``; with ``seed`` (``seed: ${seed}`` in the YAML) init keyed by name."""
    m = GRULM(vocab_size, seq_len, hidden, layers)
    if seed is not None:
        init_by_name(m, seed, std=0.1)
    return m


class MLPLM(nn.Module):
    """A causal bag-of-previous-tokens MLP (cumulative mean of embeddings): no attention, no recurrence."""

    def __init__(self, vocab_size: int, seq_len: int, width: int = 32) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab_size, width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, vocab_size))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        n = torch.arange(1, tokens.shape[1] + 1, device=tokens.device, dtype=x.dtype).view(1, -1, 1)
        return self.mlp(x.cumsum(1) / n)


def wrong_shape(vocab_size: int, seq_len: int) -> nn.Module:
    """Returns (B, T, vocab_size + 1): the harness must refuse it."""
    return nn.Embedding(vocab_size, vocab_size + 1)


def broken_factory(vocab_size: int, seq_len: int) -> nn.Module:
    """A factory with a bug of its own: its traceback must reach the user."""
    return _build_broken(vocab_size)


def _build_broken(vocab_size: int) -> nn.Module:
    raise ZeroDivisionError(f"broken_factory's own bug ({vocab_size} / 0)")


class TimeMajor(nn.Module):
    """Returns logits (T, B, V): a transposed output the start-up check must catch."""

    def __init__(self, vocab_size: int, seq_len: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab_size, 8)
        self.head = nn.Linear(8, vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(tokens)).transpose(0, 1)


class NoParams(nn.Module):
    """A model with nothing to train (uniform logits)."""

    def __init__(self, vocab_size: int, seq_len: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return torch.zeros(*tokens.shape, self.vocab_size, device=tokens.device)


class WithUnused(nn.Module):
    """MLPLM plus a parameter (and a whole layer) that no forward ever uses; ``freeze=True`` sets requires_grad=False
    on them, the fix the harness names."""

    def __init__(self, vocab_size: int, seq_len: int, width: int = 16, freeze: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab_size, width)
        self.head = nn.Linear(width, vocab_size)
        self.spare = nn.Linear(width, width)  # never called
        self.scale = nn.Parameter(torch.ones(width))  # never read
        if freeze:
            for p in (*self.spare.parameters(), self.scale):
                p.requires_grad_(False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        n = torch.arange(1, tokens.shape[1] + 1, device=tokens.device, dtype=x.dtype).view(1, -1, 1)
        return self.head(x.cumsum(1) / n)


class TimeMajorInTraining(MLPLM):
    """Batch-first in eval mode (passes the start-up check), time-major (T, B, V) in training: the loss path must
    refuse it instead of flattening misaligned rows."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out = super().forward(tokens)
        return out.transpose(0, 1) if self.training else out


class GatedMLP(MLPLM):
    """MLPLM whose forward waits while the file ``gate`` exists (creating ``gate``.held when it starts to): a test
    holds a run inside a step with it."""

    def __init__(self, vocab_size: int, seq_len: int, width: int = 16, gate: str = "") -> None:
        super().__init__(vocab_size, seq_len, width)
        self.gate = gate

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        import os
        import time

        if self.gate and os.path.exists(self.gate):
            Path(self.gate + ".held").touch()  # tells the test the run is held here
            while os.path.exists(self.gate):
                time.sleep(0.01)
        return super().forward(tokens)
