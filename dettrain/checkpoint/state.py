"""What a checkpoint holds of a run, and its writing and reading.

``TrainState`` is what is saved and restored (the Trainer is one); ``save`` writes it (tensors through DCP, by name,
one RNG file per rank, then ``dettrain.json``, atomically); ``_load_tensors`` reads the tensors back into the
engine: the flat buffers by the chunks of each name inside this rank's regions (chunks.py), so any world size can
read them, or from the pieces of the earlier flat format (``_plan_flat``); tiers 0-2 by parameter name. The
fingerprints of the saved tensors and every RNG stream of a rank (``rng_state``) live here too.
"""

from __future__ import annotations

import logging
import random
import re
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from dettrain import dist as D
from dettrain.checkpoint.chunks import NAMED as _NAMED
from dettrain.checkpoint.chunks import load_planner, named_chunks, save_planner, split
from dettrain.checkpoint.errors import CheckpointError, CorruptCheckpoint, _describe, _first_line
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
    from dettrain.loop.engines import Engine

log = logging.getLogger("dettrain")

FLAT_NAMES = ("param", "exp_avg", "exp_avg_sq")
_PIECE_RE = re.compile(r"^flat/(param|exp_avg|exp_avg_sq)/(\d+)-(\d+)$")


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
    from torch.distributed.checkpoint.api import CheckpointException

    plain, chunked = split(sd)  # the flat engine's tensors come as boxes of its buffers (chunks.py)
    mine, rank_sha, failed = {}, "", None
    try:
        with _single_process_ok():  # one process without a process group: DCP sees that
            dcp.save(plain, storage_writer=_writer(tmp), planner=save_planner(chunked) if chunked else None)
        rng_file = tmp / "rng" / f"rank_{info.rank:05d}.json"
        _write_json(rng_file, rng_state())
        # every rank hashes what it wrote (its DCP data files and its RNG file), so the cost is spread over the
        # ranks; the gather below is also the barrier: every rank has written
        mine = {p.relative_to(tmp).as_posix(): _sha256_file(p) for p in sorted(tmp.glob(f"__{info.rank}_*.distcp"))}
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


def _check_named(md, path: Path, eng: Engine) -> str:
    """A flat-engine checkpoint by name holds every name of ``_NAMED`` as a float32 tensor of its parameter's
    shape; "named" when it does, CheckpointError naming the first that differs otherwise."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    for _, fmt in _NAMED:
        for name, p, _, _ in eng.layout.entries:
            tmd = md.state_dict_metadata.get(fmt.format(name))
            if not isinstance(tmd, TensorStorageMetadata) or tmd.properties.dtype != torch.float32 or \
                    tuple(tmd.size) != tuple(p.shape):
                have = tuple(tmd.size) if isinstance(tmd, TensorStorageMetadata) else None
                raise CheckpointError(f"checkpoint {path}: {fmt.format(name)} is {'missing' if have is None else have}"
                                      f" there, a float32 tensor of shape {tuple(p.shape)} here; the model differs")
    return "named"


def _load_tensors(tr: TrainState, path: Path, meta: dict) -> None:
    """Load model and optimizer tensors from ``path`` into the trainer (a collective)."""
    import torch.distributed.checkpoint as dcp  # here, not at import: DCP pulls in DTensor (errors.py says why)
    from torch.distributed.checkpoint.api import CheckpointException
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
            elif kind == "flat" and any(_PIECE_RE.match(k) for k in md.state_dict_metadata):
                plan = _plan_flat(md, path, tr.engine.layout.numel)  # earlier format: flat/<buf>/<lo>-<hi> pieces
            elif kind == "flat":
                plan = _check_named(md, path, tr.engine)
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
    planner = None
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
        if plan == "named":  # every name's boxes inside this rank's regions, read straight into the buffers
            planner = load_planner(named_chunks(eng.layout.entries, want, eng.flat_slice))
            want = {}
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
            dcp.load(sd, storage_reader=_reader(path), planner=planner)
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
