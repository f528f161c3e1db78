"""Where checkpoints lie and how their files are written and read safely; nothing here knows what they hold.

The layout: ``<run_dir>/checkpoints/step_XXXXXXXX/``, complete once it holds ``dettrain.json``, and the pruning of
old ones.  DCP's writer and reader, with DCP's ``.metadata`` pickle read by an unpickler that admits only DCP's
metadata classes, ``torch.Size``, dtypes and layouts.  The sha256 of a file, JSON written and fsynced, fsync of a
directory (what makes the final rename durable).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import pickle
import re
import shutil
import warnings
from pathlib import Path

import torch

CKPT_DIR = "checkpoints"
META_NAME = "dettrain.json"
_NAME_RE = re.compile(r"^step_(\d{8})$")


# ---- layout ----------------------------------------------------------------------------------------------
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


# ---- DCP files: the writer, and a reader that never unpickles anything but DCP's metadata ----------------
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


def _writer(path: Path):
    from torch.distributed.checkpoint import FileSystemWriter

    return FileSystemWriter(str(path), sync_files=True)


@contextlib.contextmanager
def _single_process_ok():
    """DCP warns on every single-process save/load that it assumes one process: that is what we mean."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


# ---- files: sha256, durable writes -----------------------------------------------------------------------
def _sha256_file(p: Path) -> str:
    h = hashlib.sha256()
    with open(p, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _write_json(p: Path, obj: dict) -> None:
    with open(p, "w", encoding="utf-8") as f:
        json.dump(obj, f, separators=(",", ":"))
        f.flush()
        os.fsync(f.fileno())


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
