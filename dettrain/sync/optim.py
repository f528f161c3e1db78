"""Optimizer, learning-rate schedule and the flat AdamW used at tiers 3-4."""

from __future__ import annotations

import bisect
import fnmatch
import math
from dataclasses import dataclass, field

import torch

from dettrain.kernels.optim import adamw_


@dataclass
class OptimConfig:
    """AdamW and schedule (``optim.*``); the peak learning rate is ``train.lr``."""

    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    eps: float = 1e-8
    """AdamW epsilon."""
    weight_decay: float = 0.1
    """Decoupled weight decay, applied to every parameter except those ``no_decay`` names."""
    no_decay: list[str] = field(default_factory=list)
    """Parameters that get no weight decay, by name pattern: a pattern with ``* ? [`` is a glob over the full
    parameter name, any other a substring of it.  [] (default): decay every parameter, as torch.optim.AdamW does.
    Preset for norms, embeddings and biases: ``optim.no_decay=[norm,bias,tok_emb]``.  The same in every engine."""
    clip_grad_norm: float = 1.0
    """Clip the global gradient L2 norm to this value (0 disables); computed canonically at tiers 3-4."""
    warmup_steps: int = 20
    """Linear warm-up steps, then cosine decay to min_lr_ratio * train.lr at train.steps."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of train.lr."""


def decays(name: str, cfg: OptimConfig) -> bool:
    """Whether parameter ``name`` gets weight decay (``optim.no_decay``)."""
    return not any(fnmatch.fnmatchcase(name, p) if any(c in p for c in "*?[") else p in name for p in cfg.no_decay)


def unmatched_no_decay(names: list[str], cfg: OptimConfig) -> list[str]:
    """The ``optim.no_decay`` patterns that match none of ``names`` (a typo, or a preset entry this model lacks)."""
    return [p for p in cfg.no_decay if all(decays(n, OptimConfig(no_decay=[p])) for n in names)]


def lr_at(step: int, peak: float, total: int, cfg: OptimConfig) -> float:
    """Learning rate of optimizer step ``step`` (0-based): a Python float, the same on every rank."""
    if step < cfg.warmup_steps:
        return peak * (step + 1) / cfg.warmup_steps
    frac = (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps)
    frac = min(frac, 1.0)
    return peak * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


class FlatAdamW:
    """AdamW over slices of flat fp32 buffers (the whole buffer, or this rank's shards).

    ``no_decay``: global flat ranges [a, b) (whole parameters of the canonical layout, ``optim.no_decay``) updated
    with weight decay 0; each region is cut at their ends, so an element's update depends only on its own
    parameter, never on how the buffer is sharded.

    The moments are stored compactly: only the ``regions`` this rank updates, concatenated, so with
    ``dist.shard_optimizer`` each rank holds 1/W of the optimizer state (ZeRO-1).  ``view(name, a, b)`` maps a range
    of the global flat index space inside one region to its moment slice.  The update is ``kernels.optim.adamw_``: the
    same correctly rounded elementwise operations whichever slice an element is processed in, so sharded and
    unsharded runs produce the same bits."""

    def __init__(self, param: torch.Tensor, grad: torch.Tensor, regions: list[tuple[int, int]],
                 cfg: OptimConfig, no_decay: list[tuple[int, int]] = ()) -> None:
        self.param, self.grad, self.regions, self.cfg = param, grad, sorted(regions), cfg
        self.no_decay = sorted(no_decay)
        self._starts: list[int] = []
        total = 0
        for a, e in self.regions:
            self._starts.append(total)
            total += e - a
        # the moments are allocated on first use (the first step, a checkpoint's load or save, a fingerprint), as
        # torch.optim.AdamW does: not while the first step's forward and backward (and their compile) run
        self._size = total
        self._moments: tuple[torch.Tensor, torch.Tensor] | None = None
        self.step_count = 0
        self.frozen: list[tuple[int, int]] = []  # whole parameters left out of the update (model.allow_unused)

    def _allocate(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._moments is None:
            m = torch.zeros(self._size, dtype=self.param.dtype, device=self.param.device)
            self._moments = (m, torch.zeros_like(m))
        return self._moments

    @property
    def exp_avg(self) -> torch.Tensor:
        return self._allocate()[0]

    @property
    def exp_avg_sq(self) -> torch.Tensor:
        return self._allocate()[1]

    @property
    def allocated(self) -> bool:
        """Whether the moments exist yet (they are made on first use)."""
        return self._moments is not None

    def freeze(self, ranges: list[tuple[int, int]]) -> None:
        """Leave the global flat ranges [a, b) (whole parameters) out of every later step: no update, no decay."""
        self.frozen = sorted(ranges)

    def view(self, name: str, a: int, b: int) -> torch.Tensor:
        """The slice of moment ``name`` (exp_avg or exp_avg_sq) for global flat indices [a, b)."""
        buf = getattr(self, name)
        i = bisect.bisect_right(self.regions, (a, float("inf"))) - 1
        if i < 0 or b > self.regions[i][1]:
            raise ValueError(f"[{a}, {b}) is not inside one region this rank holds ({self.regions[:4]}...)")
        o = self._starts[i] + a - self.regions[i][0]
        return buf[o : o + b - a]

    @torch.no_grad()
    def step(self, lr: float) -> None:
        c = self.cfg
        self.step_count += 1
        for (a, e), o in zip(self.regions, self._starts):
            for s, t, wd in self._pieces(a, e):
                if self._is_frozen(s, t):
                    continue
                m = slice(o + s - a, o + t - a)
                # kernels.optim.adamw_: one fused Triton pass on CUDA, the same sequence of torch ops elsewhere (same
                # bits); elementwise, so cutting a region into pieces changes no bit
                adamw_(self.param[s:t], self.grad[s:t], self.exp_avg[m], self.exp_avg_sq[m], beta1=c.beta1,
                       beta2=c.beta2, lr=lr, weight_decay=wd, eps=c.eps, step=self.step_count)

    def _is_frozen(self, s: int, t: int) -> bool:
        i = bisect.bisect_right(self.frozen, (s, float("inf"))) - 1
        return i >= 0 and t <= self.frozen[i][1]

    def _pieces(self, a: int, e: int) -> list[tuple[int, int, float]]:
        """[a, e) cut into (start, end, weight decay) pieces at the ends of the no-decay and frozen ranges (a piece
        lies wholly inside a frozen range or outside all of them)."""
        out, pos = [], a
        no_decay = set(self.no_decay)
        # whole parameters: two ranges are equal or disjoint; cutting at more ends changes no bit (elementwise)
        for s0, t0 in sorted(no_decay | set(self.frozen)):
            s, t = max(s0, a), min(t0, e)
            if s >= t:
                continue
            if pos < s:
                out.append((pos, s, self.cfg.weight_decay))
            out.append((s, t, 0.0 if (s0, t0) in no_decay else self.cfg.weight_decay))
            pos = t
        if pos < e:
            out.append((pos, e, self.cfg.weight_decay))
        return out
