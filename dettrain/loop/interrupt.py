"""Ctrl-C (SIGINT): the first is a preemption request like SIGTERM, a second one aborts at once.

A terminal's Ctrl-C reaches every process of the foreground group, and torchrun forwards the SIGINT it got to its
workers as well, so one key press can arrive twice within milliseconds: a SIGINT within ``SAME_PRESS_S`` of the
first counts as the same request.  A later one aborts: the default action of SIGINT is restored and the signal
re-sent, so the process ends by it (exit status 130 in a shell) even if it is blocked in a collective or a save.
Nothing is lost that the first request would have kept: checkpoints are renamed into place only when complete and
the ledger is written line by line (its readers skip a torn last line).  Torch-free: the early flag
(rundir.install_early_signal_flag) uses it before torch is imported.
"""

from __future__ import annotations

import os
import signal
import sys
import time

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
