"""Token data, the global sample order, and the resumable step sampler.

Samples are non-overlapping windows of ``seq_len + 1`` tokens (stride ``seq_len``) over one token array.  The
global sample order of epoch e is a permutation drawn from ``derive_seed(seed, "data", e)``: a function of
(seed, epoch) only, never of world size.  Step s consumes the next ``global_batch`` samples of that order; they are
cut into micro-batches of ``micro_batch`` samples with global indices 0..M-1, and rank r of W takes the aligned block
[r*M/W, (r+1)*M/W).  An epoch ends when fewer than ``global_batch`` samples remain (the rest is dropped).  The
sampler's state is (epoch, position) and resumes exactly mid-epoch.

Held-out split (``eval.*``): ``data.val_fraction`` keeps the last fraction of the samples out of training (the
training dataset is samples 0..n_train-1, so the sampler never draws a held-out id), or ``data.val_path`` is a
separate token file.  The validation set is the first ``eval.batches x train.micro_batch`` held-out samples in
order, cut into micro-batches with global indices 0..eval.batches-1 and dealt to ranks as a step's micro-batches are
(``micro_indices``): the same samples every evaluation, on any world size.

The default corpus (``data.path`` unset) is the Python standard library's own ``.py`` sources, read in sorted
path order as bytes (token = byte, vocabulary 256): real text that ships with every Python, no download.
``python -m dettrain.data prepare INPUTS... --out tokens.bin`` writes a token file for ``data.path``: a text file is
one document, a JSONL line / Parquet row / saved-dataset row one each (``input_kind``; directories walked
recursively in sorted order), each followed by an end-of-text token (id 256 at byte level, so byte-level files have
vocabulary 257; the tokenizer's eos otherwise), tokenized in batches over worker processes with the same bytes for
any worker count.  Its ``.json`` sidecar records the vocabulary size, which ``model.vocab_size=0`` takes, and the
tokenizer's bos/eos/pad ids and identity.  ``prepare`` here does the work; the command line is
dettrain/tools/prepare.py (``python -m dettrain.data`` runs it: dettrain/data/__main__.py).  It never writes over an
input or a file it did not write (``check_output``), and writes through temporary files removed on any failure.

The data is part of the run: ``data_fingerprint`` (size and sha256 of each token file, or a sampled hash of fixed
chunks above 64 MiB, and the sidecar's sha256; the embedded corpus's sha256) goes into the ledger header as
``data_files``, and a resume refuses a changed file (rundir.py).  ``check_same_format``: data.val_path must hold
the tokens (dtype, vocabulary) of the training data.
"""

from __future__ import annotations

import fnmatch
import functools
import hashlib
import json
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dettrain.determinism import derive_seed
from dettrain.errors import UserError
from dettrain.hub import TOKENIZER_FILES, is_local, resolve


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


_DTYPES = {"uint8": np.uint8, "uint16": np.uint16, "uint32": np.uint32}


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
    if dtype not in _DTYPES:
        raise UserError(f"data.dtype={dtype!r} is not one of {sorted(_DTYPES)}")
    size, item = path.stat().st_size, np.dtype(_DTYPES[dtype]).itemsize
    if size == 0:
        raise UserError(f"data.{key}={name!r} is empty (0 bytes); write it with 'python -m dettrain.data "
                        "prepare FILES --out PATH'")
    if size % item:
        raise UserError(f"data.{key}={name!r} has {size} bytes, not a multiple of {item} ({src} has {item}-byte "
                        "tokens): a truncated file or the wrong data.dtype")
    return np.memmap(path, dtype=_DTYPES[dtype], mode="r")


# ---- the data's identity: what the ledger header records and a resume compares -------------------------------
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


def sidecar(path: str | Path) -> Path:
    """The ``.json`` sidecar that ``prepare`` writes beside a token file."""
    p = Path(path)
    return p.with_name(p.name + ".json")


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


