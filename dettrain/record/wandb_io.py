"""wandb: the mirror of the ledger (rank 0), and readers that turn wandb runs back into ledger form.

Mirror.  Rank 0 logs one history row per ledger step line, at wandb step = ledger step::

    train/step                    the ledger step again: every channel's x-axis (define_metric), whatever else
                                  a user logs into the run
    train/loss, train/lr,         numbers, for the usual charts (older mirrors logged them unprefixed as loss,
    train/grad_norm               lr, grad_norm and val_loss: the reader accepts both spellings)
    fp/<field>                    the fingerprint as the ledger holds it, exact (field: every key of
                                  record/schema.py: batch, loss_bits, grad, param, opt)
    fp24/<field>                  its low 24 bits as an integer: exactly representable in float32/float64 (a whole
                                  u64 is not: float64 keeps 53 bits), so a line panel overlays reruns exactly until
                                  they part; the hash channels of ``dettrain panel`` (data = batch, loss = loss_bits)
    fp/tensors                    per-tensor fingerprints as one compact JSON string (steps that have them)
    eval/loss, fp/val_loss_bits   the validation loss and its fp32 bits (steps that evaluate: eval.every)
    perf/tokens_per_s             tokens of this step (train.global_batch x model.seq_len, all ranks) over its wall
                                  time, next(sampler) to the step line (the first compiled step is left out)
    perf/mfu                      6 x params x tokens/s / (world x peak bf16 dense FLOP/s of one device): a number
                                  on a GPU whose peak is known (``PEAK_BF16_FLOPS``), null elsewhere (CPU)
    ref/match                     1 when every fingerprint equals the live reference's step (det.reference), else 0
    ref/loss_ulps                 the loss's distance from the reference's in fp32 ULPs (0: the same bits)
                                  both only at steps the reference has; summary ref/first_divergence: the first
                                  step with ref/match 0

The perf/* numbers are wall-clock measurements: they live in wandb only, never in the ledger or its fingerprints.

The config is the full resolved config plus ``dettrain`` (the ledger header without the config: hash, versions,
world size, tier, audit), so a run read back from wandb carries the same header as its ledger.  Reruns of one
config share a group (``log.wandb.group``, default ``<exp_name>-<first 8 hex digits of the config hash>``: the hash
covers the keys that affect the numbers, so a rerun lands beside its original and a changed config does not) and
job_type ``train``; ``log.wandb.name``/``tags``/``notes`` (else WANDB_NAME, WANDB_TAGS, WANDB_NOTES) name and tag
it, and dettrain adds the tags tier<N> and world<N>.  A run resumed from a checkpoint (ckpt.resume) continues
the wandb run of its run dir (``_init_run``: rewound online where the server can, else each step logged once).
A wandb failure is logged once and turns the mirror off; it never stops the run and never
touches other ranks, which do not talk to wandb at all.

Offline reader.  wandb 0.31 has no Python reader for the ``run-<id>.wandb`` record log it writes offline; this one
follows the layout seen in files the real client wrote::

    file header  7 bytes: b":W&B", magic 0xBEE1 (u16 little-endian), version 0 (u8)
    blocks       32 KiB, counted from the start of the file (header included); a block tail shorter than a chunk
                 header is zero padding
    chunk        crc32 (u32 LE; zlib crc32 of the type byte, then the payload), length (u16 LE), type (u8:
                 1 full, 2 first, 3 middle, 4 last), payload
    record       the payloads of one full chunk, or of first + middle* + last, joined: a serialized
                 ``wandb.proto.wandb_internal_pb2.Record`` (run, config, history, summary, exit, ...)

A torn tail (the client killed mid-write) is tolerated like a torn last ledger line; damage before the tail is an
error.  Online runs are read with ``wandb.Api`` (needs an API key).
"""

from __future__ import annotations

import collections
import json
import logging
import os
import re
import secrets
import struct
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dettrain.errors import UserError
from dettrain.record import schema
from dettrain.record.ledger import step_error

log = logging.getLogger("dettrain")

WANDB_HEADER = b":W&B" + struct.pack("<HB", 0xBEE1, 0)
BLOCK = 32 * 1024
CHUNK_HEADER = 7  # crc32 u32, length u16, type u8
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4
ID_FILE = "wandb_id.txt"  # the wandb run id of this run dir, reused when the run resumes


