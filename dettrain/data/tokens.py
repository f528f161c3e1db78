"""Token files and the embedded corpus: the ``data.*`` keys (``DataConfig``), reading a token file through its
``.json`` sidecar (``load_tokens``), the vocabulary size ``model.vocab_size=0`` stands for, and the check that
data.val_path holds the tokens of the training data (``check_same_format``).

The default corpus (``data.path`` unset) is the Python standard library's own ``.py`` sources, read in sorted
path order as bytes (token = byte, vocabulary 256): real text that ships with every Python, no download.
"""

from __future__ import annotations

import fnmatch
import functools
import json
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dettrain.errors import UserError


@dataclass


class DataConfig:
    """Training data (``data.*``)."""

    path: str | None = None
    """Token file written by ``python -m dettrain.data prepare`` (raw uint8/uint16/uint32 array; its ``.json``
    sidecar gives the dtype).  None: the embedded corpus (Python standard library sources, byte tokens)."""
    dtype: str = "auto"
    """Token dtype of data.path when it has no sidecar: uint8, uint16 or uint32 (auto: read the sidecar)."""
    max_bytes: int = 4_000_000
    """Size cap of the embedded corpus in bytes (files are taken whole, in sorted order, until the cap)."""
    num_workers: int = 0
    """DataLoader worker processes per rank (0: load in the training process); workers are seeded from the
    derivation (purpose 'worker')."""
    val_fraction: float = 0.0
    """Hold out the LAST fraction of the samples (of data.path or the embedded corpus) for the validation loss
    (eval.*): e.g. 0.05 keeps the last 5 % out of training, and the sampler draws only from the rest.  0: no
    held-out split.  In [0, 1); part of the config hash (it changes the training samples)."""
    val_path: str | None = None
    """A separate validation token file (same format and sidecar as data.path) instead of data.val_fraction; the
    training data is then all of data.path."""


TOKEN_DTYPES = {"uint8": np.uint8, "uint16": np.uint16, "uint32": np.uint32}


@functools.lru_cache(maxsize=1)


def stdlib_sources() -> tuple[Path, ...]:
    """The embedded corpus's files: every ``*.py`` under the standard library's directory, in sorted order of
    their relative POSIX paths, none inside a ``site-packages`` directory; directories reached through a symbolic
    link are not entered.  This is the set ``root.rglob("*.py")`` filtered by ``"site-packages" not in
    parts`` yields (tests/test_data.py checks it), walked without descending into site-packages, which holds
    most of the tree (about 0.8 s a call otherwise, in every rank's start-up)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    if "site-packages" in root.parts:
        return ()
    found = []
    for d, dirs, names in os.walk(root):
        here = Path(d)
        found += [here / n for n in names + dirs if fnmatch.fnmatchcase(n, "*.py")]  # a directory *.py matches too
        dirs[:] = [n for n in dirs if n != "site-packages" and not os.path.islink(os.path.join(d, n))]
    return tuple(sorted(found, key=lambda q: q.relative_to(root).as_posix()))


def stdlib_corpus(max_bytes: int) -> np.ndarray:
    """Bytes of the standard library's .py files (``stdlib_sources``: sorted relative paths, site-packages
    excluded) as uint8."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = stdlib_sources()
    chunks, total = [], 0
    for p in files:
        try:
            b = p.read_bytes()
        except OSError:
            continue
        if total + len(b) > max_bytes:
            break
        chunks.append(b)
        total += len(b)
    if total == 0:
        raise RuntimeError(f"no Python sources found under {root}; set data.path to a token file")
    return np.frombuffer(b"".join(chunks), dtype=np.uint8)


