"""Checkpoints that resume bit for bit, preemption handling, and the requeue exit code.

A checkpoint is a directory ``<run_dir>/checkpoints/step_XXXXXXXX/`` holding the state *after* XXXXXXXX optimizer
steps (the next step to run is XXXXXXXX):

    .metadata, __<rank>_0.distcp   torch.distributed.checkpoint (DCP) files: every tensor of the model and optimizer
    rng/rank_XXXXX.json            every RNG stream of one rank (python, numpy, torch CPU, CUDA), as JSON
    dettrain.json                  written last: step, config and its hash, world size, tier, sampler state,
                                   optimizer scalars, fingerprints of the saved tensors, size and sha256 of
                                   every file (each data file hashed by the rank that wrote it)

**Atomic.**  Everything is written into ``step_XXXXXXXX.tmp/``; after every rank has finished, rank 0 writes
``dettrain.json``, fsyncs it and renames the directory.  A directory without ``.tmp`` is complete or was damaged
afterwards; a crash mid-save leaves only a ``.tmp`` directory, which nothing reads.

**Sharded and world-size free (tiers 3-4).**  The flat buffers (parameters, exp_avg, exp_avg_sq) are saved as their
logical content [0, numel) -- never the padding, whose length depends on the world size -- in pieces named
``flat/<buffer>/<lo>-<hi>``: each rank writes its own bucket shards, so a sharded optimizer is saved by the ranks
that hold it and writes are spread over ranks otherwise.  Loading reads, on each rank, the pieces that overlap the
regions it needs, straight into its buffers; piece boundaries need not match the new world's shards, which is what
lets a checkpoint saved on 2 ranks resume on 1 or 4.  Tiers 0-2 (DDP + torch AdamW) save every parameter and
optimizer tensor by name (replicated; DCP writes each once).

**Integrity.**  ``dettrain.json`` carries a sha256 of itself, the size and sha256 of every file (a rank hashes
the data files it wrote, so the cost is spread), and the fingerprints (dettrain.fingerprint) of the parameters and
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
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import logging
import os
import pickle
import random
import re
import shutil
import signal
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from dettrain import dist as D
from dettrain.config import NON_NUMERIC, config_hash
from dettrain.errors import UserError
from dettrain.fingerprint import format_fp

if TYPE_CHECKING:
    from dettrain.engines import Engine


class TrainState(Protocol):
    """What a checkpoint saves and restores, and all this module reads of a run (the Trainer is one).

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
    from dettrain.fingerprint import combine_over_ranks

    totals, _ = combine_over_ranks(tr.engine.partials(("param", "opt"), False), False, tr.info)
    return totals

log = logging.getLogger("dettrain")

REQUEUE_EXIT_CODE = 75
"""Exit status of a run that stopped on SIGUSR1/SIGTERM after writing a checkpoint: requeue it with
ckpt.resume=auto and it continues the same ledger.  (sysexits.h EX_TEMPFAIL.)"""
CKPT_DIR = "checkpoints"
META_NAME = "dettrain.json"
FORMAT = 2  # 2: sha256 of every file (1 hashed only the small files)
PREEMPT_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)
_NAME_RE = re.compile(r"^step_(\d{8})$")
_PIECE_RE = re.compile(r"^flat/(param|exp_avg|exp_avg_sq)/(\d+)-(\d+)$")


class CheckpointError(UserError):
    """A checkpoint that cannot be used (damaged, incomplete or incompatible); the message says why and what to do.

    A UserError, so ``python -m dettrain`` prints it as a one-line error and exits 2."""


class CorruptCheckpoint(CheckpointError):
    """Damaged or incomplete: ``ckpt.resume=auto`` falls back to the previous checkpoint."""


# ---- preemption ------------------------------------------------------------------------------------------
class PreemptionGuard:
    """SIGUSR1/SIGTERM set a flag instead of killing the process; ``agreed()`` turns it into a decision that every
    rank takes at the same step."""

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


# ---- safe reading of DCP metadata ------------------------------------------------------------------------
_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")