def low24(hex_fp: str) -> int:
    """The low 24 bits of a hex fingerprint: an integer every float type represents exactly."""
    return int(hex_fp, 16) & 0xFFFFFF


# device name (torch.cuda.get_device_name) substring -> dense bf16 peak FLOP/s (NVIDIA datasheets, without
# sparsity): the MFU denominator; the first match wins (the PCIe and NVL H100s before the SXM one); a device that
# matches none has no MFU (perf/mfu null)
PEAK_BF16_FLOPS: dict[str, float] = {"H100 PCIe": 756e12, "H100 NVL": 835e12, "H100": 989e12, "H200": 989e12,
                                     "H800": 989e12, "A100": 312e12, "A800": 312e12}


def peak_flops(device_name: str | None) -> float | None:
    """The dense bf16 peak of one device named ``device_name``; None for a CPU or a GPU not in the table."""
    if not device_name:
        return None
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in device_name), None)


def mfu(n_params: int, tokens_per_s: float, world: int, peak: float | None) -> float | None:
    """Model FLOPs utilization per device: 6 N FLOPs per token (the usual forward + backward estimate; attention
    FLOPs left out) x tokens/s of all ranks, over ``world`` devices of ``peak`` FLOP/s; None without a peak."""
    if peak is None or tokens_per_s <= 0 or world <= 0:
        return None
    return 6.0 * n_params * tokens_per_s / (world * peak)


def step_row(rec: dict, match: bool | None = None, loss_ulps: int | None = None,
             perf: dict[str, float | None] | None = None) -> dict[str, Any]:
    """The wandb history row of one ledger step line; ``perf``: perf/* numbers of the step (name -> value)."""
    row: dict[str, Any] = {"train/step": int(rec["step"]), "train/loss": rec["loss"], "train/lr": rec.get("lr"),
                           "train/grad_norm": rec.get("grad_norm")}
    for f in schema.keys():
        if rec.get(f) is not None:
            row[f"fp/{f}"] = rec[f]
            row[f"fp24/{f}"] = low24(rec[f])
    if rec.get("val_loss_bits") is not None:
        row["eval/loss"], row["fp/val_loss_bits"] = rec["val_loss"], rec["val_loss_bits"]
    if rec.get("tensors"):
        row["fp/tensors"] = json.dumps(rec["tensors"], separators=(",", ":"), sort_keys=True)
    if match is not None:
        row["ref/match"] = int(match)
    if loss_ulps is not None:
        row["ref/loss_ulps"] = int(loss_ulps)
    for name, value in (perf or {}).items():
        row[f"perf/{name}"] = value
    return row


def _first(row: dict[str, Any], *keys: str) -> Any:
    """The value of the first of ``keys`` the row has (a renamed key, then its older name)."""
    return next((row[k] for k in keys if k in row), None)


def row_to_step(row: dict[str, Any]) -> dict | None:
    """A ledger step line from a history row written by ``step_row`` (None for rows that are not dettrain steps)."""
    if "fp/param" not in row or "_step" not in row:
        return None
    rec: dict[str, Any] = {"kind": "step", "step": int(row["_step"]), "loss": _first(row, "train/loss", "loss")}
    for f in schema.keys():
        if f"fp/{f}" in row:
            rec[f] = row[f"fp/{f}"]
    rec["lr"], rec["grad_norm"] = _first(row, "train/lr", "lr"), _first(row, "train/grad_norm", "grad_norm")
    if isinstance(row.get("fp/val_loss_bits"), str):
        rec["val_loss"], rec["val_loss_bits"] = _first(row, "eval/loss", "val_loss"), row["fp/val_loss_bits"]
    if isinstance(row.get("fp/tensors"), str):
        rec["tensors"] = json.loads(row["fp/tensors"])
    if row.get("ref/match") is not None:
        rec["ref_match"] = int(row["ref/match"])
    if row.get("ref/loss_ulps") is not None:
        rec["ref_loss_ulps"] = int(row["ref/loss_ulps"])
    return rec


