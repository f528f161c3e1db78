"""What a checkpoint holds of a run, and its writing and reading.

``TrainState`` is what is saved and restored (the Trainer is one); ``save`` writes it (the engine's
``state_dict()`` through DCP, by name, one RNG file per rank, then ``dettrain.json``, atomically); ``_load_tensors``
reads the tensors back through the engine's ``load_plan`` / ``load_target`` / ``load_state_dict``
(sync/engines/base.py), never asking which engine it is: each engine knows its own layout (the flat engine's boxes
and earlier pieces, chunks.py; FSDP2's DTensors; DDP's per-name torch state).  The fingerprints of the saved
tensors and every RNG stream of a rank (``rng_state``) live here too.
"""

from __future__ import annotations

import logging
import random
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from dettrain import dist as D
from dettrain.checkpoint.chunks import save_planner, split
from dettrain.checkpoint.errors import AFRESH, CheckpointError, CorruptCheckpoint, _describe, _first_line
from dettrain.checkpoint.manifest import FORMAT, _body_sha
from dettrain.checkpoint.storage import (
    META_NAME,
    _fsync_dir,
    _prune,
    _reader,
    _safe_metadata,
    _sha256_file,
    _single_process_ok,
    _write_json,
    _writer,
    ckpt_dir,
    ckpt_name,
)
from dettrain.record.fingerprint import format_fp
from dettrain.record.identity import config_hash

if TYPE_CHECKING:
    from dettrain.sync.engines import Engine

log = logging.getLogger("dettrain")

FLAT_NAMES = ("param", "exp_avg", "exp_avg_sq")
OPTIM = "optim"
"""The key of ``Engine.state_dict()`` holding the optimizer scalars, saved in dettrain.json (engines/base.py names
the same key; the checkpoint package does not import the engines)."""


class TrainState(Protocol):
    """What a checkpoint saves and restores, and all the checkpoint package reads of a run (the Trainer is one).

    ``engine`` gives the tensors (``state_dict()``: DCP state dict + optimizer scalars; its ``layout`` and
    ``partials`` for the fingerprints), ``sampler`` its (epoch, position), ``step`` the completed steps; RNG streams
    are this process's own.  ``cfg`` supplies det.tier and ckpt.*; ``info`` the rank and world."""

    info: D.DistInfo
    run_dir: Path
    cfg: Any
    step: int
    sampler: Any
    engine: Engine


def _fingerprints(tr: TrainState) -> dict[str, int]:
    """param and opt fingerprints of the state, summed over ranks (a collective)."""
    from dettrain.record.fingerprint import combine_over_ranks

    totals, _ = combine_over_ranks(tr.engine.partials(("param", "opt"), False), False, tr.info)
    return totals


# ---- RNG streams -----------------------------------------------------------------------------------------
def rng_state() -> dict:
    """Every process-wide RNG stream of this rank as JSON-able data."""
    py = random.getstate()
    kind, key, pos, has_gauss, cached = np.random.get_state()
    return {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": {"kind": kind, "key": key.tolist(), "pos": int(pos), "has_gauss": int(has_gauss),
                  "cached_gaussian": float(cached)},
        "torch": torch.get_rng_state().numpy().tobytes().hex(),
        "cuda": ([s.cpu().numpy().tobytes().hex() for s in torch.cuda.get_rng_state_all()]
                 if torch.cuda.is_available() else []),
    }