class _MetadataUnpickler(pickle.Unpickler):
    """Admits only what DCP's ``.metadata`` is made of: its metadata dataclasses and enums, torch.Size, dtypes,
    layouts, memory formats and paths.  Anything else (a callable smuggled into a tampered file) is refused."""

    def find_class(self, module: str, name: str):
        import dataclasses
        import enum

        if module in _DCP_MODULES:
            obj = getattr(__import__(module, fromlist=[name]), name, None)
            if isinstance(obj, type) and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum)):
                return obj
        elif module == "torch":
            obj = getattr(torch, name, None)
            if obj is torch.Size or isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)):
                return obj
        elif module == "torch.serialization" and name in ("_get_layout",):
            return torch.serialization._get_layout  # maps a layout name to torch.layout
        elif module == "pathlib" and name in ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath",
                                               "Path"):
            import pathlib

            return getattr(pathlib, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from a checkpoint's .metadata")


def _first_line(e: BaseException) -> str:
    return (str(e).splitlines() or [""])[0][:300]


def _describe(e: BaseException) -> str:
    """One line for an exception; for DCP's CheckpointException, the failures of the ranks it wraps."""
    if isinstance(e, CheckpointException) and e.failures:
        return "; ".join(f"rank {r}: {type(x).__name__}: {_first_line(x)}" for r, (x, _) in sorted(e.failures.items()))
    return f"{type(e).__name__}: {_first_line(e)}"


def _safe_metadata(path: Path):
    with open(path, "rb") as f:
        return _MetadataUnpickler(io.BytesIO(f.read())).load()


def _reader(path: Path):
    from torch.distributed.checkpoint import FileSystemReader

    class SafeReader(FileSystemReader):
        """DCP's file reader with the metadata pickle read by ``_MetadataUnpickler``."""

        def read_metadata(self, *args, **kwargs):
            rank = kwargs.get("rank")
            md = _safe_metadata(Path(path) / (".metadata" if rank is None else f"__{rank}.metadata"))
            if getattr(md, "storage_meta", None) is not None and hasattr(self, "load_id"):
                md.storage_meta.load_id = self.load_id
            return md

    return SafeReader(str(path))


# ---- helpers ---------------------------------------------------------------------------------------------
def ckpt_dir(run_dir: Path) -> Path:
    return Path(run_dir) / CKPT_DIR


def ckpt_name(step: int) -> str:
    return f"step_{step:08d}"


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints (renamed, holding dettrain.json) under ``root``, newest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _NAME_RE.match(p.name) and (p / META_NAME).is_file()]
    return sorted(found, key=lambda p: p.name, reverse=True)


