"""Checkpoints that resume bit for bit, preemption handling, and the requeue exit code (dettrain/checkpoint/state.py;
split by concern in the next commit)."""

from dettrain.checkpoint.state import (  # noqa: F401
    CKPT_DIR,
    META_NAME,
    REQUEUE_EXIT_CODE,
    CheckpointError,
    CorruptCheckpoint,
    PreemptionGuard,
    _body_sha,
    _plan_flat,
    _read_meta,
    _reader,
    _safe_metadata,
    _single_process_ok,
    ckpt_dir,
    list_checkpoints,
    main,
    record_header_changes,
    resume,
    save,
)