def header_from_config(config: dict[str, Any], wandb_meta: dict[str, Any]) -> dict:
    """A ledger header from a wandb run's config (as the mirror wrote it) plus the run's group/job_type/..."""
    config = {k: v for k, v in config.items() if k != "_wandb"}
    meta = config.pop("dettrain", None) or {}
    # the ledger's resolved wandb settings (mode, project, ...), then what the wandb file itself says
    return {"kind": "header", **meta, "config": config, "wandb": {**(meta.get("wandb") or {}), **wandb_meta}}


# ---- settings ---------------------------------------------------------------------------------------------
MODES = ("offline", "online", "disabled")
ENV_MODES = {"dryrun": "offline", "run": "online"}  # the older spellings wandb itself accepts in WANDB_MODE


def default_group(exp_name: str, cfg_hash: str | None) -> str:
    """The run group when neither log.wandb.group nor WANDB_RUN_GROUP is set: ``<exp_name>-<hash[:8]>``, so reruns
    of one config (same hash) share a group and a changed config gets its own; the bare name without a hash."""
    return f"{exp_name}-{cfg_hash[:8]}" if cfg_hash else exp_name


def resolve_wandb(cfg: Any, cfg_hash: str | None = None) -> dict[str, Any]:
    """``log.wandb.{mode,project,entity,group}`` resolved once at start-up: a key that is set wins, else the
    variable wandb users already set (WANDB_MODE, WANDB_PROJECT, WANDB_ENTITY, WANDB_RUN_GROUP), else offline /
    dettrain / the API key's default entity (None) / ``default_group(exp_name, cfg_hash)`` (``cfg_hash``: the
    ledger header's config_hash).  The ledger header records the result under ``wandb``; UserError for a mode that
    is none of offline, online, disabled, naming where it came from."""
    w = cfg.log.wandb
    env = os.environ

    def pick(key: str, var: str, default: Any) -> tuple[Any, str]:
        value = getattr(w, key)
        if value is not None:
            return value, f"log.wandb.{key}"
        if env.get(var):  # set but empty counts as unset
            return env[var], var
        return default, "default"

    mode, mode_from = pick("mode", "WANDB_MODE", "offline")
    if mode_from == "WANDB_MODE":
        mode = ENV_MODES.get(mode, mode)
    if mode not in MODES:
        raise UserError(f"{mode_from}={mode!r} must be offline, online or disabled (set log.wandb.mode=offline to "
                        "override the environment)")
    project, _ = pick("project", "WANDB_PROJECT", "dettrain")
    entity, _ = pick("entity", "WANDB_ENTITY", None)
    group, _ = pick("group", "WANDB_RUN_GROUP", default_group(cfg.exp_name, cfg_hash))
    name, _ = pick("name", "WANDB_NAME", None)
    notes, _ = pick("notes", "WANDB_NOTES", None)
    tags, tags_from = pick("tags", "WANDB_TAGS", [])
    if tags_from == "WANDB_TAGS":  # wandb's own spelling: comma-separated
        tags = [t.strip() for t in tags.split(",") if t.strip()]
    return {"mode": mode, "mode_from": mode_from, "project": project, "entity": entity, "group": group,
            "name": name, "tags": [str(t) for t in tags], "notes": notes, "verbose": bool(w.verbose)}


