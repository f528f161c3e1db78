"""A run's identity in its record: ``config_hash``, the hash of the config keys that change the numbers a run
computes, written into the ledger header and every checkpoint manifest; ``NON_NUMERIC``, the keys it leaves out.

Two runs with the same hash (and data, versions, devices) are comparable step by step; a resume refuses a config
whose hash changed unless ckpt.allow_config_change names the keys.  Plain JSON, no torch: every reader of a
record (checkpoints, the run dir) can import it without the config schema (dettrain/config.py, which
re-exports both names).
"""

from __future__ import annotations

import hashlib
import json

# keys that do not change the numbers a run computes (excluded from the config hash)
NON_NUMERIC = ("run_dir", "log", "ckpt", "det.reference", "det.on_divergence", "train.stop_after",
               "dist.timeout_s", "dist.reshard_after_forward", "dist.offload_partials", "exp_name",
               "train.cuda_graphs", "train.overlap_steps",
               # a run with unused parameters and allow_unused=false stops at its first step: the key never changes
               # the numbers of a run that trains, so old checkpoints (before the key existed) still resume
               "model.allow_unused")


def _drop(d: dict, dotted: str) -> None:
    *head, last = dotted.split(".")
    for k in head:
        d = d.get(k, {})
    d.pop(last, None)


def config_hash(cfg: dict) -> str:
    """sha256 (16 hex digits) of the keys that affect the numbers of a run."""
    d = json.loads(json.dumps(cfg))
    for k in NON_NUMERIC:
        _drop(d, k)
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]