def _sha256_file(p: Path) -> str:
    h = hashlib.sha256()
    with open(p, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _body_sha(meta: dict) -> str:
    body = {k: v for k, v in meta.items() if k != "sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _fsync_dir(p: Path) -> None:
    try:
        fd = os.open(p, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_json(p: Path, obj: dict) -> None:
    with open(p, "w", encoding="utf-8") as f:
        json.dump(obj, f, separators=(",", ":"))
        f.flush()
        os.fsync(f.fileno())


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


# ---- what is saved ---------------------------------------------------------------------------------------
FLAT_NAMES = ("param", "exp_avg", "exp_avg_sq")


# ---- save ------------------------------------------------------------------------------------------------
def save(tr: TrainState, cfg_dict: dict, reason: str) -> Path:
    """Write the checkpoint of ``tr.step`` completed steps; a collective (every rank calls it).  Returns its path."""
    import torch.distributed.checkpoint as dcp

    info = tr.info
    t0 = time.perf_counter()
    root = ckpt_dir(tr.run_dir)
    final = root / ckpt_name(tr.step)
    tmp = root / (final.name + ".tmp")
    if info.is_main:
        if tmp.exists():
            shutil.rmtree(tmp)  # left by a save that crashed
        (tmp / "rng").mkdir(parents=True)
    D.barrier(info)
    totals = _fingerprints(tr)  # rank 0's values are complete (summed over ranks where needed)
    sd, opt_meta = tr.engine.state_dict()  # DCP state dict of tensors, JSON-able optimizer scalars
    with _single_process_ok():
        dcp.save(sd, storage_writer=_writer(tmp))  # one process without a process group: DCP sees that
    rng_file = tmp / "rng" / f"rank_{info.rank:05d}.json"
    _write_json(rng_file, rng_state())
    # every rank hashes what it wrote (its DCP data files and its RNG file), so the cost is spread over the ranks;
    # the gather is also the barrier: every rank has written
    mine = {p.relative_to(tmp).as_posix(): _sha256_file(p) for p in sorted(tmp.glob(f"__{info.rank}_*.distcp"))}
    rank_sha = _sha256_file(rng_file)
    mine[rng_file.relative_to(tmp).as_posix()] = rank_sha
    gathered = D.all_gather_objects((mine, rank_sha), info)
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
            err = f"saving checkpoint {final} failed: {e}"
    err = D.broadcast_object(err, info)
    if err:
        raise RuntimeError(err)
    log.info(f"checkpoint {final} ({reason}, {time.perf_counter() - t0:.2f} s)")
    return final


@contextlib.contextmanager
def _single_process_ok():
    """DCP warns on every single-process save/load that it assumes one process: that is what we mean."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _writer(path: Path):
    from torch.distributed.checkpoint import FileSystemWriter

    return FileSystemWriter(str(path), sync_files=True)


def _prune(root: Path, step: int, keep: int) -> None:
    """Keep the ``keep`` newest complete checkpoints up to ``step``; drop older ones and stale .tmp dirs.  Newer
    checkpoints (left by a run resumed from an older one) are not ours to delete."""
    done = [p for p in list_checkpoints(root) if int(p.name[5:]) <= step]
    for p in done[keep:]:
        shutil.rmtree(p, ignore_errors=True)
    for p in root.glob("step_*.tmp"):
        m = _NAME_RE.match(p.name[:-4])
        if m and int(m.group(1)) <= step:
            shutil.rmtree(p, ignore_errors=True)


# ---- load ------------------------------------------------------------------------------------------------
@dataclass
class Resumed:
    path: Path
    step: int
    event: dict  # the ledger's "resume" event
    header_changes: dict  # config changes to record in the ledger header (empty if none)


_HEX16 = re.compile(r"^[0-9a-f]{16}$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def _is_int(v: Any, lo: int = 0) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= lo


def _schema_errors(meta: Any) -> list[str]:
    """What is wrong with the fields of a dettrain.json (empty when it has the shape ``save`` writes)."""
    if not isinstance(meta, dict):
        return [f"the top level is a {type(meta).__name__}, not an object"]
    errs = []

    def need(key: str, ok, what: str) -> None:
        if key not in meta:
            errs.append(f"field {key!r} is missing")
        elif not ok(meta[key]):
            errs.append(f"field {key!r} is not {what} (got {json.dumps(meta[key])[:80]})")

    need("format", _is_int, "an integer")
    need("step", _is_int, "an integer >= 0")
    need("reason", lambda v: isinstance(v, str), "a string")
    need("world_size", lambda v: _is_int(v, 1), "an integer >= 1")
    need("tier", lambda v: _is_int(v) and v <= 4, "a tier 0-4")
    need("config", lambda v: isinstance(v, dict), "an object")
    need("config_hash", lambda v: isinstance(v, str), "a string")
    need("numel", _is_int, "an integer >= 0")
    need("sampler", lambda v: isinstance(v, dict) and all(_is_int(v.get(k)) for k in ("epoch", "position")),
         "an object with integer epoch and position")
    need("optim", lambda v: isinstance(v, dict) and (
        (v.get("kind") in ("flat", "fsdp2") and _is_int(v.get("step_count"))) or
        (v.get("kind") == "torch" and isinstance(v.get("steps"), list) and
         all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v["steps"]))),
        'an object {"kind": "flat"|"fsdp2", "step_count": int} or {"kind": "torch", "steps": [numbers]}')
    need("fingerprints", lambda v: isinstance(v, dict) and set(v) == {"param", "opt"} and
         all(isinstance(x, str) and _HEX16.match(x) for x in v.values()),
         "an object of param and opt fingerprints (16 hex digits)")

    def relpath(k: Any) -> bool:  # a file inside the checkpoint: never absolute, never '..'
        return isinstance(k, str) and k != "" and not k.startswith("/") and ".." not in k.split("/")

    need("files", lambda v: isinstance(v, dict) and all(relpath(k) and _is_int(n) for k, n in v.items()),
         "an object of relative paths -> sizes")
    need("sha256_files", lambda v: isinstance(v, dict) and all(
        relpath(k) and isinstance(h, str) and _HEX64.match(h) for k, h in v.items()),
        "an object of relative paths -> sha256")
    need("rng_sha256", lambda v: isinstance(v, list) and all(isinstance(h, str) and _HEX64.match(h) for h in v),
         "a list of sha256")
    if errs:
        return errs
    if set(meta["sha256_files"]) != set(meta["files"]):
        errs.append("files and sha256_files do not list the same files")
    if len(meta["rng_sha256"]) != meta["world_size"]:
        errs.append(f"rng_sha256 has {len(meta['rng_sha256'])} entries for world size {meta['world_size']}")
    return errs


def _read_meta(path: Path, verify_data: bool = False) -> dict:
    """dettrain.json of ``path``, checked against its own hash, its schema and the files on disk (rank 0).

    Sizes of all files and the sha256 of ``.metadata`` are always checked; ``verify_data`` also hashes the data
    files (what ``list`` and ``status`` do: a resume instead verifies the loaded tensors by their fingerprints)."""
    mp = path / META_NAME
    try:
        meta = json.loads(mp.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptCheckpoint(f"checkpoint {path}: {META_NAME} is unreadable ({e})") from e
    if not isinstance(meta, dict) or meta.get("sha256") != _body_sha(meta):
        raise CorruptCheckpoint(f"checkpoint {path}: {META_NAME} does not match its own sha256 (damaged)")
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path} has format {meta.get('format')!r}, this dettrain reads {FORMAT}; "
                              "resume it with the dettrain version that wrote it, or start afresh with "
                              "ckpt.resume=none")
    errs = _schema_errors(meta)
    if errs:
        raise CorruptCheckpoint(f"checkpoint {path}: {META_NAME} is malformed ({'; '.join(errs)})")
    for rel, size in meta["files"].items():
        f = path / rel
        if not f.is_file():
            raise CorruptCheckpoint(f"checkpoint {path}: file {rel} is missing")
        if f.stat().st_size != size:
            raise CorruptCheckpoint(f"checkpoint {path}: file {rel} has {f.stat().st_size} bytes, {size} were "
                                    "written (truncated or overwritten)")
    for rel, sha in meta["sha256_files"].items():
        if not verify_data and rel != ".metadata":
            continue  # data files: checked by the fingerprints of what is loaded; RNG files: by each rank
        try:
            got = _sha256_file(path / rel)
        except OSError as e:
            raise CorruptCheckpoint(f"checkpoint {path}: file {rel} is unreadable ({e.strerror})") from e
        if got != sha:
            raise CorruptCheckpoint(f"checkpoint {path}: file {rel} does not match its sha256 (damaged)")
    return meta


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
               if not _covers(k, allowed) and not (k == "world_size" and tier >= 4)}
    if refused:
        what = ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in refused.items())
        keys = ",".join(refused)
        raise CheckpointError(
            f"checkpoint {path} was saved with a different config ({what}); resuming would not reproduce an "
            f"uninterrupted run. Resume with the saved values, start afresh with ckpt.resume=none, or accept the "
            f"change with ckpt.allow_config_change=[{keys}] (it is recorded in the ledger)")


def _needed_pieces(pieces: dict[str, list[tuple[int, int, str]]], regions: list[tuple[int, int]]):
    return {name: [(a, b, k) for a, b, k in lst if any(a < hi and lo < b for lo, hi in regions)]
            for name, lst in pieces.items()}


def _plan_flat(md, path: Path, N: int) -> dict[str, list[tuple[int, int, str]]]:
    """The saved pieces of each flat buffer, checked to tile [0, N) exactly."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    pieces: dict[str, list[tuple[int, int, str]]] = {"param": [], "exp_avg": [], "exp_avg_sq": []}
    for key, tmd in md.state_dict_metadata.items():
        m = _PIECE_RE.match(key)
        if not m:
            continue
        a, b = int(m.group(2)), int(m.group(3))
        if not isinstance(tmd, TensorStorageMetadata) or tmd.properties.dtype != torch.float32 or \
                tuple(tmd.size) != (b - a,):
            raise CorruptCheckpoint(f"checkpoint {path}: entry {key} is not a float32 tensor of {b - a} elements")
        pieces[m.group(1)].append((a, b, key))
    for name, lst in pieces.items():
        lst.sort()
        pos = 0
        for a, b, key in lst:
            if a != pos:
                raise CorruptCheckpoint(f"checkpoint {path}: {name} pieces do not tile [0, {N}) (gap or overlap "
                                        f"at {pos}, next piece {key})")
            pos = b
        if pos != N:
            raise CheckpointError(f"checkpoint {path} holds {pos} elements of {name}, this model has {N}; "
                                  "the model shape differs")
    return pieces


def _load_tensors(tr: TrainState, path: Path, meta: dict) -> None:
    """Load model and optimizer tensors from ``path`` into the trainer (a collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    info = tr.info
    err, plan = None, None
    if info.is_main:
        try:
            md = _safe_metadata(path / ".metadata")
            kind = meta["optim"]["kind"]
            want_kind = {"ddp": "torch"}.get(tr.engine.name, tr.engine.name)
            if kind != want_kind:
                raise CheckpointError(f"checkpoint {path} was saved by the {kind} engine, this run uses "
                                      f"dist.engine={tr.engine.name}; resume with the engine that saved it")
            if kind == "fsdp2":
                plan = None  # DCP reads DTensor shards onto this world's layout itself
            elif kind == "flat":
                plan = _plan_flat(md, path, tr.engine.layout.numel)
            else:
                plan = {k: (tuple(v.size), str(v.properties.dtype).removeprefix("torch."))
                        for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
        except CheckpointError as e:
            err = e
        except Exception as e:  # noqa: BLE001 - a pickle damaged in any way (its sha256 rewritten too)
            err = f"checkpoint {path}: DCP .metadata is unreadable ({type(e).__name__}: {_first_line(e)})"
    err, plan = D.broadcast_object((err, plan), info)
    if isinstance(err, CheckpointError):
        raise err
    if err:
        raise CorruptCheckpoint(err)

    eng = tr.engine
    if eng.name == "fsdp2":
        sd, _ = eng.state_dict()  # the DTensors themselves: DCP loads each rank's rows in place
    elif eng.name == "flat":
        r = eng.reducer
        N = tr.engine.layout.numel
        sharded = r.shard and info.world > 1
        own = [(a, min(b, N)) for a, b in r.owned() if a < N]
        # parameters: sharded -> own shards, then all_gather (every rank reads 1/W); else every rank reads all
        param_regions = own if sharded else [(0, N)]
        want = {"param": param_regions, "exp_avg": own, "exp_avg_sq": own}
        sd = {}
        spill: list[tuple[str, int, int, torch.Tensor]] = []  # pieces that reach past this rank's moment regions
        for name, regions in want.items():
            for a, b, key in _needed_pieces({name: plan[name]}, regions)[name]:
                try:
                    sd[key] = eng.flat_slice(name, a, b)  # read straight into place
                except ValueError:  # saved on another layout: read whole, keep the part this rank holds
                    sd[key] = torch.empty(b - a, dtype=torch.float32, device=r.param.device)
                    spill.append((name, a, b, sd[key]))
    else:
        sd = {}
        for name, p in eng.model.named_parameters():
            key = f"model/{name}"
            if plan.get(key, ((),))[0] != tuple(p.shape):
                raise CheckpointError(f"checkpoint {path}: parameter {name} has shape {plan.get(key, [None])[0]} "
                                      f"there, {tuple(p.shape)} here; the model differs")
            sd[key] = p.detach()
        opt_state: dict[torch.nn.Parameter, dict[str, torch.Tensor]] = {}
        for name, p in eng.model.named_parameters():
            prefix = f"optim/{name}/"
            st = {}
            for key, (shape, dtype) in plan.items():
                if key.startswith(prefix):
                    # CPU tensors of the saved shape and dtype (AdamW's step is a scalar); load_state_dict below
                    # moves the moments beside their parameter
                    st[key[len(prefix):]] = sd[key] = torch.zeros(shape, dtype=getattr(torch, dtype))
            if st:
                opt_state[p] = st
    try:
        with _single_process_ok():
            dcp.load(sd, storage_reader=_reader(path))
        err = None
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - any read failure means a damaged checkpoint
        # DCP's CheckpointException is a BaseException (not caught by `except Exception`); it wraps each rank's
        # own failure, which is what the message should name
        err = f"checkpoint {path}: reading tensors failed ({_describe(e)})"
    errs = [e for e in D.all_gather_objects(err, info) if e]
    if errs:
        raise CorruptCheckpoint(errs[0])
    if eng.name == "fsdp2":
        eng.step_count = int(meta["optim"]["step_count"])
    elif eng.name == "flat":
        for name, a, b, t in spill:
            for ra, rb in own:
                lo, hi = max(a, ra), min(b, rb)
                if lo < hi:
                    eng.opt.view(name, lo, hi).copy_(t[lo - a : hi - a])
        if eng.reducer.shard and info.world > 1:
            eng.reducer.gather_params()
        eng.opt.step_count = int(meta["optim"]["step_count"])
    else:
        ids = {id(p): i for i, p in enumerate(p for g in eng.opt.param_groups for p in g["params"])}
        got = sorted({float(st["step"]) for st in opt_state.values() if "step" in st})
        if got != meta["optim"].get("steps"):
            raise CorruptCheckpoint(f"checkpoint {path}: AdamW step counts {got} != saved "
                                    f"{meta['optim'].get('steps')}")
        try:
            eng.opt.load_state_dict({"state": {ids[id(p)]: st for p, st in opt_state.items()},
                                     "param_groups": eng.opt.state_dict()["param_groups"]})
        except (ValueError, KeyError, RuntimeError) as e:  # optimizer entries of the wrong shape or kind
            raise CorruptCheckpoint(f"checkpoint {path}: optimizer state does not fit this optimizer "
                                    f"({type(e).__name__}: {_first_line(e)})") from None


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


def restart_hazard() -> str | None:
    """A warning when torchrun will restart workers through its shared rendezvous store, whose keys outlive an
    attempt: the restarted workers can read the dead attempt's addresses and fail to connect (pytorch#135712)."""
    if int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0) > 0 and \
            os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return ("torchrun --max-restarts>0 shares its rendezvous store with the workers, and a restarted attempt may "
                "read the failed attempt's addresses and fail to connect (pytorch#135712); export "
                "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 before torchrun")
    return None


def resume(tr: TrainState, cfg_dict: dict) -> Resumed | None:
    """Load the checkpoint ``ckpt.resume`` names into the trainer (state, RNG, sampler, step), or None when
    there is none to load.  A collective."""
    info = tr.info
    hazard = restart_hazard()
    if hazard and info.is_main:
        log.warning(hazard)
    cands, may_skip, err = [], False, None
    if info.is_main:
        try:
            cands, may_skip = _candidates(tr)
        except CheckpointError as e:
            err = e
    cands, may_skip, err = D.broadcast_object((cands, may_skip, err), info)
    if err:
        raise err
    if tr.cfg.ckpt.resume == "none":
        return None
    if not cands:  # auto
        root = ckpt_dir(tr.run_dir)
        if root.is_dir() and any(root.glob("step_*.corrupt")):
            raise CheckpointError(f"ckpt.resume=auto: every checkpoint in {root} is damaged (*.corrupt); start "
                                  "afresh with ckpt.resume=none, or resume from a copy with ckpt.resume=PATH")
        log.info(f"ckpt.resume=auto: no checkpoint in {root}, starting at step 0")
        return None
    skipped = []
    t0 = time.perf_counter()
    for path in cands:
        try:
            meta, changes = _try_load(tr, path, cfg_dict)
        except CorruptCheckpoint as e:
            if not may_skip:
                raise CorruptCheckpoint(f"{e}. Resume from another checkpoint (ckpt.resume=auto picks the newest "
                                        "good one) or start afresh with ckpt.resume=none") from None
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
    raise CorruptCheckpoint(f"no usable checkpoint ({reasons}); start afresh with ckpt.resume=none")


def record_header_changes(ledger: Path, step: int, changes: dict[str, list]) -> None:
    """Add {"at_step", "changes"} to the ledger header's ``config_changes`` list (atomic rewrite; rank 0, before
    the ledger is reopened for appending)."""
    if not changes or not ledger.is_file():
        return
    lines = ledger.read_text(encoding="utf-8").split("\n")
    try:
        head = json.loads(lines[0])
    except json.JSONDecodeError:
        return  # not our header: leave the file alone, the resume event still records the change
    head.setdefault("config_changes", []).append({"at_step": step, "changes": changes})
    lines[0] = json.dumps(head, separators=(",", ":"))
    tmp = ledger.with_name(ledger.name + ".hdr.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write("\n".join(lines))
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(ledger)


# ---- command line: python -m dettrain.checkpoint list|status RUN_DIR --------------------------------------
def _verified(root: Path) -> tuple[Path | None, list[str]]:
    """(the newest checkpoint under ``root`` whose every file matches its size and sha256, or None; why each newer
    one was rejected)."""
    bad = []
    for p in list_checkpoints(root):
        try:
            _read_meta(p, verify_data=True)
            return p, bad
        except CheckpointError as e:
            bad.append(f"{p.name}: {e}")
    return None, bad


def _status(run_dir: Path) -> tuple[int, str]:
    """(exit code, one-line verdict) of a run dir: 0 complete, 75 resumable or fresh, 1 neither."""
    from dettrain.ledger import LEDGER_NAME, parse_lines, read_ledger

    ledger = run_dir / LEDGER_NAME
    good, bad = _verified(ckpt_dir(run_dir))
    why = f" (damaged: {'; '.join(bad)})" if bad else ""
    # a signal in the first seconds (before the handler exists) leaves no run dir, no ledger, or a ledger whose
    # header is missing or torn: nothing was trained, so a requeue (75) starts the job afresh
    try:
        lines = parse_lines(ledger) if ledger.is_file() else []
    except ValueError as e:
        return 1, str(e)
    if not lines:
        if good is not None:
            return 1, f"neither: checkpoint {good.name} but no ledger at {ledger}; the run's record is lost"
        return REQUEUE_EXIT_CODE, (f"fresh: no steps trained in {run_dir} yet; rerun it (with ckpt.resume=auto it "
                                   "starts at step 0)" + why)
    try:
        header, steps = read_ledger(ledger)
    except ValueError as e:
        return 1, str(e)
    train = header.get("config", {}).get("train", {}) if isinstance(header.get("config"), dict) else {}
    total = train.get("steps") if isinstance(train, dict) else None
    last = steps[-1]["step"] if steps else -1
    if isinstance(total, int) and last + 1 >= total:
        return 0, f"complete: {last + 1}/{total} steps"
    if good is not None:
        return REQUEUE_EXIT_CODE, (f"resumable: {last + 1}/{total} steps in the ledger, newest verified checkpoint "
                                   f"{good.name}; rerun with ckpt.resume=auto" + why)
    if not steps:
        return REQUEUE_EXIT_CODE, (f"fresh: a ledger header and no steps in {run_dir}; rerun it (with "
                                   "ckpt.resume=auto it starts at step 0)" + why)
    return 1, f"neither: {last + 1}/{total} steps and no usable checkpoint" + why


def _list(run_dir: Path) -> int:
    root = ckpt_dir(run_dir)
    if not root.is_dir():
        print(f"error: {root} does not exist", file=sys.stderr)
        return 2
    for p in sorted(root.iterdir()):
        if p.name.endswith(".tmp"):
            state = "incomplete (a save that did not finish; never read)"
        elif p.name.endswith(".corrupt"):
            state = "BAD set aside by a resume that found it damaged (never read)"
        elif not (p / META_NAME).is_file():
            state = f"incomplete (no {META_NAME})"
        else:
            try:
                meta = _read_meta(p, verify_data=True)  # every file's size and sha256
                state = f"ok  step {meta['step']} world {meta['world_size']} tier {meta['tier']} ({meta['reason']})"
            except CheckpointError as e:
                state = f"BAD {e}"
        print(f"{p.name}: {state}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dettrain.checkpoint", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="checkpoints of a run and whether every file matches its sha256"
                   ).add_argument("run_dir")
    sub.add_parser("status", help=f"exit 0 if the run is complete, {REQUEUE_EXIT_CODE} if it can resume from a "
                   "verified checkpoint or has trained nothing yet (requeue it), 1 otherwise").add_argument("run_dir")
    args = ap.parse_args(argv)
    run_dir = Path(args.run_dir)
    if args.cmd == "status":
        code, msg = _status(run_dir)
        print(msg)
        return code
    return _list(run_dir)


if __name__ == "__main__":
    sys.exit(main())