class SampleDataset(torch.utils.data.Dataset):
    """Sample i = tokens[j*T : j*T + T + 1] as int64 with j = first + i (the window index in the token array);
    indexed by a list of sample ids (one micro-batch).  ``first``/``count`` select a contiguous range of windows
    (a training or held-out split); by default every window."""

    def __init__(self, tokens: np.ndarray, seq_len: int, first: int = 0, count: int | None = None) -> None:
        self.tokens, self.seq_len, self.first = tokens, seq_len, first
        total = (len(tokens) - 1) // seq_len
        self.n = total - first if count is None else min(count, total - first)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, ids: list[int]) -> torch.Tensor:
        T, f = self.seq_len, self.first
        rows = [np.asarray(self.tokens[(f + i) * T : (f + i) * T + T + 1], dtype=np.int64) for i in ids]
        return torch.from_numpy(np.stack(rows))


def split_samples(cfg: DataConfig, tokens: np.ndarray, seq_len: int) -> tuple[SampleDataset, SampleDataset | None]:
    """(training samples, held-out samples; None without a split) of ``tokens`` (the array of data.path) under
    data.val_fraction or data.val_path.  With val_fraction f the last floor(n*f) windows are held out; the one
    token the last training window and the first held-out window share is a training target and a held-out
    *input*, so no held-out target is ever trained on."""
    full = SampleDataset(tokens, seq_len)
    if cfg.val_path is not None:
        check_same_format(cfg)
        return full, SampleDataset(load_tokens(cfg, "val_path"), seq_len)
    if not cfg.val_fraction > 0:
        return full, None
    n_val = int(full.n * cfg.val_fraction)  # may be 0 for a tiny file: ValidationSet then says so
    n_train = full.n - n_val
    return SampleDataset(tokens, seq_len, 0, n_train), SampleDataset(tokens, seq_len, n_train, n_val)


def micro_indices(n_micro: int, rank: int, world: int, assignment: str = "block") -> range:
    """Global micro-batch indices 0..n_micro-1 that rank ``rank`` of ``world`` runs: an aligned block
    [rank*n/W, (rank+1)*n/W) (flat and DDP engines), or round-robin rank, rank+W, ... (FSDP2 at tier 4: round k is
    micro-batches kW..kW+W-1, an aligned block of the micro-batch tree)."""
    if assignment == "round_robin":
        return range(rank, n_micro, world)
    per = n_micro // world
    return range(rank * per, (rank + 1) * per)


def epoch_order(seed: int, epoch: int, n_samples: int) -> np.ndarray:
    """The global sample order of one epoch: a pure function of (seed, epoch, dataset size)."""
    return np.random.Generator(np.random.PCG64(derive_seed(seed, "data", epoch))).permutation(n_samples)


@dataclass
class MicroBatch:
    index: int  # global micro-batch index within the step, 0..M-1
    tokens: torch.Tensor  # (micro_batch, seq_len + 1) int64; a user Dataset's collated items (dettrain.sampler)

    @property
    def batch(self):
        """The micro-batch's data under a name that fits any dataset (the same object as ``tokens``)."""
        return self.tokens


