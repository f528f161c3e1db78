"""The data's identity, part of the run: ``data_fingerprint`` (size and sha256 of each token file, or a sampled
hash of fixed chunks above 64 MiB, and the sidecar's sha256; the embedded corpus's sha256) goes into the ledger
header as ``data_files``, and a resume refuses a changed file (``fingerprint_changes``, called by rundir.py).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from dettrain.data.tokens import DataConfig, sidecar, stdlib_corpus

FULL_HASH_BYTES = 64 << 20
"""Token files up to this size are hashed whole (sha256: ~0.1 s); larger ones by ``SAMPLE_CHUNKS`` chunks."""
SAMPLE_CHUNKS = 64
CHUNK_BYTES = 1 << 20
"""A token file larger than FULL_HASH_BYTES is hashed as its size plus SAMPLE_CHUNKS chunks of CHUNK_BYTES at fixed
offsets (the first at 0, the last ending at the end of the file, the rest evenly between): 64 MiB read whatever the
file's size, so a TB-scale file costs what a 64 MiB one does (docs/reliability.md says what that can miss)."""


def file_fingerprint(path: Path, full_limit: int = FULL_HASH_BYTES, chunks: int = SAMPLE_CHUNKS,
                     chunk_bytes: int = CHUNK_BYTES) -> dict:
    """{"size", "sha256"} of a file up to ``full_limit`` bytes, {"size", "sampled_sha256", "chunks"} of a larger one
    (the sha256 of its size and ``chunks`` chunks at fixed offsets).  Never the mtime or the path: copying the file
    keeps its fingerprint, rewriting its content changes it."""
    size = path.stat().st_size
    h = hashlib.sha256()
    with open(path, "rb") as f:
        if size <= full_limit:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
            return {"size": size, "sha256": h.hexdigest()}
        h.update(size.to_bytes(8, "little"))
        for i in range(chunks):
            f.seek(i * (size - chunk_bytes) // (chunks - 1))
            h.update(f.read(chunk_bytes))
    return {"size": size, "sampled_sha256": h.hexdigest(), "chunks": f"{chunks} x {chunk_bytes} bytes"}


def data_fingerprint(cfg: DataConfig, tokens: np.ndarray | None = None) -> dict:
    """What the ledger header records as ``data_files``: for data.path and data.val_path, the token file's
    fingerprint (``file_fingerprint``) and its sidecar's sha256 (null without one); for the embedded corpus
    (data.path unset), the sha256 of its bytes (``tokens``, or read again)."""
    out: dict[str, dict] = {}
    if cfg.path is None:
        arr = stdlib_corpus(cfg.max_bytes) if tokens is None else np.asarray(tokens)
        out["embedded"] = {"n_tokens": int(arr.size), "sha256": hashlib.sha256(arr.tobytes()).hexdigest()}
    for key in ("path", "val_path"):
        name = getattr(cfg, key)
        if name is None:
            continue
        fp = file_fingerprint(Path(name))
        meta = sidecar(name)
        fp["sidecar_sha256"] = file_fingerprint(meta)["sha256"] if meta.is_file() else None
        out[f"data.{key}"] = {"file": str(name), **fp}
    return out


def fingerprint_changes(saved: dict, now: dict) -> list[str]:
    """One phrase per data file whose fingerprint differs between two ``data_fingerprint`` results, naming the file
    and what changed (the file's name is not compared: another data.path is a config change, checked as such)."""
    short = lambda v: str(v)[:12]  # noqa: E731 - enough of a hash to tell two apart in a message
    out = []
    for key in dict.fromkeys([*saved, *now]):
        a, b = saved.get(key) or {}, now.get(key) or {}
        fields = [k for k in sorted(set(a) | set(b)) if k != "file" and a.get(k) != b.get(k)]
        if fields:
            name = "the embedded corpus" if key == "embedded" else f"{key}={b.get('file', a.get('file'))}"
            out.append(f"{name} ({', '.join(f'{k} {short(a.get(k))} -> {short(b.get(k))}' for k in fields)})")
    return out