def set_rng_state(st: dict) -> None:
    py = st["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = st["numpy"]
    np.random.set_state((n["kind"], np.asarray(n["key"], dtype=np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    torch.set_rng_state(torch.frombuffer(bytearray.fromhex(st["torch"]), dtype=torch.uint8))
    if st["cuda"] and torch.cuda.is_available() and len(st["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([torch.frombuffer(bytearray.fromhex(h), dtype=torch.uint8)
                                      for h in st["cuda"]])


# ---- model buffers (BatchNorm statistics ...) -----------------------------------------------------------------
BUFFERS_DIR = "buffers"


def model_buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The persistent buffers of ``model`` by name (those its state_dict holds: BatchNorm's running statistics and
    counters); non-persistent ones (rope tables) are recomputed, not state."""
    out: dict[str, torch.Tensor] = {}
    for prefix, mod in model.named_modules():
        for name, b in mod._buffers.items():
            if b is not None and name not in mod._non_persistent_buffers_set:
                out[f"{prefix}.{name}" if prefix else name] = b
    return out


def buffers_file(rank: int) -> str:
    """A rank's buffers in a checkpoint: each rank's own, as the ranks update them from their own micro-batches."""
    return f"{BUFFERS_DIR}/rank_{rank:05d}.pt"


def _write_buffers(tr: TrainState, tmp: Path) -> Path | None:
    bufs = model_buffers(tr.engine.model)
    if not bufs:
        return None
    f = tmp / buffers_file(tr.info.rank)
    f.parent.mkdir(exist_ok=True)
    torch.save({k: v.detach().to("cpu", copy=True) for k, v in bufs.items()}, f)
    return f


def _load_buffers(tr: TrainState, path: Path, meta: dict) -> str | None:
    """Copy this rank's saved buffers into the model (rank 0's on a rank the saving world did not have); returns
    what is wrong (None: loaded, or the model has none)."""
    bufs = model_buffers(tr.engine.model)
    if not bufs:
        return None
    rel = buffers_file(tr.info.rank if tr.info.rank < meta["world_size"] else 0)
    if rel not in meta["sha256_files"]:
        return (f"checkpoint {path} holds no model buffers ({', '.join(list(bufs)[:3])}...: saved before buffers were "
                f"checkpointed); resuming would reset them and not reproduce the uninterrupted run: {AFRESH}")
    try:
        if _sha256_file(path / rel) != meta["sha256_files"][rel]:
            raise ValueError("sha256 mismatch")
        saved = torch.load(path / rel, map_location="cpu", weights_only=True)
        if sorted(saved) != sorted(bufs) or any(saved[k].shape != v.shape for k, v in bufs.items()):
            raise ValueError(f"it holds {sorted(saved)[:4]}, the model {sorted(bufs)[:4]}")
    except (OSError, ValueError, RuntimeError, KeyError, TypeError) as e:
        return f"checkpoint {path}: model buffers {rel} are damaged ({type(e).__name__}: {_first_line(e)})"
    with torch.no_grad():
        for k, v in bufs.items():
            v.copy_(saved[k])
    return None


# ---- save ------------------------------------------------------------------------------------------------
def save(tr: TrainState, cfg_dict: dict, reason: str) -> Path:
    """Write the checkpoint of ``tr.step`` completed steps; a collective (every rank calls it).  Returns its path."""
    import torch.distributed.checkpoint as dcp

    info = tr.info
    t0 = time.perf_counter()
    root = ckpt_dir(tr.run_dir)
    final = root / ckpt_name(tr.step)
    tmp = root / (final.name + ".tmp")
    err = None
    if info.is_main:
        try:
            if tmp.exists():
                shutil.rmtree(tmp)  # left by a save that crashed
            (tmp / "rng").mkdir(parents=True)
        except OSError as e:  # an immutable or read-only checkpoints directory: one line, every rank stops
            err = _save_failure(final, tmp, e)
    err = D.broadcast_object(err, info)  # also the barrier: the directory exists before any rank writes into it
    if err:
        raise CheckpointError(err)
    totals = _fingerprints(tr)  # rank 0's values are complete (summed over ranks where needed)
    sd = tr.engine.state_dict()  # DCP state dict of tensors (Stateful), and its JSON-able optimizer scalars
    opt_meta = sd.pop(OPTIM)
    from torch.distributed.checkpoint.api import CheckpointException

    plain, chunked = split(sd)  # the flat engine's tensors come as boxes of its buffers (chunks.py)
    mine, rank_sha, failed = {}, "", None
    try:
        with _single_process_ok():  # one process without a process group: DCP sees that
            dcp.save(plain, storage_writer=_writer(tmp), planner=save_planner(chunked) if chunked else None)
        rng_file = tmp / "rng" / f"rank_{info.rank:05d}.json"
        _write_json(rng_file, rng_state())
        buf_file = _write_buffers(tr, tmp)
        # every rank hashes what it wrote (its DCP data files, its RNG and buffers files), so the cost is spread over
        # the ranks; the gather below is also the barrier: every rank has written
        mine = {p.relative_to(tmp).as_posix(): _sha256_file(p) for p in sorted(tmp.glob(f"__{info.rank}_*.distcp"))}
        if buf_file is not None:
            mine[buf_file.relative_to(tmp).as_posix()] = _sha256_file(buf_file)
        rank_sha = _sha256_file(rng_file)
        mine[rng_file.relative_to(tmp).as_posix()] = rank_sha
    except (OSError, CheckpointException) as e:  # CheckpointException is a BaseException: named, not Exception
        failed = _save_failure(final, tmp, e)
    gathered = D.all_gather_objects((mine, rank_sha, failed), info)  # every rank learns any rank's failure
    failures = [g[2] for g in gathered if g[2]]
    if failures:
        if info.is_main:
            shutil.rmtree(tmp, ignore_errors=True)  # the incomplete save; earlier checkpoints are untouched
        raise CheckpointError(failures[0])
    shas = [g[0] for g in gathered]
    rng_sha = [g[1] for g in gathered]
    err = None
    if info.is_main:
        try:
            files = {p.relative_to(tmp).as_posix(): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()}
            sha_files = {k: v for d in shas for k, v in d.items()}
            for rel in files:  # .metadata (written by rank 0 as DCP's coordinator) and anything else not yet hashed
                if rel not in sha_files:
                    sha_files[rel] = _sha256_file(tmp / rel)
            meta = {
                "format": FORMAT, "step": tr.step, "reason": reason, "world_size": info.world,
                "tier": tr.cfg.det.tier, "config": cfg_dict, "config_hash": config_hash(cfg_dict),
                "sampler": tr.sampler.state_dict(), "optim": opt_meta, "numel": tr.engine.layout.numel,
                "fingerprints": {"param": format_fp(totals.get("param", 0)), "opt": format_fp(totals.get("opt", 0))},
                "files": files, "sha256_files": {k: sha_files[k] for k in files},
                "rng_sha256": rng_sha,
            }
            meta["sha256"] = _body_sha(meta)
            _write_json(tmp / META_NAME, meta)
            _fsync_dir(tmp)
            if final.exists():
                shutil.rmtree(final)  # the same step saved by an earlier attempt of this run: superseded
            tmp.rename(final)
            _fsync_dir(root)
            _prune(root, tr.step, tr.cfg.ckpt.keep)
        except OSError as e:
            err = _save_failure(final, tmp, e)
            shutil.rmtree(tmp, ignore_errors=True)
    err = D.broadcast_object(err, info)
    if err:
        raise CheckpointError(err)
    log.info(f"checkpoint {final} ({reason}, {time.perf_counter() - t0:.2f} s)")
    return final


def _save_failure(final: Path, tmp: Path, e: BaseException) -> str:
    """One line for a failed save: the checkpoint, the cause (an OSError's reason, found inside DCP's
    CheckpointException too; "No space left on device" when the disk is full although DCP's writer reports only a
    short write, e.g. "unexpected pos"), and that the checkpoints before it are good."""
    import errno
    import os

    from torch.distributed.checkpoint.api import CheckpointException

    causes: list[BaseException] = []
    for x in ([f[0] for f in e.failures.values()] if isinstance(e, CheckpointException) and e.failures else [e]):
        while x is not None and x not in causes:  # the exception and what it was raised from
            causes.append(x)
            x = x.__cause__ or x.__context__
    os_errs = [x for x in causes if isinstance(x, OSError) and x.errno]
    try:
        st = os.statvfs(tmp if tmp.exists() else tmp.parent)
        full = st.f_bavail * st.f_frsize < (1 << 20)
    except OSError:
        full = False
    if os_errs:
        reason = os_errs[0].strerror or str(os_errs[0])
        full = full or os_errs[0].errno in (errno.ENOSPC, errno.EDQUOT)
    elif full:
        reason = os.strerror(errno.ENOSPC)
    else:
        reason = _describe(e)
    fix = "free space (or set run_dir on another file system)" if full else "fix the cause"
    return (f"cannot save checkpoint {final}: {reason}; nothing of it is kept, and the checkpoints before it are "
            f"intact: {fix}, then continue with ckpt.resume=auto")


# ---- load ------------------------------------------------------------------------------------------------
def _load_tensors(tr: TrainState, path: Path, meta: dict) -> None:
    """Load model and optimizer tensors from ``path`` into the trainer's engine (a collective): rank 0 checks the
    DCP metadata against the engine (``load_plan``), every rank reads what ``load_target`` asks for in place, then
    the engine finishes (``load_state_dict``, given the saved optimizer scalars)."""
    import torch.distributed.checkpoint as dcp  # here, not at import: DCP pulls in DTensor (errors.py says why)
    from torch.distributed.checkpoint.api import CheckpointException

    info, eng = tr.info, tr.engine
    err, plan = None, None
    if info.is_main:
        try:
            md = _safe_metadata(path / ".metadata")
            kind = meta["optim"]["kind"]
            if kind != eng.state_kind:
                raise CheckpointError(f"checkpoint {path} was saved by the {kind} engine, this run uses "
                                      f"dist.engine={eng.name}; resume with the engine that saved it")
            plan = eng.load_plan(md, path)
        except CheckpointError as e:
            err = e
        except Exception as e:  # noqa: BLE001 - a pickle damaged in any way (its sha256 rewritten too)
            err = f"checkpoint {path}: DCP .metadata is unreadable ({type(e).__name__}: {_first_line(e)})"
    err, plan = D.broadcast_object((err, plan), info)
    if isinstance(err, CheckpointError):
        raise err
    if err:
        raise CorruptCheckpoint(err)

    sd, planner = eng.load_target(plan)
    try:
        with _single_process_ok():
            dcp.load(sd, storage_reader=_reader(path), planner=planner)
        err = None
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - any read failure means a damaged checkpoint
        # DCP's CheckpointException is a BaseException (not caught by `except Exception`); it wraps each rank's
        # own failure, which is what the message should name
        err = f"checkpoint {path}: reading tensors failed ({_describe(e)})"
    errs = [e for e in D.all_gather_objects(err, info) if e]
    if errs:
        raise CorruptCheckpoint(errs[0])
    try:
        eng.load_state_dict({**sd, OPTIM: meta["optim"]})
    except CorruptCheckpoint as e:
        raise CorruptCheckpoint(f"checkpoint {path}: {e}") from None
