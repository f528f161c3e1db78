"""Small non-LLaMA language models for the custom-model tests (imported by subprocesses through PYTHONPATH)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from dettrain.models.llama import init_by_name


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


class NoisyLM(nn.Module):
    """MLPLM's shape with a deliberately non-deterministic module: ``noisy`` adds noise from a generator seeded from
    the operating system's entropy, so two replays of one step differ there and nowhere before it."""

    def __init__(self, vocab_size: int, seq_len: int, width: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab_size, width)
        self.noisy = AddNoise()
        self.head = nn.Linear(width, vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.noisy(self.emb(tokens)))


class AddNoise(nn.Module):
    def __init__(self, scale: float = 1e-3) -> None:
        super().__init__()
        self.scale = scale
        self.gen = torch.Generator()
        self.gen.seed()  # not dettrain's seed: a fresh draw from the OS on every construction

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.scale * torch.randn(x.shape, generator=self.gen)


THREAD_SUM_SEED = 7  # tests/conftest.py's sums_with_1_and_2_threads(7) is the same sum on 1 and on 2 threads


class ThreadSumLM(nn.Module):
    """An LM whose first op is a 1e7-element fp32 ``sum`` (module ``total``): its bits depend on torch's thread
    count on the CPU, and it shifts every embedding, so a change of det.threads shows there first."""

    def __init__(self, vocab_size: int, seq_len: int, width: int = 16) -> None:
        super().__init__()
        self.total = BigSum(THREAD_SUM_SEED)
        self.emb = nn.Embedding(vocab_size, width)
        self.head = nn.Linear(width, vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(tokens) + self.total())


class BigSum(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        # a buffer, not a parameter: neither trained nor checkpointed, rebuilt from the seed
        self.register_buffer("big", torch.randn(10_000_000, generator=torch.Generator().manual_seed(seed)),
                             persistent=False)

    def forward(self) -> torch.Tensor:
        return self.big.sum() / self.big.numel()


class PlainLM(nn.Module):
    """A plain ``nn.Module(vocab_size, dim)``: no seq_len parameter (the harness still reads model.seq_len)."""

    def __init__(self, vocab_size: int, dim: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab_size, dim)
        self.head = nn.Linear(dim, vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.emb(tokens)))


def fixed_vocab_lm(width: int = 8) -> nn.Module:
    """Takes neither vocab_size nor seq_len: a 256-token vocabulary (model.vocab_size's default) built in."""
    return PlainLM(256, width)


def kwargs_lm(**kwargs) -> nn.Module:
    """Takes ``**kwargs``: receives vocab_size and seq_len with its own keys."""
    kwargs_lm.received = sorted(kwargs)
    return PlainLM(kwargs["vocab_size"], kwargs.get("dim", 8))


class GRUBlock(nn.Module):
    """A residual GRU mixer: Dynamo cannot trace nn.GRU, so train.compile falls back for this block."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.gru = nn.GRU(width, width, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.gru(x)[0]


class MLPBlock(nn.Module):
    """A residual MLP: traces into one graph."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class HybridLM(nn.Module):
    """Two lists of identical blocks (not named ``layers``): GRU mixers, then MLPs."""

    def __init__(self, vocab_size: int, width: int = 16, depth: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab_size, width)
        self.mixers = nn.ModuleList(GRUBlock(width) for _ in range(depth))
        self.mlps = nn.ModuleList(MLPBlock(width) for _ in range(depth))
        self.head = nn.Linear(width, vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        for block in (*self.mixers, *self.mlps):
            x = block(x)
        return self.head(x)


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


class BatchNormLM(nn.Module):
    """MLPLM's causal mean of embeddings, then a BatchNorm over the channels: its running statistics are buffers the
    optimizer never sees, used by the validation forward (eval mode)."""

    def __init__(self, vocab_size: int, seq_len: int, width: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab_size, width)
        self.norm = nn.BatchNorm1d(width)
        self.head = nn.Linear(width, vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        n = torch.arange(1, tokens.shape[1] + 1, device=tokens.device, dtype=x.dtype).view(1, -1, 1)
        return self.head(self.norm((x.cumsum(1) / n).transpose(1, 2)).transpose(1, 2))
