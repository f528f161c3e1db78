"""Optimizer, learning-rate schedule and the flat AdamW used at tiers 3-4."""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

import torch

from dettrain.flat_ops import adamw_


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
    """Decoupled weight decay, applied to every parameter (as torch.optim.AdamW does)."""
    clip_grad_norm: float = 1.0
    """Clip the global gradient L2 norm to this value (0 disables); computed canonically at tiers 3-4."""
    warmup_steps: int = 20
    """Linear warm-up steps, then cosine decay to min_lr_ratio * train.lr at train.steps."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of train.lr."""


def lr_at(step: int, peak: float, total: int, cfg: OptimConfig) -> float:
    """Learning rate of optimizer step ``step`` (0-based): a Python float, the same on every rank."""
    if step < cfg.warmup_steps:
        return peak * (step + 1) / cfg.warmup_steps
    frac = (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps)
    frac = min(frac, 1.0)
    return peak * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


class FlatAdamW:
    """AdamW over slices of flat fp32 buffers (the whole buffer, or this rank's shards).

    The moments are stored compactly: only the ``regions`` this rank updates, concatenated, so with
    ``dist.shard_optimizer`` each rank holds 1/W of the optimizer state (ZeRO-1).  ``view(name, a, b)`` maps a range
    of the global flat index space inside one region to its moment slice.  The update is ``flat_ops.adamw_``: the
    same correctly rounded elementwise operations whichever slice an element is processed in, so sharded and
    unsharded runs produce the same bits."""

    def __init__(self, param: torch.Tensor, grad: torch.Tensor, regions: list[tuple[int, int]],
                 cfg: OptimConfig) -> None:
        self.param, self.grad, self.regions, self.cfg = param, grad, sorted(regions), cfg
        self._starts: list[int] = []
        total = 0
        for a, e in self.regions:
            self._starts.append(total)
            total += e - a
        self.exp_avg = torch.zeros(total, dtype=param.dtype, device=param.device)
        self.exp_avg_sq = torch.zeros_like(self.exp_avg)
        self.step_count = 0

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
            n = e - a
            # flat_ops.adamw_: one fused Triton pass on CUDA, the same sequence of torch ops elsewhere (same bits)
            adamw_(self.param[a:e], self.grad[a:e], self.exp_avg[o : o + n], self.exp_avg_sq[o : o + n],
                   beta1=c.beta1, beta2=c.beta2, lr=lr, weight_decay=c.weight_decay, eps=c.eps,
                   step=self.step_count)
