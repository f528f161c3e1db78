"""Signals that stop a run: SIGUSR1, SIGTERM and a first Ctrl-C are a preemption request, a second Ctrl-C aborts.

Three moments, one meaning:

- **Before torch is imported.**  ``install_early_signal_flag`` (the first thing ``python -m dettrain`` does) turns
  the three signals into a flag; ``early_signal`` hands it to the guard, so a signal during start-up is honoured
  like a later one (checkpoint after the first step, exit 75), never a half-made run dir.
- **During the run.**  ``PreemptionGuard`` sets a flag instead of dying; after every step the ranks agree on it
  (``agreed``: one all_reduce MAX of a single integer), so they all checkpoint at the same step and exit with
  ``REQUEUE_EXIT_CODE`` (75, EX_TEMPFAIL in sysexits.h).
- **Ctrl-C twice** (``on_sigint``, called by both handlers).  A terminal's Ctrl-C reaches every process of the
  foreground group and torchrun forwards the SIGINT it got, so one key press can arrive twice within milliseconds:
  a SIGINT within ``SAME_PRESS_S`` of the first is the same request.  A later one aborts: SIGINT's default action
  is restored and the signal re-sent, so the process ends by it (130 in a shell) even inside a collective or a
  save.  Nothing is lost that the first request would have kept: checkpoints are renamed into place only when
  complete and the ledger is written line by line.

Torch-free on import (the early flag runs before torch loads); ``agreed`` imports torch when it runs.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dettrain.dist import DistInfo

__all__ = ["PREEMPT_SIGNALS", "REQUEUE_EXIT_CODE", "SAME_PRESS_S", "PreemptionGuard", "early_signal",
           "install_early_signal_flag", "on_sigint"]

REQUEUE_EXIT_CODE = 75
"""Exit status of a run that stopped on SIGUSR1/SIGTERM/SIGINT after writing a checkpoint: requeue it with
ckpt.resume=auto and it continues the same ledger.  (sysexits.h EX_TEMPFAIL.)"""
PREEMPT_SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)
SAME_PRESS_S = 1.0
"""A second SIGINT sooner than this after the first is the same key press (the copy torchrun forwards)."""

_first: float | None = None


def on_sigint() -> None:
    """Called by every SIGINT handler of dettrain: returns for the first request, aborts the process for a second."""
    global _first
    now = time.monotonic()
    if _first is None:
        _first = now
        try:
            sys.stderr.write("dettrain: Ctrl-C: checkpoint after the current step, then exit 75 (resume with "
                             "ckpt.resume=auto); Ctrl-C again to abort at once\n")
            sys.stderr.flush()
        except (OSError, ValueError):  # no stderr to tell: the request stands all the same
            pass
        return
    if now - _first < SAME_PRESS_S:
        return
    try:
        sys.stderr.write("dettrain: second Ctrl-C: aborting now (no checkpoint of the steps since the last one)\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGINT)


# ---- before the guard exists ----------------------------------------------------------------------------------
_early: list[int] = []


def _early_handler(signum: int, frame) -> None:  # noqa: ARG001 - signal handler signature
    if signum == signal.SIGINT:
        on_sigint()  # a second Ctrl-C does not return
    _early.append(signum)


def install_early_signal_flag() -> None:
    """SIGUSR1/SIGTERM/SIGINT only set a flag from here on (until the preemption guard takes over in the
    trainer's ``run``)."""
    for s in PREEMPT_SIGNALS:
        try:
            signal.signal(s, _early_handler)
        except ValueError:  # not the main thread: nothing to install
            return


def early_signal() -> int:
    """The first SIGUSR1/SIGTERM/SIGINT received before the preemption guard existed (0: none)."""
    return _early[0] if _early else 0


# ---- during the run -----------------------------------------------------------------------------------------
class PreemptionGuard:
    """SIGUSR1/SIGTERM/SIGINT set a flag instead of killing the process; ``agreed()`` turns it into a decision that
    every rank takes at the same step."""

    def __init__(self) -> None:
        self.signum = 0
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread (e.g. a test harness thread)
        for s in PREEMPT_SIGNALS:
            self._previous[s] = signal.signal(s, self._handle)

    def _handle(self, signum: int, frame) -> None:  # noqa: ARG002 - signal handler signature
        # only a flag: the step in flight finishes, then every rank checkpoints at the same step
        if signum == signal.SIGINT:
            on_sigint()  # a second Ctrl-C aborts here and does not return
        self.signum = signum

    def restore(self) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous.clear()

    def agreed(self, info: DistInfo) -> int:
        """The signal any rank has received (0: none); a collective, called by every rank after every step."""
        if info.world == 1:
            return self.signum
        import torch
        import torch.distributed as dist

        t = torch.tensor([self.signum], dtype=torch.int64, device=info.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # integer max: exact, one tiny collective per step
        return int(t.item())