class StepSampler:
    """Yields, per optimizer step, this rank's micro-batches; state (epoch, position) resumes exactly."""

    def __init__(self, dataset: SampleDataset, seed: int, global_batch: int, micro_batch: int,
                 rank: int = 0, world: int = 1, num_workers: int = 0, assignment: str = "block") -> None:
        if dataset.n < global_batch:
            raise UserError(f"the data has {dataset.n} samples of seq_len+1 tokens, fewer than "
                             f"train.global_batch={global_batch}; use more data or a smaller batch")
        self.ds, self.seed, self.G, self.m = dataset, seed, global_batch, micro_batch
        self.M = global_batch // micro_batch
        self.rank, self.world, self.num_workers = rank, world, num_workers
        self.assignment = assignment  # "block" or "round_robin" (see micro_indices)
        self.epoch, self.position = 0, 0
        self._order: tuple[int, np.ndarray] | None = None

    # ---- state -------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])

    # ---- plan --------------------------------------------------------------------------------------------
    def _perm(self, epoch: int) -> np.ndarray:
        if self._order is None or self._order[0] != epoch:
            self._order = (epoch, epoch_order(self.seed, epoch, self.ds.n))
        return self._order[1]

    def _advance(self, epoch: int, pos: int) -> tuple[int, int]:
        pos += self.G
        if pos + self.G > self.ds.n:
            return epoch + 1, 0
        return epoch, pos

    def global_step_ids(self, epoch: int, position: int) -> np.ndarray:
        """Sample ids of the whole global batch at (epoch, position), shape (M, micro_batch)."""
        return self._perm(epoch)[position : position + self.G].reshape(self.M, self.m)

    def micro_indices(self, rank: int) -> range:
        """Global micro-batch indices rank ``rank`` runs each step (module-level ``micro_indices``: a block, or
        round-robin for FSDP2 at tier 4).  Which sample is in which micro-batch never depends on this."""
        return micro_indices(self.M, rank, self.world, self.assignment)

    def local_micro_indices(self) -> range:
        return self.micro_indices(self.rank)

    def gathered_order(self) -> list[int]:
        """Global index of each position of an all_gather of every rank's per-micro-batch values (rank-major)."""
        return [j for r in range(self.world) for j in self.micro_indices(r)]

    def _plan(self) -> Iterator[list[int]]:
        epoch, pos = self.epoch, self.position
        while True:
            ids = self.global_step_ids(epoch, pos)
            for j in self.local_micro_indices():
                yield [int(i) for i in ids[j]]
            epoch, pos = self._advance(epoch, pos)

    def __iter__(self) -> Iterator[list[MicroBatch]]:
        loader = torch.utils.data.DataLoader(
            self.ds, batch_size=None, sampler=self._plan(), num_workers=self.num_workers,
            worker_init_fn=_WorkerInit(self.seed, self.rank) if self.num_workers else None,
            generator=torch.Generator().manual_seed(derive_seed(self.seed, "loader", self.rank)),
        )
        it = iter(loader)
        local = self.local_micro_indices()
        while True:
            micro = [MicroBatch(j, next(it)) for j in local]
            # state counts what the trainer consumed, not what workers prefetched
            self.epoch, self.position = self._advance(self.epoch, self.position)
            yield micro


class ValidationSet:
    """The fixed validation micro-batches: micro-batch i (global index 0..n_batches-1) is held-out samples
    [i*m, (i+1)*m), the same every evaluation and on any world size; this rank evaluates the indices the engine's
    ``assignment`` deals it, and ``order`` is the global index of each position of an all_gather of the ranks'
    per-micro-batch values (rank-major), for ``collectives.canonical_mean``."""

    def __init__(self, dataset: SampleDataset, n_batches: int, micro_batch: int, rank: int = 0, world: int = 1,
                 assignment: str = "block", source: str = "data.val_fraction") -> None:
        need = n_batches * micro_batch
        if dataset.n < need:
            raise UserError(f"the held-out split ({source}) has {dataset.n} samples of seq_len+1 tokens, fewer than "
                            f"eval.batches x train.micro_batch = {n_batches} x {micro_batch} = {need}; raise "
                            f"{source} or lower eval.batches")
        self.ds, self.m = dataset, micro_batch
        self.local = micro_indices(n_batches, rank, world, assignment)
        self.order = [j for r in range(world) for j in micro_indices(n_batches, r, world, assignment)]

    def sample_ids(self, index: int) -> list[int]:
        return list(range(index * self.m, (index + 1) * self.m))

    def local_batches(self) -> Iterator[MicroBatch]:
        for j in self.local:
            yield MicroBatch(j, self.ds[self.sample_ids(j)])


class _WorkerInit:
    """Seeds a DataLoader worker from the derivation (purpose 'worker', keyed by rank and worker id)."""

    def __init__(self, seed: int, rank: int) -> None:
        self.seed, self.rank = seed, rank

    def __call__(self, worker_id: int) -> None:
        import random

        s = derive_seed(self.seed, "worker", self.rank, worker_id)
        random.seed(s)
        np.random.seed(s % (1 << 32))
        torch.manual_seed(s)


# ---- prepare ---------------------------------------------------------------------------------------------
BYTE_EOT = 256
"""End-of-text token of byte-level token files: the first id past the 256 byte values (vocabulary 257, stored as
uint16), so it can never be confused with a byte of a document."""
EOT_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[EOS]")
"""Tokens looked up, in this order, as a tokenizer's end-of-text token (override with --eot-token)."""


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