# ---- the mirror -------------------------------------------------------------------------------------------
class WandbMirror:
    """Rank 0's wandb run; every call is guarded so a wandb failure disables the mirror instead of the run."""

    def __init__(self, run: Any, logged_through: int = -1, timeout_s: float = 120.0) -> None:
        self.run = run
        self.logged_through = logged_through  # the wandb run holds steps up to here already: not logged again
        self.first_divergence: int | None = None
        self.timeout_s = timeout_s  # finish, and the wait for the run's file after it, take no longer together
        # the run's transaction log (the offline run's only record of its steps), taken now: a relative path
        # would follow a later change of the working directory
        try:
            self.sync_file: Path | None = Path(run.settings.sync_file).resolve()
        except Exception:  # noqa: BLE001 - a run without one (or a wandb that names it otherwise): no wait
            self.sync_file = None

    @classmethod
    def open(cls, cfg: Any, run_dir: Path, header: dict, resume_step: int | None = None) -> WandbMirror | None:
        """Start the wandb run for ``cfg`` (a dettrain Config) under ``run_dir``; None when disabled or failed.
        The settings are the header's ``wandb`` (resolve_wandb at start-up); ``resume_step``: the first step of a
        run resumed from a checkpoint (None: a fresh run)."""
        w = header.get("wandb") or resolve_wandb(cfg)
        if w["mode"] == "disabled":
            return None
        try:
            return cls(*_init_run(cfg, w, run_dir, header, resume_step), timeout_s=float(cfg.log.wandb.timeout_s))
        except Exception as e:  # noqa: BLE001 - any wandb failure must leave the run alive
            log.warning(f"wandb: could not start the mirror ({type(e).__name__}: {e}); training continues without "
                        f"wandb, the ledger {run_dir / 'ledger.jsonl'} has every step")
            return None

    def _fail(self, what: str, e: BaseException) -> None:
        log.warning(f"wandb: {what} failed ({type(e).__name__}: {e}); the mirror is off for the rest of the run, "
                    "the ledger is unaffected")
        self.run = None

    def log(self, rec: dict, verdict: Any = None, perf: dict[str, float | None] | None = None,
            extra: dict | None = None) -> None:
        """One ledger step line at wandb step = ledger step; ``verdict``: the live check's (reference.Verdict);
        ``perf``: the step's perf/* numbers (tokens_per_s, mfu); ``extra``: a user loop's own numbers
        (``StepLedger.log``), as ``train/<name>`` (a name with a ``/`` as given)."""
        if self.run is None or int(rec["step"]) <= self.logged_through:  # a re-run step the wandb run holds
            return
        match = None if verdict is None else verdict.match
        row = step_row(rec, match, None if verdict is None else verdict.loss_ulps, perf)
        for name, value in (extra or {}).items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                row.setdefault(name if "/" in name else f"train/{name}", value)
        try:
            self.run.log(row, step=int(rec["step"]))
            if match is False and self.first_divergence is None:
                self.first_divergence = int(rec["step"])
                self.run.summary["ref/first_divergence"] = self.first_divergence
        except Exception as e:  # noqa: BLE001
            self._fail("log", e)

    def finish(self, exit_code: int = 0) -> None:
        """Finish the wandb run, then wait until its ``.wandb`` file holds every record.  ``run.finish()`` returns
        once wandb's sender has the exit record; the file is written by wandb's writer, beside the sender, which
        holds the records back until the end of a short run, so for a moment after ``finish`` the file can hold
        its header alone.  A reader in this process (a user's loop reading its run back after
        ``StepLedger.close()``) would then find no steps.  The wait and ``finish`` take ``timeout_s`` at most
        together; past it the mirror says so (the ledger has every step either way)."""
        if self.run is None:
            return
        run, self.run = self.run, None
        start = time.monotonic()
        try:
            run.finish(exit_code=exit_code)
        except Exception as e:  # noqa: BLE001
            log.warning(f"wandb: finish failed ({type(e).__name__}: {e}); the ledger is complete")
            return
        self.await_file(start + self.timeout_s)

    def await_file(self, deadline: float) -> bool:
        """Wait (polling, until ``deadline`` on ``time.monotonic``) for the run's file to end in its exit record;
        True once it does, False (with a warning naming the file) when the deadline passes first."""
        if self.sync_file is None:
            return True
        delay = 0.01
        while not ends_in_exit(self.sync_file):
            if time.monotonic() >= deadline:
                log.warning(f"wandb: {self.sync_file} did not hold the run's last record within "
                            f"log.wandb.timeout_s={self.timeout_s:g} s of finishing; read now, it may lack steps "
                            "(wandb may still write them; the ledger has every step)")
                return False
            time.sleep(delay)
            delay = min(2 * delay, 0.25)
        return True


def _run_id(cfg: Any, run_dir: Path) -> tuple[str, bool]:
    """(wandb run id, continued): a resumed run (ckpt.resume set) continues the wandb run of its run dir."""
    f = run_dir / ID_FILE
    if cfg.ckpt.resume != "none" and f.is_file():
        return f.read_text().strip(), True
    rid = secrets.token_hex(4)  # not `random`: the seeded Python stream is the run's, not ours to advance
    f.write_text(rid + "\n")
    return rid, False


