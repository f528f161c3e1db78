"""The ledger's step line, built while the step runs: each fingerprint is taken where its tensor holds the value the
line records, and everything is read back in the step's one host sync at the end.

``Trainer.train_step`` hands the pieces over as the step reaches them::

    rec = StepRecorder(engine, info, step, per_tensor=..., micro_batch=m, seq_len=T)
    rec.batch(tokens, index)    # each micro-batch's tokens where they are used (on CUDA: queued on the device)
    rec.grad()                  # the reduced gradient, before clipping: what every rank agreed on
    rec.param_opt()             # parameters and optimizer state after the update
    rec.line(loss, lr, gnorm)   # the one host sync: fingerprints combined over ranks, the loss -> the step line

``grad`` and ``param_opt`` take this rank's partials only (no communication); ``line`` combines them with the batch
fingerprint over ranks in one gather (``record.fingerprint.combine_over_ranks``).  A fingerprint is a sum mod 2^64
over (element bits, global element index), so shards, buckets and micro-batches hashed apart add up to the value of
the whole tensor on any world size.  The named ranges (``dettrain.fp_grad``, ``dettrain.fp_param_opt``,
``dettrain.combine``) are the ones ``dettrain.trace`` leaves out of its phases.
"""

from __future__ import annotations

import contextlib
import os

import torch

from dettrain import dist as D
from dettrain.record import schema
from dettrain.record.fingerprint import combine_over_ranks, fingerprint_many_deferred
from dettrain.sync.engines import Engine, Partials

_phase = torch.profiler.record_function  # a named range in torch.profiler traces, ~1 us when no profiler runs


class StepRecorder:
    """Collects one optimizer step's fingerprints and turns them into its ledger line (see the module docstring)."""

    def __init__(self, engine: Engine, info: D.DistInfo, step: int, *, per_tensor: bool, micro_batch: int,
                 seq_len: int) -> None:
        self.engine, self.info, self.step, self.per_tensor = engine, info, step, per_tensor
        # the global batch fingerprint: element (sample j of micro-batch i, token t) has index (i*m+j)*(T+1)+t, so
        # micro-batch i starts at i*m*(T+1) whichever rank runs it
        self._stride = micro_batch * (seq_len + 1)
        self._batch: list[tuple[torch.Tensor, int]] = []
        self._grad: Partials | None = None
        self._param_opt: Partials | None = None
        self._stream: torch.cuda.Stream | None = None  # the side stream of the parameter/optimizer hashes, if any

    def batch(self, tokens: torch.Tensor, index: int) -> None:
        """Micro-batch ``index`` (global) of the step: its tokens on the device, hashed at ``line``."""
        self._batch.append((tokens, index * self._stride))

    def grad(self) -> None:
        """The reduced gradient, before clipping (what every rank agreed on); local partials, no communication."""
        with _phase("dettrain.fp_grad"):
            self._grad = self.engine.partials(schema.from_source("reduced"), self.per_tensor)

    def param_opt(self) -> None:
        """Parameters and optimizer state after the update; local partials, no communication.

        With ``DETTRAIN_FP_STREAM=1`` on CUDA (an experiment, off by default) these hashes and the reads of ``line``
        go to a side stream that waits for the step's work, so they can run beside the next step's first
        micro-batch (train.overlap_steps) instead of before it.  The next update of what they read is queued only
        after ``line`` has synchronised with that stream, so no extra wait is needed on the main stream."""
        with _phase("dettrain.fp_param_opt"):
            self._stream = _side_stream(self.info.device)
            with _on(self._stream):
                self._param_opt = self.engine.partials(schema.from_source("updated"), self.per_tensor)

    def line(self, loss: torch.Tensor, lr: float, grad_norm: float | torch.Tensor) -> dict:
        """The step line: ``loss`` (the agreed mean, still on the device), every fingerprint combined over ranks
        (a collective), per-tensor ones under ``tensors`` when asked.  The step's one host sync."""
        assert self._grad is not None and self._param_opt is not None, "grad() and param_opt() come first"
        with _phase("dettrain.combine"), _on(self._stream):
            (key,) = schema.from_source("tokens")
            batch = Partials({key: 0}, {}, [(fingerprint_many_deferred(self._batch),
                                             [(key, None)] * len(self._batch))])
            totals, tensors = combine_over_ranks(self._grad.merged(self._param_opt).merged(batch), self.per_tensor,
                                                 self.info)
            lossf = float(loss.item())
            grad_norm = float(grad_norm)  # the engine's norm, read with the rest (a device tensor until here)
        # the fingerprint fields as record/schema.py declares them, in its order
        rec = schema.step_line(self.step, lossf, totals, {"lr": lr, "grad_norm": grad_norm})
        if self.per_tensor:
            rec["tensors"] = tensors
        return rec


_SIDE: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream | None:
    """The side stream of the parameter/optimizer hashes (``DETTRAIN_FP_STREAM=1`` on CUDA), made to wait for
    everything queued so far on the current stream; None otherwise."""
    if os.environ.get("DETTRAIN_FP_STREAM", "") != "1" or torch.device(device).type != "cuda":
        return None
    device = torch.device(device)
    if device not in _SIDE:
        _SIDE[device] = torch.cuda.Stream(device=device)
    side = _SIDE[device]
    side.wait_stream(torch.cuda.current_stream(device))
    return side


def _on(stream: torch.cuda.Stream | None):
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
