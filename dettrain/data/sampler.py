"""The global sample order and the resumable step sampler, and the validation set.

Samples are non-overlapping windows of ``seq_len + 1`` tokens (stride ``seq_len``) over one token array.  The
global sample order of epoch e is a permutation drawn from ``derive_seed(seed, "data", e)``: a function of
(seed, epoch) only, never of world size.  Step s consumes the next ``global_batch`` samples of that order; they are
cut into micro-batches of ``micro_batch`` samples with global indices 0..M-1, and rank r of W takes the aligned block
[r*M/W, (r+1)*M/W).  An epoch ends when fewer than ``global_batch`` samples remain (the rest is dropped).  The
sampler's state is (epoch, position) and resumes exactly mid-epoch.

Held-out split (``eval.*``): ``data.val_fraction`` keeps the last fraction of the samples out of training (the
training dataset is samples 0..n_train-1, so the sampler never draws a held-out id), or ``data.val_path`` is a
separate token file.  The validation set is the first ``eval.batches x train.micro_batch`` held-out samples in
order, cut into micro-batches with global indices 0..eval.batches-1 and dealt to ranks as a step's micro-batches are
(``micro_indices``): the same samples every evaluation, on any world size.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from dettrain.data.tokens import DataConfig, check_same_format, load_tokens
from dettrain.determinism import derive_seed
from dettrain.errors import UserError


class SampleDataset(torch.utils.data.Dataset):
    """Sample i = tokens[j*T : j*T + T + 1] as int64 with j = first + i (the window index in the token array);
    indexed by a list of sample ids (one micro-batch).  ``first``/``count`` select a contiguous range of windows
    (a training or held-out split); by default every window."""

    def __init__(self, tokens: np.ndarray, seq_len: int, first: int = 0, count: int | None = None) -> None:
        self.tokens, self.seq_len, self.first = tokens, seq_len, first
        total = (len(tokens) - 1) // seq_len
        self.n = total - first if count is None else min(count, total - first)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, ids: list[int]) -> torch.Tensor:
        T, f = self.seq_len, self.first
        rows = [np.asarray(self.tokens[(f + i) * T : (f + i) * T + T + 1], dtype=np.int64) for i in ids]
        return torch.from_numpy(np.stack(rows))


def split_samples(cfg: DataConfig, tokens: np.ndarray, seq_len: int) -> tuple[SampleDataset, SampleDataset | None]:
    """(training samples, held-out samples; None without a split) of ``tokens`` (the array of data.path) under
    data.val_fraction or data.val_path.  With val_fraction f the last floor(n*f) windows are held out; the one
    token the last training window and the first held-out window share is a training target and a held-out
    *input*, so no held-out target is ever trained on."""
    full = SampleDataset(tokens, seq_len)
    if cfg.val_path is not None:
        check_same_format(cfg)
        return full, SampleDataset(load_tokens(cfg, "val_path"), seq_len)
    if not cfg.val_fraction > 0:
        return full, None
    n_val = int(full.n * cfg.val_fraction)  # may be 0 for a tiny file: ValidationSet then says so
    n_train = full.n - n_val
    return SampleDataset(tokens, seq_len, 0, n_train), SampleDataset(tokens, seq_len, n_train, n_val)


def micro_indices(n_micro: int, rank: int, world: int, assignment: str = "block") -> range:
    """Global micro-batch indices 0..n_micro-1 that rank ``rank`` of ``world`` runs: an aligned block
    [rank*n/W, (rank+1)*n/W) (flat and DDP engines), or round-robin rank, rank+W, ... (FSDP2 at tier 4: round k is
    micro-batches kW..kW+W-1, an aligned block of the micro-batch tree)."""
    if assignment == "round_robin":
        return range(rank, n_micro, world)
    per = n_micro // world
    return range(rank * per, (rank + 1) * per)


def epoch_order(seed: int, epoch: int, n_samples: int) -> np.ndarray:
    """The global sample order of one epoch: a pure function of (seed, epoch, dataset size)."""
    return np.random.Generator(np.random.PCG64(derive_seed(seed, "data", epoch))).permutation(n_samples)


@dataclass


class MicroBatch:
    index: int  # global micro-batch index within the step, 0..M-1
    tokens: torch.Tensor  # (micro_batch, seq_len + 1) int64; a user Dataset's collated items (dettrain.sampler)

    @property
    def batch(self):
        """The micro-batch's data under a name that fits any dataset (the same object as ``tokens``)."""
        return self.tokens


