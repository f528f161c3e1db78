"""The documents ``prepare`` reads: the inputs expanded into files in a fixed order (``expand_inputs``), and each
file's documents (``input_kind``: a text file is one, a JSONL line / Parquet row / saved-dataset row one each).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from dettrain.errors import UserError, first_line
from dettrain.hub import is_local, resolve

JSONL_SUFFIXES = (".jsonl", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)
DATASET_MARKERS = (("dataset_dict.json",), ("state.json", "dataset_info.json"))
"""A directory holding all files of one of these sets is a ``save_to_disk`` directory (a DatasetDict, a Dataset):
one input, read with ``datasets.load_from_disk``, never walked as files."""


def input_kind(path: Path) -> str:
    """How an input is read: 'dataset' (a saved datasets directory), 'jsonl' (one document per line, the --field
    of its JSON object), 'parquet' (one document per row, the --field column) or 'text' (the file is one document)."""
    if path.is_dir():
        return "dataset"
    name = path.name.lower()
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(PARQUET_SUFFIXES):
        return "parquet"
    return "text"


def _is_dataset_dir(p: Path) -> bool:
    return p.is_dir() and any(all((p / m).is_file() for m in marks) for marks in DATASET_MARKERS)


def expand_inputs(inputs: list[str], pattern: str = "*") -> list[Path]:
    """Files in the order given; a directory becomes its files matching ``pattern``, walked recursively in sorted
    order of their relative paths (names starting with '.' skipped, e.g. .git): the same order on every machine."""
    files: list[Path] = []
    for item in inputs:
        p = Path(item)
        if _is_dataset_dir(p):
            files.append(p)  # datasets.load_from_disk reads it whole (input_kind 'dataset')
        elif p.is_dir():
            found = [f for f in p.rglob(pattern) if f.is_file()
                     and not any(part.startswith(".") for part in f.relative_to(p).parts)]
            files.extend(sorted(found, key=lambda f: f.relative_to(p).as_posix()))
        elif p.is_file():
            files.append(p)
        elif not is_local(item):  # a Hub dataset id: its snapshot in the Hugging Face cache, read by load_dataset
            files.append(resolve(item, "input", ("*",), repo_type="dataset"))
        else:
            raise UserError(f"input {item!r} is neither a file nor a directory")
    if not files:
        raise UserError(f"no input files (inputs {inputs}, pattern {pattern!r})")
    return files


def read_documents(files: list[Path], field: str, split: str | None, raw_bytes: bool,
               streaming: bool = False) -> Iterator[str | bytes]:
    """Every document of the inputs, in order: a text file whole (bytes at byte level, else UTF-8 text), a JSONL
    line's ``field``, a Parquet row's ``field`` column, a saved dataset's ``field`` (split ``split`` of a
    DatasetDict).  UserError naming the file (and line) for unreadable input."""
    def text_of(value, where: str) -> str | bytes:
        if not isinstance(value, str):
            raise UserError(f"{where}: field {field!r} is {type(value).__name__}, not a string; pass the text "
                            "column with --field NAME")
        return value.encode() if raw_bytes else value

    for f in files:
        kind = input_kind(f)
        if kind == "text":
            if raw_bytes:
                yield f.read_bytes()
                continue
            try:
                yield f.read_text(encoding="utf-8")
            except UnicodeDecodeError as e:
                raise UserError(f"{f} is not UTF-8 text ({e}); exclude it (--glob) or fix it") from None
        elif kind == "jsonl":
            with open(f, "rb") as fh:
                for n, raw in enumerate(fh, 1):
                    try:
                        line = raw.decode("utf-8")
                    except UnicodeDecodeError as e:
                        raise UserError(f"{f}:{n} is not UTF-8 text ({e.reason} at byte {e.start}); fix the line "
                                        "or exclude the file (--glob)") from None
                    if not line.strip():
                        continue
                    try:
                        obj = json.loads(line)
                    except ValueError as e:
                        raise UserError(f"{f}:{n} is not a JSON object ({e}); fix the line or exclude the file") \
                            from None
                    if not isinstance(obj, dict) or field not in obj:
                        keys = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
                        raise UserError(f"{f}:{n} has no field {field!r} (it has {keys}); pass --field NAME")
                    yield text_of(obj[field], f"{f}:{n}")
        elif kind == "parquet":
            try:
                import pyarrow.parquet as pq
            except ImportError:
                raise UserError(f"{f} is Parquet, which needs pyarrow: pip install 'dettrain[data]'") from None
            try:
                pf = pq.ParquetFile(f)
            except Exception as e:  # noqa: BLE001 - pyarrow's ArrowInvalid and friends
                raise UserError(f"{f} is not a readable Parquet file ({first_line(e)})") from None
            if field not in pf.schema_arrow.names:
                raise UserError(f"{f} has no column {field!r} (it has {pf.schema_arrow.names}); pass --field NAME")
            row = 0
            for batch in pf.iter_batches(columns=[field], batch_size=4096):
                for value in batch.column(0).to_pylist():
                    yield text_of(value, f"{f} row {row}")
                    row += 1
        else:
            yield from _dataset_documents(f, field, split, text_of, streaming)


def _dataset_documents(d: Path, field: str, split: str | None, text_of,
                       streaming: bool = False) -> Iterator[str | bytes]:
    """A saved dataset (``load_from_disk``) or a Hub dataset's snapshot (``load_dataset`` of its directory; with
    ``streaming`` read row by row from its files, never converted whole into the datasets cache)."""
    try:
        import datasets
    except ImportError:
        raise UserError(f"{d} is a saved datasets directory, which needs the datasets library: pip install "
                        "'dettrain[data]'") from None
    saved = _is_dataset_dir(d)
    try:
        if saved:
            ds = datasets.load_from_disk(str(d))
        elif streaming:
            ds = datasets.load_dataset(str(d), split=split or "train", streaming=True)
        else:
            ds = datasets.load_dataset(str(d))
    except Exception as e:  # noqa: BLE001 - datasets raises FileNotFoundError/ValueError/... for a bad directory
        how = "datasets.load_from_disk" if saved else "datasets.load_dataset"
        raise UserError(f"{d} is not a directory {how} reads ({first_line(e)})") from None
    if isinstance(ds, datasets.DatasetDict):
        name = split or ("train" if "train" in ds else None)
        if name not in ds:
            raise UserError(f"{d} holds the splits {sorted(ds)}; pick one with --split NAME")
        ds = ds[name]
    if ds.column_names is not None and field not in ds.column_names:  # a streamed dataset may not know them
        raise UserError(f"{d} has no column {field!r} (it has {ds.column_names}); pass --field NAME")
    row = 0
    for batch in ds.iter(batch_size=1024):
        if field not in batch:
            raise UserError(f"{d} has no column {field!r} (it has {sorted(batch)}); pass --field NAME")
        for value in batch[field]:
            yield text_of(value, f"{d} row {row}")
            row += 1