def logged_offline(run_dir: Path, run_id: str) -> int:
    """The highest step that earlier offline attempts of wandb run ``run_id`` under ``run_dir`` logged (-1: none;
    an unreadable attempt counts as none: logging a step again is better than losing it)."""
    last = -1
    for f in wandb_files(run_dir / "wandb"):
        try:
            _, meta, rows = read_wandb_file(f)
        except ValueError:
            continue
        if meta.get("run_id") == run_id:
            last = max([last, *(int(r["_step"]) for r in rows if "_step" in r and "fp/param" in r)])
    return last


# every channel the mirror logs is plotted against the ledger's step (train/step in each row), so a chart's x-axis
# is the step whatever else gets logged into the run
STEP_METRIC = "train/step"
STEPPED = ("train/*", "eval/*", "perf/*", "fp/*", "fp24/*", "ref/*")


def _init_run(cfg: Any, w: dict[str, Any], run_dir: Path, header: dict,
              resume_step: int | None = None) -> tuple[Any, int]:
    """(the wandb run, the last step it already holds).  A resumed run continues its run dir's wandb run: online,
    rewound to the resumed step where the server allows it (``resume_from``, so the re-run steps replace the old
    ones), else continued after the last step the run holds; offline, after the last step the earlier attempts
    logged (the re-run steps are equal by the tier's promise, and the ledger has them either way)."""
    import wandb

    timeout = float(cfg.log.wandb.timeout_s)
    meta = {k: v for k, v in header.items() if k not in ("kind", "config")}
    config = {**header["config"], "dettrain": meta}
    rid, continued = _run_id(cfg, run_dir)
    kwargs = dict(dir=str(run_dir), project=w["project"], entity=w["entity"], group=w["group"],
                  job_type="train", name=w.get("name") or run_dir.name, notes=w.get("notes"), config=config, id=rid,
                  tags=[*w.get("tags", []), f"tier{cfg.det.tier}", f"world{header.get('world_size', 1)}"],
                  # init/finish can never wait forever; console off: rank 0's lines are in logs/rank0.log already;
                  # silent (log.wandb.verbose=false): no banner, sync hints or sparkline summary (wandb 0.31:
                  # quiet=True still prints the offline hints, silent=True prints nothing)
                  settings=wandb.Settings(init_timeout=timeout, finish_timeout=timeout, console="off",
                                          silent=not w["verbose"]))
    resume = "allow" if continued else None
    run, held = None, -1
    if w["mode"] == "online":
        rewind = [{"resume_from": f"{rid}?_step={resume_step}"}] if continued and resume_step is not None else []
        for extra in [*rewind, {"resume": resume}]:
            try:
                run = wandb.init(mode="online", **kwargs, **extra)
            except Exception as e:  # noqa: BLE001 - no key, no network, no rewind on this server: the next way
                then = ("continuing it after its last step instead" if "resume_from" in extra else
                        f"logging offline under {run_dir / 'wandb'} instead (upload later with 'wandb sync')")
                log.warning(f"wandb: {'rewinding the run' if 'resume_from' in extra else 'online mode'} failed "
                            f"({type(e).__name__}: {e}); {then}")
                continue
            # rewound: the server dropped the steps from resume_step on; continued: it holds up to starting_step-1
            held = int(getattr(run, "starting_step", 0) or 0) - 1 if continued and "resume" in extra else -1
            break
    if run is None:
        held = logged_offline(run_dir, rid) if continued else -1
        run = wandb.init(mode="offline", resume=resume, **kwargs)
    run.define_metric(STEP_METRIC)
    for pattern in STEPPED:
        run.define_metric(pattern, step_metric=STEP_METRIC)
    return run, held


