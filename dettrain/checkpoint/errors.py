"""The checkpoint errors (raised wherever a checkpoint is read, caught by resume and the command line), and the
one-line description of a failed read that their messages quote."""

from __future__ import annotations

from dettrain.errors import UserError

AFRESH = ("start afresh in another run_dir=..., or here with ckpt.resume=none ckpt.overwrite=true (the old files are "
          "moved aside)")
"""The advice to start over: ckpt.resume=none alone is refused in a run dir that holds a run (record/rundir.py)."""


class CheckpointError(UserError):
    """A checkpoint that cannot be used (damaged, incomplete or incompatible); the message says why and what to do.

    A UserError, so ``python -m dettrain`` prints it as a one-line error and exits 2."""


class CorruptCheckpoint(CheckpointError):
    """Damaged or incomplete: ``ckpt.resume=auto`` falls back to the previous checkpoint."""


def _first_line(e: BaseException) -> str:
    return (str(e).splitlines() or [""])[0][:300]


def _describe(e: BaseException) -> str:
    """One line for an exception; for DCP's CheckpointException, the failures of the ranks it wraps."""
    # imported here: torch.distributed.checkpoint pulls in DTensor (~0.7 s), which a run that reads no checkpoint
    # never needs (every test and training process pays the start-up)
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(e, CheckpointException) and e.failures:
        return "; ".join(f"rank {r}: {type(x).__name__}: {_first_line(x)}" for r, (x, _) in sorted(e.failures.items()))
    return f"{type(e).__name__}: {_first_line(e)}"
