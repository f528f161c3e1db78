"""The library API: make your own PyTorch loop bitwise reproducible with a handful of lines.

    import dettrain
    info = dettrain.setup(tier=4, seed=0)                     # tier settings, process group, seeds
    model = MyModel().to(info.device)                          # fp32 parameters, any nn.Module
    sync = dettrain.GradSync(model, accumulate="tree")         # canonical gradient sync ("fold" for tier 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)       # any optimizer
    ledger = dettrain.StepLedger("out/ledger.jsonl", model, opt, config={...})
    for step in range(steps):
        losses = []
        for k, index in enumerate(sync.my_micro_batches(M)):   # this rank's global micro-batch indices
            dettrain.seed_micro_batch(seed, step, index)       # dropout keyed by the global index, not the rank
            loss = loss_fn(model(x[index]), y[index])
            sync.backward(loss, k)                             # k-th of this rank's micro-batches
            losses.append(loss)
        sync.reduce()                                          # p.grad = the step's mean gradient, canonical order
        norm = sync.clip_grad_norm_(1.0)                       # the canonical norm (same bits on any world size)
        opt.step()
        ledger.log(step, loss=sync.mean(losses), batch=global_tokens_of_step)   # before zero_grad
        opt.zero_grad(set_to_none=False)

``accumulate="tree"`` sums the M micro-batch gradients of a step by one balanced binary tree over their global
indices (the same bits on 1, 2, 4 ... ranks; M and the world size powers of two); ``"fold"`` adds the local ones
in order and the ranks' partial sums by a fixed tree (identical reruns on a fixed world size, whatever the backend
or bucket size picks).  Either way no float is summed inside NCCL or Gloo (collectives.CanonicalReducer).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from dettrain import dist as D
from dettrain.collectives import CanonicalReducer, FlatLayout, canonical_mean
from dettrain.determinism import DetConfig, apply_tier, audit, seed_process, set_env_before_cuda, versions
from dettrain.errors import UserError
from dettrain.fingerprint import combine, fingerprint, fingerprint_many, format_fp, sum_u64
from dettrain.ledger import LedgerWriter, f32_bits
from dettrain.tiers import policy

ACCUMULATE = {"fold": 3, "tree": 4}


def setup(tier: int = 3, seed: int = 0, threads: int = 1, backend: str = "auto") -> D.DistInfo:
    """Apply determinism tier ``tier`` (0-4) to this process, start the process group (under torchrun) and seed
    every process-wide stream from ``seed``.  Returns the rank, world size and device."""
    policy(tier)  # a UserError naming the valid tiers
    set_env_before_cuda(tier)
    info = D.init(D.DistConfig(backend=backend))
    apply_tier(DetConfig(tier=tier, threads=threads))
    seed_process(seed, info.rank)
    return info


class GradSync:
    """Canonical gradient sync for any model and optimizer (a DDP replacement whose sums are ordered by dettrain).

    The parameters become views into one flat fp32 buffer (``collectives.CanonicalReducer``); after ``reduce()``
    every ``p.grad`` holds the step's mean gradient, the same bits on every rank."""

    def __init__(self, model: nn.Module, *, accumulate: str = "fold", bucket_mb: float = 25.0) -> None:
        if accumulate not in ACCUMULATE:
            raise UserError(f"accumulate={accumulate!r}: use 'fold' (identical reruns on a fixed world size) or "
                            "'tree' (the same bits on any power-of-two world size)")
        rank, world = (torch.distributed.get_rank(), torch.distributed.get_world_size()) \
            if torch.distributed.is_initialized() else (0, 1)
        if accumulate == "tree" and world & (world - 1):
            raise UserError(f"accumulate='tree' needs a power-of-two world size, got {world} ranks")
        device = next(model.parameters()).device
        self.model, self.rank, self.world = model, rank, world
        self.reducer = CanonicalReducer(model, rank, world, bucket_mb, ACCUMULATE[accumulate], False, device)
        self._count = 0

    def my_micro_batches(self, total: int) -> range:
        """This rank's global micro-batch indices of a step of ``total``: an aligned block of total / world."""
        if total % self.world:
            raise UserError(f"{total} micro-batches per step do not divide over {self.world} ranks")
        per = total // self.world
        if self.reducer.invariant and per & (per - 1):
            raise UserError(f"accumulate='tree' needs a power-of-two number of micro-batches per rank, got {per}")
        self._count = per
        return range(self.rank * per, (self.rank + 1) * per)

    def backward(self, loss: torch.Tensor, k: int, count: int | None = None) -> None:
        """``loss.backward()`` of this rank's k-th micro-batch of ``count`` (default: from my_micro_batches)."""
        n = count or self._count
        if not n:
            raise UserError("GradSync.backward: give count=, or call my_micro_batches(total) first")
        if k == 0:
            self.reducer.begin_step(n)
        self.reducer.begin_micro(k)
        loss.backward()  # buckets launch from the hooks during the last micro-batch's backward
        self.reducer.end_micro(k)
        self._last_count = n

    def reduce(self) -> None:
        """Finish the sync: every p.grad = (sum of the step's micro-batch gradients) / M, in canonical order."""
        M = self._last_count * self.world
        self.reducer.finish(scale=1.0 / M)
        for _, p, o, k in self.reducer.layout.entries:
            p.grad = self.reducer.grad[o : o + k].view_as(p)

    def grad_norm(self) -> float:
        """L2 norm of the reduced gradient, by one split-independent definition (collectives.exact_sumsq)."""
        return self.reducer.grad_norm()

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Scale the gradient by max_norm / (norm + 1e-6) when that is below 1; returns the norm before."""
        norm = self.grad_norm()
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            self.reducer.grad.mul_(coef)
        return norm

    def mean(self, values: list[torch.Tensor]) -> float:
        """Mean of per-micro-batch scalars (this rank's, in order) over the whole step, in canonical order."""
        return float(canonical_mean(torch.stack([v.detach() for v in values]), self.world).item())


class StepLedger:
    """A ``ledger.jsonl`` that ``python -m dettrain.diff`` reads, for your own loop: fingerprints of the model's
    parameters and gradients and of the optimizer's state per step, in the canonical flat layout.

    ``log`` is a collective (every rank calls it, each hashes 1/W of the tensors); rank 0 writes."""

    def __init__(self, path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                 config: dict | None = None, tier: int | None = None) -> None:
        self.model, self.opt = model, optimizer
        self.layout = FlatLayout(model, 1, 25.0)
        self.rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        self.world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        self.info = D.DistInfo(self.rank, self.world, 0, next(model.parameters()).device, None)
        self.writer = None
        if self.rank == 0:
            from dettrain.config import config_hash

            header = {"config": config or {}, "config_hash": config_hash(config or {}), "versions": versions(),
                      "world_size": self.world,
                      "tier": tier, "threads": torch.get_num_threads(), "device": str(self.info.device),
                      "n_params": self.layout.numel, "source": "dettrain.StepLedger",
                      "audit": audit(tier, threads=torch.get_num_threads(), world=self.world) if tier is not None
                      else []}
            self.writer = LedgerWriter(Path(path), header)

    def _parts(self) -> dict[str, list[tuple[torch.Tensor, int]]]:
        N = self.layout.numel
        out: dict[str, list[tuple[torch.Tensor, int]]] = {"grad": [], "param": [], "opt": []}
        for i, (_, p, off, _) in enumerate(self.layout.entries):
            if i % self.world != self.rank:
                continue
            out["param"].append((p.detach().reshape(-1), off))
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            out["grad"].append((g.reshape(-1), off))
            st = self.opt.state.get(p, {}) if self.opt is not None else {}
            tensors = [k for k in sorted(st) if torch.is_tensor(st[k]) and st[k].shape == p.shape]
            for j, k in enumerate(tensors):  # every per-element state tensor, in name order
                out["opt"].append((st[k].reshape(-1), j * N + off))
        return out

    def log(self, step: int, *, loss: float, batch: torch.Tensor | None = None, **extra) -> dict:
        """Write step ``step``: loss (float), the fingerprint of ``batch`` (the step's global token ids, any
        tensor the same on every rank), of parameters, gradients (as ``p.grad`` holds them now: call it after
        ``optimizer.step()`` and before ``zero_grad``) and optimizer state; ``extra`` JSON fields."""
        parts = self._parts()
        names = ("grad", "param", "opt")
        local = [combine(fingerprint_many(parts[k])) for k in names]
        totals = dict(zip(names, sum_u64(local, self.info)))
        rec = {"kind": "step", "step": int(step), "loss": float(loss), "loss_bits": f"{f32_bits(float(loss)):08x}",
               "batch": format_fp(fingerprint(batch.reshape(-1)) if batch is not None else 0),
               **{k: format_fp(v) for k, v in totals.items()}, **extra}
        if self.writer is not None:
            self.writer.write(rec)
        return rec

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def shutdown() -> None:
    """Destroy the process group that ``setup`` started."""
    D.shutdown()


__all__ = ["GradSync", "StepLedger", "setup", "shutdown"]
