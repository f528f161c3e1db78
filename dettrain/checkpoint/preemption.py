"""Stopping on a signal and being started again.

``PreemptionGuard``: SIGUSR1, SIGTERM or SIGINT (a first Ctrl-C; a second aborts, dettrain/loop/interrupt.py) on any
rank sets a flag; after every step the ranks agree on it (one
all_reduce MAX of a single integer), so they all checkpoint at the same step and exit with ``REQUEUE_EXIT_CODE``
(75, EX_TEMPFAIL in sysexits.h).  ``restart_hazard``: the torchrun setting under which a restarted attempt can fail
to reconnect, warned about at resume.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

import torch
import torch.distributed as dist

from dettrain import dist as D
from dettrain.loop.interrupt import on_sigint

REQUEUE_EXIT_CODE = 75
"""Exit status of a run that stopped on SIGUSR1/SIGTERM/SIGINT after writing a checkpoint: requeue it with
ckpt.resume=auto and it continues the same ledger.  (sysexits.h EX_TEMPFAIL.)"""
PREEMPT_SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)


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

    def agreed(self, info: D.DistInfo) -> int:
        """The signal any rank has received (0: none); a collective, called by every rank after every step."""
        if info.world == 1:
            return self.signum
        t = torch.tensor([self.signum], dtype=torch.int64, device=info.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # integer max: exact, one tiny collective per step
        return int(t.item())


def restart_hazard() -> str | None:
    """A warning when torchrun will restart workers through its shared rendezvous store, whose keys outlive an
    attempt: the restarted workers can read the dead attempt's addresses and fail to connect (pytorch#135712)."""
    if int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0) > 0 and \
            os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return ("torchrun --max-restarts>0 shares its rendezvous store with the workers, and a restarted attempt may "
                "read the failed attempt's addresses and fail to connect (pytorch#135712); export "
                "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 before torchrun")
    return None