def _made_by_prepare(out: Path) -> bool:
    """``out`` is a token file ``prepare`` wrote: its sidecar is prepare's and agrees with the file's size."""
    try:
        meta = json.loads(sidecar(out).read_text())
        return (isinstance(meta, dict) and meta.get("dtype") in _DTYPES and isinstance(meta.get("n_tokens"), int)
                and out.stat().st_size == meta["n_tokens"] * np.dtype(_DTYPES[meta["dtype"]]).itemsize)
    except (OSError, ValueError):
        return False


def check_output(files: list[Path], inputs: list[str], out: Path, force: bool = False) -> None:
    """Refuse (UserError naming both) an output that is an input or lies inside an input directory (it would be
    overwritten, or read back as a document by the next prepare), a directory, or an existing file that prepare did
    not write (unless ``force``)."""
    targets = {out.resolve(), sidecar(out).resolve()}
    for f in files:
        if f.resolve() in targets:
            raise UserError(f"--out {out} would overwrite the input file {f}; write the token file elsewhere")
    for item in inputs:
        d = Path(item).resolve()
        if Path(item).is_dir() and any(t.is_relative_to(d) for t in targets):
            raise UserError(f"--out {out} lies inside the input directory {item}: the next prepare would read it "
                            "back as a document; write the token file outside the inputs")
    if out.is_dir():
        raise UserError(f"--out {out} is a directory; name the token file to write (e.g. --out {out / 'tokens.bin'})")
    for t in (out, sidecar(out)):
        if t.exists() and not force and not _made_by_prepare(out):
            raise UserError(f"--out {out}: {t} already exists and was not written by prepare; pass --force to "
                            "overwrite it, or choose another --out")


