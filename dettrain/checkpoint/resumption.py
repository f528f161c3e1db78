"""Resume policy: which checkpoint to load, whether this run may continue it, and what the ledger records.

``resume`` takes the checkpoint ``ckpt.resume`` names (``auto``: the newest good one in the run dir, renaming damaged
ones ``*.corrupt`` and falling back); ``config_changes`` and ``ckpt.allow_config_change`` decide whether a changed
config may continue it; ``_try_load`` checks a load in full (the loaded tensors against their fingerprints, each
rank's RNG file against its sha256); ``record_header_changes`` writes accepted changes into the ledger header.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dettrain import dist as D
from dettrain.checkpoint.errors import AFRESH, CheckpointError, CorruptCheckpoint
from dettrain.checkpoint.manifest import _read_meta
from dettrain.checkpoint.preemption import restart_hazard
from dettrain.checkpoint.state import (
    TrainState,
    _fingerprints,
    _load_buffers,
    _load_tensors,
    model_buffers,
    set_rng_state,
)
from dettrain.checkpoint.storage import CKPT_DIR, META_NAME, _sha256_file, ckpt_dir, list_checkpoints
from dettrain.record.fingerprint import format_fp
from dettrain.record.identity import NON_NUMERIC, config_hash
from dettrain.tiers import policy

log = logging.getLogger("dettrain")


@dataclass
class Resumed:
    path: Path
    step: int
    event: dict  # the ledger's "resume" event
    header_changes: dict  # config changes to record in the ledger header (empty if none)


# ---- config changes between the checkpoint and this run --------------------------------------------------
def flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _covers(key: str, patterns: list[str] | tuple[str, ...]) -> bool:
    """``key`` equals a pattern or lies under it (``model`` covers ``model.dim``)."""
    return any(key == p or key.startswith(p + ".") for p in patterns)


def config_changes(meta: dict, cfg_dict: dict, world: int) -> dict[str, list]:
    """Keys that change the numbers of a run (those in the config hash) and differ between the checkpoint and
    this run, as {key: [saved, now]}; ``world_size`` too when the world size changed."""
    old, new = flatten(meta["config"]), flatten(cfg_dict)
    out = {k: [old.get(k), new.get(k)] for k in sorted(set(old) | set(new))
           if not _covers(k, NON_NUMERIC) and old.get(k) != new.get(k)}
    if meta["world_size"] != world:
        out["world_size"] = [meta["world_size"], world]
    return out


def _check_changes(path: Path, changes: dict[str, list], tier: int, allowed: list[str]) -> None:
    # tier 4 promises the same bits on any power-of-two world size, so only there is a new world size free
    refused = {k: v for k, v in changes.items()
               if not _covers(k, allowed) and not (k == "world_size" and policy(tier).world_invariant)}
    if refused:
        what = ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in refused.items())
        keys = ",".join(refused)
        raise CheckpointError(
            f"checkpoint {path} was saved with a different config ({what}); resuming would not reproduce an "
            f"uninterrupted run. Resume with the saved values, {AFRESH}, or accept the "
            f"change with ckpt.allow_config_change=[{keys}] (it is recorded in the ledger)")


def _check_engine(tr: TrainState, path: Path, meta: dict) -> None:
    """The engines store their state in different layouts (flat buffers in pieces, DTensor shards, torch's per-name
    state); no ckpt.allow_config_change converts one into another, so a checkpoint resumes on an engine that loads
    its layout, and the refusal (the engine's own: ``refuse_checkpoint_of``) names the engine that wrote it."""
    why = tr.engine.refuse_checkpoint_of(meta["optim"]["kind"])
    if why:
        raise CheckpointError(f"checkpoint {path} {why}")


# ---- resume ----------------------------------------------------------------------------------------------
def _try_load(tr: TrainState, path: Path, cfg_dict: dict) -> tuple[dict, dict[str, list]]:
    """Verify and load one checkpoint into the trainer; returns (meta, config changes).  A collective."""
    info = tr.info
    err, meta = None, None
    if info.is_main:
        try:
            meta = _read_meta(path)
        except CheckpointError as e:
            err = e
    err, meta = D.broadcast_object((err, meta), info)
    if err:
        raise err
    _check_engine(tr, path, meta)
    changes = config_changes(meta, cfg_dict, info.world)
    _check_changes(path, changes, tr.cfg.det.tier, list(tr.cfg.ckpt.allow_config_change))
    _load_tensors(tr, path, meta)

    # the loaded tensors must hash to what was saved (DCP checks shapes, not contents)
    totals = _fingerprints(tr)
    bad = None
    if info.is_main:
        got = {"param": format_fp(totals.get("param", 0)), "opt": format_fp(totals.get("opt", 0))}
        bad = [f"{k} {got[k]} != saved {v}" for k, v in meta["fingerprints"].items() if got[k] != v]
    bad = D.broadcast_object(bad, info)
    if bad:
        raise CorruptCheckpoint(f"checkpoint {path}: loaded state does not match its fingerprints "
                                f"({'; '.join(bad)}); a data file is damaged")
    # this rank's RNG streams: ranks beyond the saved world size keep their freshly derived streams
    err = None
    if info.rank < meta["world_size"]:
        rf = path / "rng" / f"rank_{info.rank:05d}.json"
        try:
            if _sha256_file(rf) != meta["rng_sha256"][info.rank]:
                raise ValueError("sha256 mismatch")
            set_rng_state(json.loads(rf.read_text(encoding="utf-8")))
        except (OSError, ValueError, KeyError, TypeError, IndexError) as e:  # damaged, or rehashed malformed JSON
            err = f"checkpoint {path}: RNG state of rank {info.rank} is damaged ({type(e).__name__}: {e})"
    errs = [e for e in D.all_gather_objects(err, info) if e]
    if errs:
        raise CorruptCheckpoint(errs[0])
    # model buffers (BatchNorm statistics): each rank its own; a checkpoint without them is refused, never reset
    errs = [e for e in D.all_gather_objects(_load_buffers(tr, path, meta), info) if e]
    if errs:
        raise (CheckpointError if "holds no model buffers" in errs[0] else CorruptCheckpoint)(errs[0])
    if info.world > meta["world_size"] and info.is_main and model_buffers(tr.engine.model):
        log.warning(f"checkpoint {path} was saved on {meta['world_size']} ranks: ranks from {meta['world_size']} on "
                    "start from rank 0's model buffers (each rank updates its own from its micro-batches)")
    tr.sampler.load_state_dict(meta["sampler"])
    tr.step = int(meta["step"])
    return meta, changes


def _candidates(tr: TrainState) -> tuple[list[Path], bool]:
    """(checkpoints to try in order, whether damaged ones may be skipped)."""
    spec = tr.cfg.ckpt.resume
    if spec == "none":
        return [], False
    if spec == "auto":
        return list_checkpoints(ckpt_dir(tr.run_dir)), True
    p = Path(spec)
    if (p / META_NAME).is_file():
        return [p], False
    for root in (p / CKPT_DIR, p):
        found = list_checkpoints(root)
        if found:
            return found, True  # a run dir or checkpoints dir: its newest good checkpoint
    raise CheckpointError(f"ckpt.resume={spec!r}: no checkpoint there (expected a step_XXXXXXXX directory holding "
                          f"{META_NAME}, or a run dir with {CKPT_DIR}/); use ckpt.resume=auto or none")


def torn_ledger_limit(run_dir: Path) -> tuple[int | None, str]:
    """(the newest checkpoint step the ledger supports, why) when the run's ledger ends in a torn line, else
    (None, ""): steps 0..n-1 are intact, so a checkpoint of step <= n can resume (the torn tail is dropped when the
    ledger is continued), and a newer one cannot.  ``checkpoint status`` and ``ckpt.resume=auto`` both use it, so
    they agree.  A ledger damaged elsewhere is left to the resume checks (rundir.check_resume_ledger)."""
    from dettrain.record.ledger import LEDGER_NAME, read_ledger, torn_tail

    ledger = Path(run_dir) / LEDGER_NAME
    try:
        if not ledger.is_file() or not torn_tail(ledger):
            return None, ""
        _, steps = read_ledger(ledger)
    except ValueError:
        return None, ""
    n = 0
    for s in steps:
        if s["step"] != n:
            break
        n += 1
    return n, f"the last line of {ledger} is torn, so it holds steps 0..{n - 1} only"


def _ledger_supported(cands: list[Path], run_dir: Path) -> tuple[list[Path], list[dict]]:
    """(the candidates a torn ledger supports, the newer ones skipped as {"path", "reason"})."""
    limit, why = torn_ledger_limit(run_dir)
    if limit is None:
        return cands, []
    steps = {p: int(p.name.split("_")[-1]) for p in cands}
    skipped = [{"path": str(p), "reason": f"checkpoint {p.name} is newer than the ledger ({why})"}
               for p in cands if steps[p] > limit]
    return [p for p in cands if steps[p] <= limit], skipped


def resume(tr: TrainState, cfg_dict: dict) -> Resumed | None:
    """Load the checkpoint ``ckpt.resume`` names into the trainer (state, RNG, sampler, step), or None when
    there is none to load.  A collective."""
    info = tr.info
    hazard = restart_hazard()
    if hazard and info.is_main:
        log.warning(hazard)
    cands, may_skip, err, newer = [], False, None, []
    if info.is_main:
        try:
            cands, may_skip = _candidates(tr)
            if tr.cfg.ckpt.resume == "auto":
                cands, newer = _ledger_supported(cands, tr.run_dir)
        except CheckpointError as e:
            err = e
    cands, may_skip, err, newer = D.broadcast_object((cands, may_skip, err, newer), info)
    if err:
        raise err
    if tr.cfg.ckpt.resume == "none":
        return None
    if newer and info.is_main:
        for s in newer:
            log.warning(f"ckpt.resume=auto: {s['reason']}; resuming from an earlier checkpoint, and the torn line "
                        "is dropped from the ledger")
    if not cands and newer:
        raise CheckpointError(f"ckpt.resume=auto: no checkpoint the ledger supports ({newer[0]['reason']}); "
                              f"restore the ledger, or {AFRESH}")
    if not cands:  # auto
        root = ckpt_dir(tr.run_dir)
        if root.is_dir() and any(root.glob("step_*.corrupt")):
            raise CheckpointError(f"ckpt.resume=auto: every checkpoint in {root} is damaged (*.corrupt); {AFRESH}, "
                                  "or resume from a copy with ckpt.resume=PATH")
        log.info(f"ckpt.resume=auto: no checkpoint in {root}, starting at step 0")
        return None
    skipped = list(newer)
    t0 = time.perf_counter()
    for path in cands:
        try:
            meta, changes = _try_load(tr, path, cfg_dict)
        except CorruptCheckpoint as e:
            if not may_skip:
                raise CorruptCheckpoint(f"{e}. Resume from another checkpoint (ckpt.resume=auto picks the newest "
                                        f"good one), or {AFRESH}") from None
            log.warning(f"{e}; falling back to the previous checkpoint")
            skipped.append({"path": str(path), "reason": str(e)})
            if info.is_main and path.parent == ckpt_dir(tr.run_dir):
                path.rename(path.with_name(path.name + ".corrupt"))  # keep it for inspection, out of the way
            continue
        event = {"kind": "event", "event": "resume", "step": tr.step, "from": str(path),
                 "world_size": info.world, "saved_world_size": meta["world_size"],
                 "saved_config_hash": meta["config_hash"], "config_hash": config_hash(cfg_dict),
                 "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0) or 0)}
        if changes:
            event["config_changes"] = changes
        if skipped:
            event["skipped"] = skipped
        log.info(f"resumed from {path} at step {tr.step} in {time.perf_counter() - t0:.2f} s"
                 + (f" (config changes: {changes})" if changes else ""))
        return Resumed(path, tr.step, event, changes)
    reasons = "; ".join(s["reason"] for s in skipped)
    raise CorruptCheckpoint(f"no usable checkpoint ({reasons}); {AFRESH}")


def record_header_changes(ledger: Path, step: int, changes: dict[str, list],
                          data_files: dict | None = None) -> None:
    """Add {"at_step", "changes"} to the ledger header's ``config_changes`` list, and, when ``data_files`` (this
    run's data fingerprints) differ from the header's (a change ckpt.allow_config_change=[data] accepted), make them
    the header's and add {"at_step", "from"} to its ``data_changes`` list (atomic rewrite; rank 0, before the ledger
    is reopened for appending)."""
    if not ledger.is_file():
        return
    with open(ledger, encoding="utf-8") as f:
        first = f.readline()  # the header alone decides whether anything is rewritten (a ledger can be long)
    try:
        head = json.loads(first)
    except json.JSONDecodeError:
        return  # not our header: leave the file alone, the resume event still records the change
    data_changed = data_files is not None and "data_files" in head and head["data_files"] != data_files
    if not changes and not data_changed:
        return
    lines = ledger.read_text(encoding="utf-8").split("\n")
    if changes:
        head.setdefault("config_changes", []).append({"at_step": step, "changes": changes})
    if data_changed:
        head.setdefault("data_changes", []).append({"at_step": step, "from": head["data_files"]})
        head["data_files"] = data_files
    lines[0] = json.dumps(head, separators=(",", ":"))
    tmp = ledger.with_name(ledger.name + ".hdr.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write("\n".join(lines))
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(ledger)
