"""Live reference check (``det.reference``): compare every step with an earlier run's ledger as it happens.

Rank 0 reads the reference ledger at start-up and compares each new step line with the reference's line of the same
step (fingerprints batch -> loss_bits -> grad -> param -> opt, as ``dettrain.diff`` does).  While the check is
active (no divergence yet and the reference has the step) rank 0 broadcasts its verdict every step, so every rank
learns of a divergence at the same step; that is the check's only extra sync, and it exists only when det.reference
is set.  While active, the trainer computes per-tensor fingerprints every step (the pre-clip gradients are gone once
the step is over) and this check drops them again from ledger lines that do not need them.

At the first mismatch, in ``<run_dir>/divergence/step_<k>/``:
  summary.json      which fingerprints differ and which came first, loss and its ULP distance, lr, tensor names that
                    differ (when the reference has per-tensor fingerprints at that step), config differences
  tensors.json      this run's and the reference's per-tensor fingerprints at that step
  batch_rank<r>.pt  each rank's micro-batches of that step: {"step", "rank", "world", "micro_indices", "tokens"
                    (L, micro_batch, seq_len + 1) int64}
and the ledger gets the step line with its per-tensor fingerprints plus an event line ``{"kind": "event",
"event": "divergence", ...}``.  With ``det.on_divergence=stop`` every rank then stops: the ledger is closed, all ranks
pass a barrier (torchrun kills the others as soon as one exits, so nobody exits before rank 0 has written
everything) and raise ``DivergenceStop``; ``python -m dettrain`` exits with status 3.  With ``warn`` the run goes on
and later steps are still compared on rank 0 (the wandb ``ref/match`` flag and ``ref/loss_ulps`` distance) without
per-tensor work or syncs.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dettrain import dist as D
from dettrain.errors import UserError
from dettrain.record import schema
from dettrain.record.ledger import config_differences, differing_fields, read_ledger, tensor_diff, ulps

log = logging.getLogger("dettrain")

EXIT_DIVERGED = 3  # exit status of `python -m dettrain` stopped by det.on_divergence=stop


class DivergenceStop(RuntimeError):
    """Raised on every rank when the live check stops the run (det.on_divergence=stop)."""

    exit_code = EXIT_DIVERGED


@dataclass
class Verdict:
    match: bool | None  # rank 0: this step equals the reference's (None: nothing to compare); other ranks: None
    loss_ulps: int | None = None  # rank 0: |loss - reference loss| in fp32 ULPs (None: nothing to compare, NaN)
    event: dict | None = None  # the ledger event line at the first divergence (rank 0)
    stop: bool = False  # every rank: stop now (det.on_divergence=stop at the first divergence)
    message: str = ""


class LiveCheck:
    def __init__(self, cfg: Any, info: D.DistInfo, run_dir: Path, cfg_dict: dict) -> None:
        self.cfg, self.info, self.run_dir = cfg, info, Path(run_dir)
        self.path = str(cfg.det.reference)
        self.stop_on_divergence = cfg.det.on_divergence == "stop"
        self.ref: dict[int, dict] = {}  # rank 0 only
        self.ref_header: dict = {}
        payload: tuple[str, Any] = ("ok", [])
        if info.is_main:
            try:
                self.ref_header, steps = read_ledger(self.path)
                self.ref = {s["step"]: s for s in steps}
                payload = ("ok", sorted(self.ref))
            except ValueError as e:
                payload = ("error", str(e))
        # every rank must agree on the reference (a failure on rank 0 alone would leave the others hanging)
        payload = D.broadcast_object(payload, info)
        if payload[0] == "error":
            raise UserError(f"det.reference={self.path!r}: {payload[1]}")
        self.ref_steps: set[int] = set(payload[1])
        self.active = True  # identical so far: per-tensor fingerprints every step, verdict broadcast every step
        self.diverged_at: int | None = None
        self._told_end = False
        self.config_diffs = config_differences(self.ref_header, {"config": cfg_dict}) if info.is_main else []
        if info.is_main:
            span = f"steps {min(self.ref_steps)}..{max(self.ref_steps)}" if self.ref_steps else "no steps"
            log.info(f"live check against {self.path} ({span}), on divergence: {cfg.det.on_divergence}")
            for k, a, b in self.config_diffs:
                if k not in ("det.reference", "det.on_divergence"):
                    log.info(f"  config differs from the reference: {k}: {a!r} -> {b!r}")

    def needs_tensors(self, step: int) -> bool:
        """Whether the trainer must compute per-tensor fingerprints at ``step`` (the same answer on every rank)."""
        return self.active and step in self.ref_steps

    def check(self, rec: dict, micro: list) -> Verdict:
        """Compare this step's line (rank 0) and act on a divergence (every rank).  Call on every rank, after the
        step and before the ledger write: it drops per-tensor fingerprints the ledger does not need."""
        step = rec["step"]
        ref = self.ref.get(step)
        fields = differing_fields(ref, rec) if ref is not None else None  # rank 0 only: the others have no ref
        if self.info.is_main and ref is None and self.ref_steps and not self._told_end:
            self._told_end = True
            log.info(f"live check: the reference has no step {step}; nothing to compare from here on")
        lulps = ulps(ref.get("loss_bits"), rec.get("loss_bits")) if ref is not None else None
        verdict = Verdict(match=None if fields is None else not fields, loss_ulps=lulps)
        if self.active and step in self.ref_steps:
            fields = D.broadcast_object(fields, self.info)  # one verdict, reached at the same step on every rank
            if fields:
                self.active, self.diverged_at = False, step
                verdict = self._diverged(rec, ref, fields, micro)
        every = self.cfg.log.tensor_every
        if self.diverged_at != step and not (every > 0 and step % every == 0):
            rec.pop("tensors", None)  # computed for the check only
        return verdict

    def _diverged(self, rec: dict, ref: dict | None, fields: list[str], micro: list) -> Verdict:
        step, info = rec["step"], self.info
        out = self.run_dir / "divergence" / f"step_{step:06d}"
        out.mkdir(parents=True, exist_ok=True)
        torch.save({"step": step, "rank": info.rank, "world": info.world,
                    "micro_indices": [mb.index for mb in micro],
                    "tokens": torch.stack([mb.tokens for mb in micro]) if micro else torch.empty(0)},
                   out / f"batch_rank{info.rank}.pt")
        stop = self.stop_on_divergence
        msg = (f"live check: step {step} diverged from the reference {self.path}"
               + (" (det.on_divergence=stop: all ranks stop)" if stop else " (det.on_divergence=warn: continuing)")
               + f"; details in {out}")
        if not info.is_main:
            return Verdict(match=None, stop=stop, message=msg)
        assert ref is not None
        tdiff = tensor_diff(ref, rec)
        stages = schema.stage_names()
        summary = {
            "step": step, "reference": self.path, "fields": fields, "first": fields[0],
            "first_stage": stages[fields[0]], "loss": rec.get("loss"), "reference_loss": ref.get("loss"),
            "loss_ulps": ulps(ref.get("loss_bits"), rec.get("loss_bits")), "lr": rec.get("lr"),
            "reference_lr": ref.get("lr"), "tensors_differing": tdiff,
            "fingerprints": {f: {"run": rec.get(f), "reference": ref.get(f)} for f in stages},
            "config_differences": self.config_diffs,
        }
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
        (out / "tensors.json").write_text(json.dumps({"step": step, "run": rec.get("tensors"),
                                                      "reference": ref.get("tensors")}, indent=1))
        lines = [f"live check: DIVERGED at step {step} from {self.path}: {stages[fields[0]]} first "
                 f"(differing: {', '.join(stages[f] for f in fields)}); loss {ref.get('loss')!r} -> "
                 f"{rec.get('loss')!r} ({summary['loss_ulps']} ULPs)"]
        if tdiff is not None:
            lines += [f"  {kind} tensors that differ ({len(names)}): {', '.join(names[:8]) or 'none'}"
                      + (" ..." if len(names) > 8 else "") for kind, names in tdiff.items()]
        else:
            lines.append("  (the reference has no per-tensor fingerprints at this step; this run's are in "
                         "tensors.json: rerun the reference with log.tensor_every=1 to name tensors)")
        lines.append(f"  batch, fingerprints and summary written to {out}")
        log.warning("\n".join(lines))
        event = {"kind": "event", "event": "divergence", "step": step, "reference": self.path, "first": fields[0],
                 "fields": fields, "dir": str(out)}
        if tdiff is not None:
            event["tensors"] = tdiff
        return Verdict(match=False, loss_ulps=summary["loss_ulps"], event=event, stop=stop, message=msg)