# ---- the offline reader -----------------------------------------------------------------------------------
def _iter_payloads(path: str | Path) -> Iterator[tuple[bytes, int]]:
    """(the serialized record, the byte it ends at) of each record of one ``.wandb`` file, in order, its chunks
    joined and their checksums checked; a torn tail ends the iteration; ValueError on a bad file."""
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as e:
        raise ValueError(f"cannot read wandb file {p}: {e.strerror}") from e
    if data[: len(WANDB_HEADER)] != WANDB_HEADER:
        raise ValueError(f"{p} is not a wandb record log (expected the header {WANDB_HEADER!r}, found "
                         f"{data[:len(WANDB_HEADER)]!r})")
    pos, parts, n = len(WANDB_HEADER), [], len(data)
    while pos < n:
        left = BLOCK - pos % BLOCK
        if left < CHUNK_HEADER:  # block trailer: zero padding
            pos += left
            continue
        if n - pos < CHUNK_HEADER:
            break  # torn tail
        crc, length, kind = struct.unpack_from("<IHB", data, pos)
        end = pos + CHUNK_HEADER + length
        if end > n:
            break  # torn tail: the last chunk was cut short
        payload = data[pos + CHUNK_HEADER : end]
        if zlib.crc32(payload, zlib.crc32(bytes([kind]))) != crc or kind not in (FULL, FIRST, MIDDLE, LAST):
            if end == n:
                break  # a damaged last chunk is a torn tail too
            raise ValueError(f"{p}: corrupt record at byte {pos} (checksum or chunk type mismatch)")
        pos = end
        if kind == FULL:
            parts = [payload]
        elif kind == FIRST:
            parts = [payload]
            continue
        else:
            if not parts:
                raise ValueError(f"{p}: record continuation without a start at byte {pos - length}")
            parts.append(payload)
            if kind == MIDDLE:
                continue
        yield b"".join(parts), pos
        parts = []


def _parse(raw: bytes, pos: int, path: Path | str) -> Any:
    from wandb.proto import wandb_internal_pb2 as pb

    rec = pb.Record()
    try:
        rec.ParseFromString(raw)
    except Exception as e:  # noqa: BLE001 - protobuf's DecodeError
        raise ValueError(f"{path}: undecodable record ending at byte {pos}: {e}") from e
    return rec


def iter_records(path: str | Path) -> Iterator[Any]:
    """The ``wandb_internal_pb2.Record`` protobufs of one ``.wandb`` file, in order; ValueError on a bad file."""
    for raw, pos in _iter_payloads(path):
        yield _parse(raw, pos, path)


def ends_in_exit(path: str | Path) -> bool:
    """Whether the ``.wandb`` file's last whole record is the run's exit record (wandb writes it last, when the run
    finishes): the file then holds every record of the run.  False for a file that is missing, unreadable, empty
    past its header or cut short; only the last record is decoded."""
    try:
        tail = collections.deque(_iter_payloads(path), maxlen=1)
        return bool(tail) and _parse(*tail[0], path=path).WhichOneof("record_type") == "exit"
    except ValueError:
        return False


def _item_key(item: Any) -> str:
    return item.key or ".".join(item.nested_key)


def read_wandb_file(path: str | Path) -> tuple[dict[str, Any], dict[str, Any], list[dict[str, Any]]]:
    """(config, run metadata, history rows) of one ``.wandb`` file; each row maps key -> decoded JSON value."""
    config: dict[str, Any] = {}
    meta: dict[str, Any] = {}
    rows: list[dict[str, Any]] = []
    for rec in iter_records(path):
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            r = rec.run
            meta = {"run_id": r.run_id, "project": r.project, "entity": r.entity, "group": r.run_group,
                    "job_type": r.job_type, "name": r.display_name}
            for u in r.config.update:
                config[_item_key(u)] = json.loads(u.value_json)
        elif kind == "config":
            for u in rec.config.update:
                config[_item_key(u)] = json.loads(u.value_json)
            for u in rec.config.remove:
                config.pop(_item_key(u), None)
        elif kind == "history":
            row = {_item_key(it): json.loads(it.value_json) for it in rec.history.item}
            if "_step" not in row and rec.history.HasField("step"):
                row["_step"] = rec.history.step.num
            rows.append(row)
    return config, meta, rows


def wandb_files(path: str | Path) -> list[Path]:
    """The ``.wandb`` files of a path: the file itself, an offline run dir, a ``wandb/`` dir or a dettrain run dir
    (all offline runs under it, oldest first, as a resumed run leaves several)."""
    p = Path(path)
    if p.is_file():
        return [p]
    found = sorted(p.glob("run-*.wandb"))
    if found:
        return found
    for base in (p, p / "wandb"):
        runs = sorted(d for d in base.glob("*run-*") if d.is_dir() and not d.is_symlink())
        found = [f for d in runs for f in sorted(d.glob("run-*.wandb"))]
        if found:
            return found
    return []


