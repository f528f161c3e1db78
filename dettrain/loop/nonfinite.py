"""Stop a run at the first non-finite loss or gradient norm.

Both values are agreed across ranks before they are logged (the loss is the canonical mean over ranks; the gradient
norm is computed on the reduced gradient, canonically at tiers 3-4), so every rank takes the same decision at the
same step without an extra collective.  The step line is written first, then an event
``{"kind": "event", "event": "non_finite", ...}``; the ledger is closed and every rank exits with
``EXIT_NON_FINITE`` (4).  Training on would only write NaN fingerprints: once a parameter is NaN every later step is.
"""

from __future__ import annotations

import math
from typing import Any

EXIT_NON_FINITE = 4
"""Exit status of `python -m dettrain` stopped by a non-finite loss or gradient norm."""


class NonFiniteStop(RuntimeError):
    """Raised on every rank at the step whose loss or gradient norm is not finite."""

    def __init__(self, message: str, event: dict) -> None:
        super().__init__(message)
        self.event = event
        self.exit_code = EXIT_NON_FINITE


def check_step(rec: dict, cfg: Any) -> NonFiniteStop | None:
    """A NonFiniteStop for step line ``rec`` if its loss or gradient norm is nan/inf, else None."""
    loss, gnorm = rec.get("loss"), rec.get("grad_norm")
    bad = {k: v for k, v in (("loss", loss), ("grad_norm", gnorm))
           if v is not None and not math.isfinite(float(v))}
    if not bad:
        return None
    step = rec["step"]
    what = " and ".join(f"{'gradient norm' if k == 'grad_norm' else k} {v}" for k, v in bad.items())
    o = cfg.optim
    message = (f"non-finite {what} at step {step}; every rank stopped there (the ledger holds the step line and a "
               f"non_finite event). Usual suspects: train.lr={cfg.train.lr} (too high: the update overflows), "
               f"optim.eps={o.eps} (too small), optim.clip_grad_norm={o.clip_grad_norm} (0 disables clipping); "
               "then the data and the model init. Lower the learning rate and start afresh, or resume from an "
               "earlier checkpoint with ckpt.resume=PATH")
    event = {"kind": "event", "event": "non_finite", "step": step, **{k: repr(v) for k, v in bad.items()},
             "exit_code": EXIT_NON_FINITE}
    return NonFiniteStop(message, event)