def _replace_atomically(dest: Path, write) -> None:
    """``write(tmp_path)`` into a fresh temporary file beside ``dest``, then rename it over ``dest``; on any failure
    the temporary file is removed (nothing half-written is ever left, under any name).  The file's mode follows the
    umask, as a file ``open`` creates does."""
    import tempfile

    from dettrain.errors import follow_umask

    fd, name = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(name)
    try:
        follow_umask(tmp)  # mkstemp creates 0600
        write(tmp)
        tmp.replace(dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


# ---- prepare: documents from text files, JSONL, Parquet and saved datasets, tokenized over worker processes ----
BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>", "[BOS]", "[CLS]")
PAD_NAMES = ("<pad>", "<|pad|>", "[PAD]", "<|finetune_right_pad_id|>")
"""Tokens looked up, in this order, as a tokenizers-JSON tokenizer's bos and pad tokens (recorded in the sidecar
for export; an AutoTokenizer directory names its own)."""
JSONL_SUFFIXES = (".jsonl", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)
DATASET_MARKERS = (("dataset_dict.json",), ("state.json", "dataset_info.json"))
"""A directory holding all files of one of these sets is a ``save_to_disk`` directory (a DatasetDict, a Dataset):
one input, read with ``datasets.load_from_disk``, never walked as files."""
PROBE_TEXT = "Hello world 123"
"""Encoded once at load: a tokenizer that gives no tokens for it has no vocabulary."""
BATCH_DOCS, BATCH_CHARS = 256, 1 << 20
"""Documents are tokenized in batches of up to BATCH_DOCS documents or BATCH_CHARS characters (whichever fills
first), cut in document order by the parent process: the batches never depend on --workers."""


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


class _Tok:
    """A loaded tokenizer: ``encode(texts) -> id lists`` plus its identity and special ids.  A tokenizers JSON file
    (``tokenizers.Tokenizer.from_file``), or a directory: ``transformers.AutoTokenizer`` when transformers is
    installed, else the directory's tokenizer.json.  Both encode with the tokenizer's own special-token defaults
    (``add_special_tokens=True``: a LLaMA tokenizer puts bos in front of each document, as in its own training)."""

    def __init__(self, spec: str) -> None:
        path = Path(spec)
        self.spec, self.path = spec, path.resolve()
        self.hf = None
        self.tok = None
        if path.is_dir():
            try:
                import transformers  # noqa: F401 - only to know whether AutoTokenizer is there
            except ImportError:
                tj = path / "tokenizer.json"
                if not tj.is_file():
                    raise UserError(f"tokenizer {spec} is a directory without tokenizer.json, and transformers (for "
                                    "AutoTokenizer) is not installed; pip install 'dettrain[hf]' or pass a "
                                    "tokenizer.json") from None
                self._load_json(tj, spec)
            else:
                from transformers import AutoTokenizer

                try:
                    self.hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
                except Exception as e:  # noqa: BLE001 - transformers raises many kinds for an unreadable directory
                    raise UserError(f"tokenizer {spec} is not a tokenizer directory AutoTokenizer can load "
                                    f"({_first(e)}); pass a directory written by save_pretrained, or a "
                                    "tokenizer.json") from None
        elif path.is_file():
            self._load_json(path, spec)
        else:
            raise UserError(f"tokenizer {spec!r} does not exist; pass a tokenizer.json file or a tokenizer directory "
                            "(save_pretrained)")

    def _load_json(self, file: Path, spec: str) -> None:
        from tokenizers import Tokenizer

        try:
            self.tok = Tokenizer.from_file(str(file))
        except Exception as e:  # noqa: BLE001 - the tokenizers library raises a bare Exception for a bad file
            raise UserError(f"tokenizer {spec} is not a Hugging Face tokenizers JSON file ({_first(e)}); pass "
                            "the tokenizer.json of a tokenizer (tokenizers.Tokenizer.save writes one)") from None

    @property
    def vocab_size(self) -> int:
        # every id the tokenizer can emit, added special tokens included (len(), not .vocab_size, for transformers)
        return len(self.hf) if self.hf is not None else self.tok.get_vocab_size(with_added_tokens=True)

    def token_id(self, name: str | None) -> int | None:
        if name is None:
            return None
        if self.hf is not None:
            i = self.hf.convert_tokens_to_ids(name)
            return None if i is None or i == self.hf.unk_token_id and name != self.hf.unk_token else int(i)
        return self.tok.token_to_id(name)

    def special(self, attr: str, names: tuple[str, ...]) -> int | None:
        """The tokenizer's own bos/eos/pad id (transformers' ``<attr>_token_id``), else the first of ``names``."""
        if self.hf is not None and getattr(self.hf, f"{attr}_token_id", None) is not None:
            return int(getattr(self.hf, f"{attr}_token_id"))
        return next((i for i in map(self.token_id, names) if i is not None), None)

    def encode(self, texts: list[str]) -> list[list[int]]:
        if self.hf is not None:
            return [list(x) for x in self.hf(texts, add_special_tokens=True)["input_ids"]]
        return [e.ids for e in self.tok.encode_batch(texts)]

    def identity(self) -> dict:
        """The sidecar's record of which tokenizer made the ids: its absolute path and the sha256 of its file (a
        directory: of its files' names and sha256 in sorted order), so export can copy it and a reader can check it."""
        return {"tokenizer": str(self.path), "tokenizer_kind": "transformers" if self.hf is not None else "tokenizers",
                "tokenizer_sha256": tokenizer_sha256(self.path)}


def tokenizer_sha256(path: Path) -> str:
    """The sidecar's ``tokenizer_sha256`` of a tokenizer file (its sha256) or directory (the sha256 of its files'
    names and sha256 in sorted order)."""
    path = Path(path)
    if path.is_dir():
        h = hashlib.sha256()
        for f in sorted(x for x in path.iterdir() if x.is_file()):
            h.update(f"{f.name}\0{file_fingerprint(f, full_limit=1 << 40)['sha256']}\n".encode())
        return h.hexdigest()
    return file_fingerprint(path, full_limit=1 << 40)["sha256"]


def load_tokenizer(spec: str):
    """The tokenizer ``prepare --tokenizer spec`` encodes with (``encode(texts) -> id lists``), loaded as prepare
    loads it."""
    return _Tok(spec)


def _documents(files: list[Path], field: str, split: str | None, raw_bytes: bool,
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
                raise UserError(f"{f} is not a readable Parquet file ({_first(e)})") from None
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
        raise UserError(f"{d} is not a directory {how} reads ({_first(e)})") from None
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


def _batches(docs: Iterator[str | bytes]) -> Iterator[list[str | bytes]]:
    batch, chars = [], 0
    for d in docs:
        batch.append(d)
        chars += len(d)
        if len(batch) >= BATCH_DOCS or chars >= BATCH_CHARS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


_WORKER: dict = {}
"""The tokenizer and options of this process's tokenize_batch (set before the worker pool forks, or in-process)."""


def _tokenize_batch(batch: list[str | bytes]) -> bytes:
    """One batch's tokens in the output dtype: each document's ids, then the end-of-text id unless the encoding
    already ends with it (a tokenizer whose post-processor appends eos)."""
    tok, eot, dtype = _WORKER["tok"], _WORKER["eot"], _WORKER["dtype"]
    if tok is None:  # byte level: the document's bytes are its ids
        ids = [np.frombuffer(d, dtype=np.uint8).astype(np.int64) for d in batch]
    else:
        ids = [np.asarray(x, dtype=np.int64) for x in tok.encode(batch)]
        for d, x in zip(batch, ids):
            if x.size == 0 and d.strip():  # a tokenizer without a vocabulary: the data would be end-of-text only
                raise UserError(_encodes_to_nothing(tok, d))
    parts = []
    for x in ids:
        parts.append(x)
        if eot is not None and (x.size == 0 or x[-1] != eot):
            parts.append(np.asarray([eot], dtype=np.int64))
    return (np.concatenate(parts) if parts else np.zeros(0, np.int64)).astype(dtype).tobytes()


def _encodes_to_nothing(tok: _Tok, text: str) -> str:
    return (f"tokenizer {tok.spec} encodes the text {text.strip()[:40]!r} to no tokens (vocabulary of "
            f"{tok.vocab_size}): it has no usable vocabulary; pass a tokenizer.json or a directory written by "
            "save_pretrained that holds one")


def _worker_init() -> None:
    # one process per core already: the tokenizer's own thread pool inside each would oversubscribe the cores
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


def _write_tokens(tmp: Path, batches: Iterator[list], workers: int) -> int:
    """Tokenize ``batches`` (over ``workers`` processes when > 1) and write their bytes to ``tmp`` in batch order,
    whatever order the workers finish in: the output never depends on the worker count.  Returns the bytes written.
    At most 2 x workers batches are in flight, so memory stays bounded on any corpus size."""
    from collections import deque
    from itertools import chain, islice

    written = 0
    batches = iter(batches)
    head = list(islice(batches, max(2, workers)))  # no more processes than there are batches to give them
    batches = chain(head, batches)
    workers = min(workers, len(head))
    with open(tmp, "wb") as f:
        if workers <= 1:  # one batch: starting processes would cost more than it saves
            for b in batches:
                written += f.write(_tokenize_batch(b))
            return written
        import multiprocessing as mp

        # fork: the workers inherit the loaded tokenizer (_WORKER) instead of loading it again; the parent has not
        # encoded anything yet, so the tokenizers library's thread pool is not running at the fork
        ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
        with ctx.Pool(workers, initializer=_worker_init) as pool:
            pending: deque = deque()
            for b in batches:
                pending.append(pool.apply_async(_tokenize_batch, (b,)))
                if len(pending) >= 2 * workers:
                    written += f.write(pending.popleft().get())
            while pending:
                written += f.write(pending.popleft().get())
    return written


def prepare(inputs: list[str], out: str, tokenizer: str | None = None, eot: bool = True,
            eot_token: str | None = None, pattern: str = "*", force: bool = False, field: str = "text",
            split: str | None = None, workers: int | None = None, streaming: bool = False) -> dict:
    """Tokenize documents into one token file plus a ``.json`` sidecar.

    Documents (``input_kind``): a text file is one; a JSONL line's ``field``, a Parquet row's ``field`` column and
    a saved dataset's ``field`` are one each.  With ``eot`` each document ends with the end-of-text token:
    ``BYTE_EOT`` (256) at byte level, else ``eot_token``, the tokenizer's eos, or the first of EOT_NAMES it knows.
    ``tokenizer``: a tokenizers JSON file or a tokenizer directory (``_Tok``).  Tokenized in batches over
    ``workers`` processes (default: every core); the bytes written never depend on ``workers``.  An input or
    ``tokenizer`` that is no local path is a Hub id, resolved through the Hugging Face cache (dettrain/hub.py);
    ``streaming`` reads a Hub dataset row by row (``load_dataset(..., streaming=True)``: data larger than memory).

    The sidecar records dtype, vocab_size (what ``model.vocab_size=0`` reads), n_tokens, eot_id, bos_id, eos_id,
    pad_id (null where the tokenizer has none), tokenizer (absolute path or null), tokenizer_sha256, n_documents
    and the inputs.  ``check_output`` says which ``out`` is refused; ``force`` overwrites a file prepare did not
    write."""
    from dettrain.progress import Progress

    if not str(out).strip():
        raise UserError("--out is empty; name the token file to write (e.g. --out tokens.bin)")
    files = expand_inputs(inputs, pattern)
    outp = Path(out)
    check_output(files, inputs, outp, force)
    cores = max(1, os.cpu_count() or 1)
    if workers is not None and workers < 1:
        raise UserError(f"--workers {workers}: give 1 or more worker processes (default: every core)")
    workers = cores if workers is None else min(workers, cores)  # more processes than cores only add overhead
    ids: dict = {"bos_id": None, "eos_id": None, "pad_id": None}
    ident: dict = {"tokenizer": None}
    tok = None
    if tokenizer:
        if not is_local(tokenizer):  # a Hub id: the tokenizer files of its snapshot in the Hugging Face cache
            tokenizer = str(resolve(tokenizer, "--tokenizer", TOKENIZER_FILES))
        tok = _Tok(tokenizer)
        if not tok.encode([PROBE_TEXT])[0]:  # before any input is read: a tokenizer with no vocabulary
            raise UserError(_encodes_to_nothing(tok, PROBE_TEXT))
        vocab = tok.vocab_size
        ids = {"bos_id": tok.special("bos", BOS_NAMES), "eos_id": tok.special("eos", EOT_NAMES),
               "pad_id": tok.special("pad", PAD_NAMES)}
        eot_id = None
        if eot:
            names = [eot_token] if eot_token else list(EOT_NAMES)
            eot_id = tok.token_id(eot_token) if eot_token else ids["eos_id"]
            if eot_id is None:
                raise UserError(f"tokenizer {tokenizer} has none of the end-of-text tokens {names}; name it with "
                                "--eot-token TOKEN, or pass --no-eot to concatenate documents without one")
            ids["eos_id"] = eot_id  # the id that ends every document is the data's eos
        ident = tok.identity()
    else:
        vocab = 257 if eot else 256
        eot_id = BYTE_EOT if eot else None
        ids["eos_id"] = eot_id
    dtype = "uint8" if vocab <= 256 else "uint16" if vocab <= 65536 else "uint32"
    _WORKER.update(tok=tok, eot=eot_id, dtype=_DTYPES[dtype])
    counted = {"docs": 0}
    prog = Progress("prepare", unit="documents")

    def counting(it: Iterator) -> Iterator:
        for d in it:
            counted["docs"] += 1
            prog.update(1)
            yield d

    docs = counting(_documents(files, field, split, raw_bytes=tok is None, streaming=streaming))
    if tok is None:
        workers = 1  # byte level: the bytes are the ids, copying them to other processes is all they would do
    written = {"bytes": 0}

    def write(t: Path) -> None:
        written["bytes"] = _write_tokens(t, _batches(docs), workers)
        if counted["docs"] == 0:  # refused before the rename: an earlier output stays as it was
            raise UserError(f"the inputs {inputs} hold no documents (an empty JSONL, Parquet or dataset?)")

    try:
        outp.parent.mkdir(parents=True, exist_ok=True)
        _replace_atomically(outp, write)
        n_tokens = written["bytes"] // np.dtype(_DTYPES[dtype]).itemsize
        meta = {"dtype": dtype, "vocab_size": vocab, "n_tokens": int(n_tokens), "eot_id": eot_id, **ids, **ident,
                "n_documents": counted["docs"], "inputs": inputs, "glob": pattern, "field": field}
        if split is not None:
            meta["split"] = split
        _replace_atomically(sidecar(outp), lambda t: t.write_text(json.dumps(meta, indent=1)))
        prog.close()
    except OSError as e:
        raise UserError(f"cannot write the token file {outp}: {e.strerror or e}; choose a writable --out") from None
    finally:
        _WORKER.clear()
        prog.close(ok=False)  # after a failure: end a terminal's bar line, no done line
    return meta


def _first(e: BaseException) -> str:
    return (str(e).splitlines() or [type(e).__name__])[0][:200]


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