class StepSampler:
    """Yields, per optimizer step, this rank's micro-batches; state (epoch, position) resumes exactly."""

    def __init__(self, dataset: SampleDataset, seed: int, global_batch: int, micro_batch: int,
                 rank: int = 0, world: int = 1, num_workers: int = 0, assignment: str = "block") -> None:
        if dataset.n < global_batch:
            raise UserError(f"the data has {dataset.n} samples of seq_len+1 tokens, fewer than "
                             f"train.global_batch={global_batch}; use more data or a smaller batch")
        self.ds, self.seed, self.G, self.m = dataset, seed, global_batch, micro_batch
        self.M = global_batch // micro_batch
        self.rank, self.world, self.num_workers = rank, world, num_workers
        self.assignment = assignment  # "block" or "round_robin" (see micro_indices)
        self.epoch, self.position = 0, 0
        self._order: tuple[int, np.ndarray] | None = None

    # ---- state -------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])

    # ---- plan --------------------------------------------------------------------------------------------
    def _perm(self, epoch: int) -> np.ndarray:
        if self._order is None or self._order[0] != epoch:
            self._order = (epoch, epoch_order(self.seed, epoch, self.ds.n))
        return self._order[1]

    def _advance(self, epoch: int, pos: int) -> tuple[int, int]:
        pos += self.G
        if pos + self.G > self.ds.n:
            return epoch + 1, 0
        return epoch, pos

    def global_step_ids(self, epoch: int, position: int) -> np.ndarray:
        """Sample ids of the whole global batch at (epoch, position), shape (M, micro_batch)."""
        return self._perm(epoch)[position : position + self.G].reshape(self.M, self.m)

    def micro_indices(self, rank: int) -> range:
        """Global micro-batch indices rank ``rank`` runs each step (module-level ``micro_indices``: a block, or
        round-robin for FSDP2 at tier 4).  Which sample is in which micro-batch never depends on this."""
        return micro_indices(self.M, rank, self.world, self.assignment)

    def local_micro_indices(self) -> range:
        return self.micro_indices(self.rank)

    def gathered_order(self) -> list[int]:
        """Global index of each position of an all_gather of every rank's per-micro-batch values (rank-major)."""
        return [j for r in range(self.world) for j in self.micro_indices(r)]

    def _plan(self) -> Iterator[list[int]]:
        epoch, pos = self.epoch, self.position
        while True:
            ids = self.global_step_ids(epoch, pos)
            for j in self.local_micro_indices():
                yield [int(i) for i in ids[j]]
            epoch, pos = self._advance(epoch, pos)

    def __iter__(self) -> Iterator[list[MicroBatch]]:
        loader = torch.utils.data.DataLoader(
            self.ds, batch_size=None, sampler=self._plan(), num_workers=self.num_workers,
            worker_init_fn=_WorkerInit(self.seed, self.rank) if self.num_workers else None,
            generator=torch.Generator().manual_seed(derive_seed(self.seed, "loader", self.rank)),
        )
        it = iter(loader)
        local = self.local_micro_indices()
        while True:
            micro = [MicroBatch(j, next(it)) for j in local]
            # state counts what the trainer consumed, not what workers prefetched
            self.epoch, self.position = self._advance(self.epoch, self.position)
            yield micro


class ValidationSet:
    """The fixed validation micro-batches: micro-batch i (global index 0..n_batches-1) is held-out samples
    [i*m, (i+1)*m), the same every evaluation and on any world size; this rank evaluates the indices the engine's
    ``assignment`` deals it, and ``order`` is the global index of each position of an all_gather of the ranks'
    per-micro-batch values (rank-major), for ``collectives.canonical_mean``."""

    def __init__(self, dataset: SampleDataset, n_batches: int, micro_batch: int, rank: int = 0, world: int = 1,
                 assignment: str = "block", source: str = "data.val_fraction") -> None:
        need = n_batches * micro_batch
        if dataset.n < need:
            raise UserError(f"the held-out split ({source}) has {dataset.n} samples of seq_len+1 tokens, fewer than "
                            f"eval.batches x train.micro_batch = {n_batches} x {micro_batch} = {need}; raise "
                            f"{source} or lower eval.batches")
        self.ds, self.m = dataset, micro_batch
        self.local = micro_indices(n_batches, rank, world, assignment)
        self.order = [j for r in range(world) for j in micro_indices(n_batches, r, world, assignment)]

    def sample_ids(self, index: int) -> list[int]:
        return list(range(index * self.m, (index + 1) * self.m))

    def local_batches(self) -> Iterator[MicroBatch]:
        for j in self.local:
            yield MicroBatch(j, self.ds[self.sample_ids(j)])


class _WorkerInit:
    """Seeds a DataLoader worker from the derivation (purpose 'worker', keyed by rank and worker id)."""

    def __init__(self, seed: int, rank: int) -> None:
        self.seed, self.rank = seed, rank

    def __call__(self, worker_id: int) -> None:
        import random

        s = derive_seed(self.seed, "worker", self.rank, worker_id)
        random.seed(s)
        np.random.seed(s % (1 << 32))
        torch.manual_seed(s)