def read_wandb_run(path: str | Path) -> tuple[dict, list[dict]]:
    """(header, step lines) of an offline wandb run, as ``ledger.read_ledger`` returns them for a ledger.

    A resumed run leaves one offline dir per attempt, all with the same wandb run id: a later attempt's steps
    replace the earlier attempt's steps of the same index (like the ledger, which a resume truncates).  Files of
    *different* run ids in one dir are two runs stitched together: the header lists them under
    ``wandb.runs`` and their steps are all kept, so a step both wrote appears twice (diff reports both)."""
    files = wandb_files(path)
    if not files:
        raise ValueError(f"no wandb run at {path}: expected a run-<id>.wandb file, a wandb offline-run dir or a "
                         "dir holding wandb/offline-run-*")
    header: dict = {}
    by_run: dict[str, dict[int, dict]] = {}  # run id -> step -> line, in the order the runs first appear
    for f in files:
        config, meta, rows = read_wandb_file(f)
        if config or meta:
            header = header_from_config(config, {**meta, "file": str(f)})
        rid = meta.get("run_id") or header.get("wandb", {}).get("run_id") or ""
        steps = by_run.setdefault(rid, {})
        for row in rows:
            rec = row_to_step(row)
            if rec is not None:
                err = step_error(rec)
                if err:
                    raise ValueError(f"{f}: history row at wandb step {row.get('_step')}: {err}")
                steps[rec["step"]] = rec  # a later attempt of the same run replaces the earlier one's step
    if not header.get("config"):
        raise ValueError(f"{files[-1]}: no run config in the wandb file; was it written by dettrain's mirror?")
    header["wandb"]["runs"] = list(by_run)
    out = [rec for steps in by_run.values() for rec in steps.values()]
    return header, sorted(out, key=lambda r: r["step"])


# ---- online runs ------------------------------------------------------------------------------------------
_ONLINE = re.compile(r"^(?:wandb:|https?://[^/]+/)?([\w.-]+)/([\w.-]+)/(?:runs/)?([\w-]+)/?$")


def online_path(arg: str) -> str | None:
    """``entity/project/run_id`` when ``arg`` names an online run (wandb:E/P/ID, E/P/ID or a run URL), else None."""
    m = _ONLINE.match(arg)
    return "/".join(m.groups()) if m else None


def has_api_key() -> bool:
    """True when a wandb API key is configured (WANDB_API_KEY or a netrc entry), so nothing prompts for one."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    import netrc
    from urllib.parse import urlparse

    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or "api.wandb.ai"
    path = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    try:
        return netrc.netrc(str(path)).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def read_wandb_online(path: str) -> tuple[dict, list[dict]]:
    """(header, step lines) of an online run ``entity/project/run_id`` through ``wandb.Api``."""
    if not has_api_key():
        raise ValueError(f"reading the online wandb run {path} needs an API key: run 'wandb login' or set "
                         "WANDB_API_KEY (or pass a local run dir, ledger or offline wandb run)")
    import wandb

    try:
        run = wandb.Api(timeout=60).run(path)
        rows = list(run.scan_history(page_size=10_000))
        config = dict(run.config)
        meta = {"run_id": run.id, "project": run.project, "entity": run.entity,
                "group": getattr(run, "group", None), "job_type": getattr(run, "job_type", None),
                "name": run.name, "url": run.url}
    except Exception as e:  # noqa: BLE001 - network, auth, missing run: all bad input for the diff
        raise ValueError(f"cannot read the online wandb run {path}: {type(e).__name__}: {e}") from e
    steps: dict[int, dict] = {}
    for rec in (row_to_step(x) for x in rows):
        if rec is not None:
            err = step_error(rec)
            if err:
                raise ValueError(f"online wandb run {path}: {err}")
            steps[rec["step"]] = rec
    return header_from_config(config, meta), [steps[k] for k in sorted(steps)]
