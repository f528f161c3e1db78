"""Being stopped and started again: the preemption guard and the requeue exit code (dettrain/signals.py, re-exported
here for the checkpoint package's callers), and ``restart_hazard``, the torchrun setting under which a restarted
attempt can fail to reconnect, warned about at resume.
"""

from __future__ import annotations

import os

from dettrain.signals import PREEMPT_SIGNALS, REQUEUE_EXIT_CODE, PreemptionGuard

__all__ = ["PREEMPT_SIGNALS", "REQUEUE_EXIT_CODE", "PreemptionGuard", "restart_hazard"]


def restart_hazard() -> str | None:
    """A warning when torchrun will restart workers through its shared rendezvous store, whose keys outlive an
    attempt: the restarted workers can read the dead attempt's addresses and fail to connect (pytorch#135712)."""
    if int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0) > 0 and \
            os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return ("torchrun --max-restarts>0 shares its rendezvous store with the workers, and a restarted attempt may "
                "read the failed attempt's addresses and fail to connect (pytorch#135712); export "
                "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 before torchrun")
    return None
