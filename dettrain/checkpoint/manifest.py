"""``dettrain.json``, the manifest that completes a checkpoint: its format number, its sha256 of itself, its schema
checked field by field (a field removed or of the wrong type is damage, never a KeyError), and ``_read_meta``, which
checks it against the files on disk (sizes always, sha256 of ``.metadata`` always, of every file on request)."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

from dettrain.checkpoint.errors import AFRESH, CheckpointError, CorruptCheckpoint
from dettrain.checkpoint.storage import META_NAME, _sha256_file
from dettrain.tiers import TIERS, is_tier

FORMAT = 2  # 2: sha256 of every file (1 hashed only the small files)
_HEX16 = re.compile(r"^[0-9a-f]{16}$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def _body_sha(meta: dict) -> str:
    body = {k: v for k, v in meta.items() if k != "sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


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
    need("tier", is_tier, f"a tier {min(TIERS)}-{max(TIERS)}")
    need("config", lambda v: isinstance(v, dict), "an object")
    need("config_hash", lambda v: isinstance(v, str), "a string")
    need("numel", _is_int, "an integer >= 0")
    need("sampler", lambda v: isinstance(v, dict) and all(_is_int(v.get(k)) for k in ("epoch", "position")),
         "an object with integer epoch and position")
    # the engine that saved it names its layout (kind: "flat", "fsdp2", "torch" for ddp, or another engine's) and
    # checks the rest on load; here: an optimizer step count, or torch AdamW's per-parameter ones
    need("optim", lambda v: isinstance(v, dict) and isinstance(v.get("kind"), str) and bool(v["kind"]) and (
        _is_int(v.get("step_count")) or (isinstance(v.get("steps"), list) and
         all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v["steps"]))),
        'an object {"kind": str, "step_count": int} (flat, fsdp2) or {"kind": str, "steps": [numbers]} (torch)')
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
                              f"resume it with the dettrain version that wrote it, or {AFRESH}")
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