def load_tokens(cfg: DataConfig, key: str = "path") -> np.ndarray:
    """The token array of ``cfg`` (memory-mapped for data.path); ``key="val_path"``: that of data.val_path."""
    name = getattr(cfg, key)
    if name is None:
        return stdlib_corpus(cfg.max_bytes)
    path = Path(name)
    if not path.is_file():
        raise UserError(f"data.{key}={name!r} does not exist; create it with "
                         f"'python -m dettrain.data prepare FILES --out {name}' or unset data.{key}")
    dtype = cfg.dtype
    meta = path.with_name(path.name + ".json")
    if dtype == "auto":
        if not meta.is_file():
            raise UserError(f"data.dtype=auto needs {meta} (written by prepare); set data.dtype=uint16 or similar")
        try:
            dtype = json.loads(meta.read_text())["dtype"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise UserError(f"{meta} is not a token-file sidecar with a dtype ({type(e).__name__}: {e}); rewrite it "
                            f"with 'python -m dettrain.data prepare' or set data.dtype") from None
        src = f"data.dtype={dtype} (from {meta.name})"
    else:
        src = f"data.dtype={dtype}"
    if dtype not in TOKEN_DTYPES:
        raise UserError(f"data.dtype={dtype!r} is not one of {sorted(TOKEN_DTYPES)}")
    size, item = path.stat().st_size, np.dtype(TOKEN_DTYPES[dtype]).itemsize
    if size == 0:
        raise UserError(f"data.{key}={name!r} is empty (0 bytes); write it with 'python -m dettrain.data "
                        "prepare FILES --out PATH'")
    if size % item:
        raise UserError(f"data.{key}={name!r} has {size} bytes, not a multiple of {item} ({src} has {item}-byte "
                        "tokens): a truncated file or the wrong data.dtype")
    return np.memmap(path, dtype=TOKEN_DTYPES[dtype], mode="r")


def sidecar(path: str | Path) -> Path:
    """The ``.json`` sidecar that ``prepare`` writes beside a token file."""
    p = Path(path)
    return p.with_name(p.name + ".json")


def sidecar_vocab_size(cfg: DataConfig) -> int:
    """The vocabulary size ``model.vocab_size=0`` stands for: data.path's sidecar, 256 for the embedded corpus."""
    if cfg.path is None:
        return 256
    meta = Path(cfg.path).with_name(Path(cfg.path).name + ".json")
    try:
        v = json.loads(meta.read_text())["vocab_size"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"model.vocab_size=0 reads the vocabulary size from {meta} (written by 'python -m "
                        f"dettrain.data prepare'), which is unreadable ({type(e).__name__}: {e}); set "
                        "model.vocab_size to a number") from None
    if not isinstance(v, int) or v <= 0:
        raise UserError(f"{meta} holds vocab_size={v!r}; set model.vocab_size to a number")
    return v


def _token_format(cfg: DataConfig, key: str) -> tuple[str, int | None, str, dict]:
    """(dtype, vocabulary size or None when unrecorded, what to call it, the sidecar's tokenizer identity:
    ``tokenizer_sha256`` and ``eot_id`` where recorded) of data.path / data.val_path."""
    name = getattr(cfg, key)
    if name is None:
        return "uint8", 256, "the embedded corpus (data.path unset)", {"tokenizer_sha256": None, "eot_id": None}
    vocab, dtype, ident = None, cfg.dtype, {}
    try:
        meta = json.loads(sidecar(name).read_text())
        if isinstance(meta, dict):
            vocab = meta.get("vocab_size")
            ident = {k: meta[k] for k in ("tokenizer_sha256", "eot_id") if k in meta}
            if dtype == "auto":
                dtype = meta.get("dtype", dtype)
    except (OSError, ValueError):
        pass  # no sidecar: load_tokens says what is missing, when it matters
    return str(dtype), vocab if isinstance(vocab, int) else None, f"data.{key}={name}", ident


def check_same_format(cfg: DataConfig) -> None:
    """data.val_path must hold tokens of the training data's tokenizer: the same dtype and vocabulary and, where both
    sidecars record them, the same tokenizer (``tokenizer_sha256``) and end-of-text id.  A validation file made by
    another tokenizer would give a validation loss that means nothing.  UserError naming both files."""
    if cfg.val_path is None:
        return
    (dt_a, v_a, a, id_a), (dt_b, v_b, b, id_b) = _token_format(cfg, "path"), _token_format(cfg, "val_path")
    fix = ("prepare both with the same tokenizer and options ('python -m dettrain.data prepare ... --tokenizer T', "
           "the same --no-eot)")
    if dt_a != dt_b or (v_a is not None and v_b is not None and v_a != v_b):
        raise UserError(f"{a} ({dt_a}, vocabulary {v_a}) and {b} ({dt_b}, vocabulary {v_b}) hold different tokens: "
                        f"the validation loss would mean nothing; {fix}")
    for k, what in (("tokenizer_sha256", "tokenizer (sha256)"), ("eot_id", "end-of-text id")):
        if k in id_a and k in id_b and id_a[k] != id_b[k]:
            short = (lambda v: f"{v[:12]}..." if isinstance(v, str) else v)  # noqa: E731 - a sha256 is long
            raise UserError(f"{a} and {b} were prepared with another {what} ({short(id_a[k])} and "
                            f"{short(id_b[k])}): the validation loss would mean nothing; {fix}")
