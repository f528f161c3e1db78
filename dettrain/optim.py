"""Optimizer, learning-rate schedule and the flat AdamW used at tiers 3-4."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


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

    Written with single elementwise ops only (mul, add, sqrt, div; no fused lerp/addcdiv/alpha-adds), each one IEEE
    correctly rounded per element, so an element's update does not depend on which slice it is processed in, on
    vectorisation tails or on thread splits: sharded and unsharded runs produce the same bits."""

    def __init__(self, param: torch.Tensor, grad: torch.Tensor, regions: list[tuple[int, int]],
                 cfg: OptimConfig) -> None:
        self.param, self.grad, self.regions, self.cfg = param, grad, regions, cfg
        self.exp_avg = torch.zeros_like(param)
        self.exp_avg_sq = torch.zeros_like(param)
        self.step_count = 0

    @torch.no_grad()
    def step(self, lr: float) -> None:
        c = self.cfg
        self.step_count += 1
        t = self.step_count
        bc1, bc2 = 1 - c.beta1**t, 1 - c.beta2**t
        for a, e in self.regions:
            p, g = self.param[a:e], self.grad[a:e]
            m, v = self.exp_avg[a:e], self.exp_avg_sq[a:e]
            m.mul_(c.beta1).add_(g * (1 - c.beta1))
            v.mul_(c.beta2).add_((g * g) * (1 - c.beta2))
            if c.weight_decay:
                p.mul_(1 - lr * c.weight_decay)
            denom = (v.sqrt() / math.sqrt(bc2)) + c.eps
            p.sub_((m / denom) * (lr / bc1))

    def state_dict(self) -> dict:
        return {"step": self.step_count, "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}

    def load_state_dict(self, state: dict) -> None:
        self.step_count = int(state["step"])
        self.exp_avg.copy_(state["exp_avg"])
        self.exp_avg_sq.copy_(state["exp_avg_sq"])
