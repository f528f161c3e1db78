"""Checkpoints that resume bit for bit, preemption handling, and the requeue exit code.

A checkpoint is a directory ``<run_dir>/checkpoints/step_XXXXXXXX/`` holding the state *after* XXXXXXXX optimizer
steps (the next step to run is XXXXXXXX):

    .metadata, __<rank>_0.distcp   torch.distributed.checkpoint (DCP) files: every tensor of the model and optimizer
    rng/rank_XXXXX.json            every RNG stream of one rank (python, numpy, torch CPU, CUDA), as JSON
    buffers/rank_XXXXX.pt          one rank's persistent model buffers (BatchNorm statistics), models with any
    dettrain.json                  written last: step, config and its hash, world size, tier, sampler state,
                                   optimizer scalars, fingerprints of the saved tensors, size and sha256 of
                                   every file (each data file hashed by the rank that wrote it)

**Atomic.**  Everything is written into ``step_XXXXXXXX.tmp/``; after every rank has finished, rank 0 writes
``dettrain.json``, fsyncs it and renames the directory.  A directory without ``.tmp`` is complete or was damaged
afterwards; a crash mid-save leaves only a ``.tmp`` directory, which nothing reads.

**By name, sharded and world-size free.**  Every engine saves one global tensor per name, as torchtitan does:
``model/<name>`` (the parameter) and ``optim/<name>/exp_avg``, ``optim/<name>/exp_avg_sq``, so plain DCP
(``dcp.load``, ``dcp_to_torch_save``) reads a checkpoint without dettrain.  The flat engine (tiers 3-4) holds them
as one flat buffer cut into bucket shards anywhere; each rank saves the parts of each name inside its own shards as
rectangular chunks of the global tensor (chunks.py), so a sharded optimizer is saved by the ranks that hold it and
writes are spread over ranks otherwise.  Loading reads, on each rank, the chunks of the regions it needs, straight
into its buffers; DCP reshards, so a checkpoint saved on 2 ranks resumes on 1 or 4.  FSDP2 saves its DTensors
(DCP reshards them too); DDP + torch AdamW (tiers 0-2) each tensor once, with AdamW's ``step``.  Checkpoints of the
earlier flat format (pieces ``flat/<buffer>/<lo>-<hi>`` of the logical content) still load.

**Integrity.**  ``dettrain.json`` carries a sha256 of itself, the size and sha256 of every file (a rank hashes
the data files it wrote, so the cost is spread), and the fingerprints (record/fingerprint.py) of the parameters and
optimizer state -- the same values as the ledger's ``param``/``opt`` for the step before.  Its schema is checked
field by field (a field removed or of the wrong type, even with the hash recomputed, is a damaged checkpoint, never
a KeyError).  A resume checks sizes and the small files' hashes, loads the tensors (any failure of DCP's reader,
including its ``CheckpointException``, which is a BaseException, means damage), then recomputes the fingerprints
from the loaded tensors, which must match.  ``list`` and ``status`` hash every file.  A damaged checkpoint
(``CorruptCheckpoint``) named by path is refused (exit 2); with ``ckpt.resume=auto`` the run falls back to the
previous good one (the damaged one is renamed ``*.corrupt``).

**Nothing arbitrary is unpickled.**  Tensors come back through DCP's ``torch.load(weights_only=True)``; DCP's own
``.metadata`` file is a pickle, read here by an unpickler that admits only DCP's metadata classes, ``torch.Size``,
dtypes and layouts; only tensor entries are ever requested; everything else is JSON.

**Preemption.**  SIGUSR1 or SIGTERM on any rank sets a flag; after every step the ranks agree on it (one all_reduce
MAX of a single integer), checkpoint, write a ``preempted`` event to the ledger and exit with ``REQUEUE_EXIT_CODE``
(75, EX_TEMPFAIL in sysexits.h: "temporary failure, retry").  torchrun forwards SIGTERM to its workers; it reports
its own failure as exit status 1, so launchers that run torchrun ask ``python -m dettrain.checkpoint status RUN_DIR``
(exit 0: complete; 75: resumable from a verified checkpoint, or fresh -- nothing trained yet, as after a signal in
the first seconds -- so a requeue starts it again; 1: neither).

**Modules**, one concern each; each imports only modules above it, by full name, never this ``__init__``:

    errors.py      CheckpointError, CorruptCheckpoint
    storage.py     the directory layout; DCP's writer and the safe reader of its metadata; sha256, fsync
    chunks.py      parts of a flat buffer as DCP chunks of one tensor per name (boxes, the save/load planners);
                   reading the flat engine's saved layouts (by name, or the earlier pieces)
    manifest.py    dettrain.json: format, self-hash, schema, its check against the files
    preemption.py  PreemptionGuard, REQUEUE_EXIT_CODE (from dettrain/signals.py), the torchrun restart hazard
    state.py       what is saved (TrainState, fingerprints, RNG streams), save(), loading the tensors through the
                   engine's own state_dict / load_plan / load_target / load_state_dict (sync/engines/base.py)
    resumption.py  which checkpoint to load and whether this config may continue it; resume(), the ledger header

The command line (``list``, ``status``, ``to-torch``) is dettrain/tools/checkpoint.py; ``python -m
dettrain.checkpoint`` runs it.
This package re-exports the names the rest of dettrain uses (``from dettrain import checkpoint as ckpt``).
"""

from __future__ import annotations

from dettrain.checkpoint.errors import CheckpointError, CorruptCheckpoint
from dettrain.checkpoint.manifest import FORMAT
from dettrain.checkpoint.manifest import _read_meta as _read_meta
from dettrain.checkpoint.preemption import PREEMPT_SIGNALS, REQUEUE_EXIT_CODE, PreemptionGuard, restart_hazard
from dettrain.checkpoint.resumption import Resumed, config_changes, flatten, record_header_changes, resume
from dettrain.checkpoint.state import FLAT_NAMES, TrainState, rng_state, save, set_rng_state
from dettrain.checkpoint.storage import CKPT_DIR, META_NAME, ckpt_dir, ckpt_name, list_checkpoints
from dettrain.checkpoint.storage import _reader as _reader
from dettrain.checkpoint.storage import _safe_metadata as _safe_metadata
from dettrain.checkpoint.storage import _single_process_ok as _single_process_ok

# the private names above are what dettrain/tools/export.py reads a checkpoint with (its manifest, DCP metadata)
__all__ = [
    "CKPT_DIR", "FLAT_NAMES", "FORMAT", "META_NAME", "PREEMPT_SIGNALS", "REQUEUE_EXIT_CODE",
    "CheckpointError", "CorruptCheckpoint", "PreemptionGuard", "Resumed", "TrainState",
    "ckpt_dir", "ckpt_name", "config_changes", "flatten", "list_checkpoints", "record_header_changes",
    "restart_hazard", "resume", "rng_state", "save", "set_rng_state",
]
