"""``python -m dettrain.data prepare INPUTS... --out tokens.bin``: documents to a token file for ``data.path``.

Each document (documents.py) is followed by an end-of-text token (id 256 at byte level, so byte-level files have
vocabulary 257; the tokenizer's eos otherwise), tokenized in batches over worker processes with the same bytes for
any worker count.  Its ``.json`` sidecar records the vocabulary size, which ``model.vocab_size=0`` takes, and the
tokenizer's bos/eos/pad ids and identity.  ``prepare`` here does the work; the command line is
dettrain/tools/prepare.py (``python -m dettrain.data`` runs it: dettrain/data/__main__.py).  It never writes over an
input or a file it did not write (``check_output``), and writes through temporary files removed on any failure.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from dettrain.data.documents import expand_inputs, read_documents
from dettrain.data.fingerprint import file_fingerprint
from dettrain.data.tokens import TOKEN_DTYPES, sidecar
from dettrain.errors import UserError, first_line, replace_atomically
from dettrain.hub import TOKENIZER_FILES, is_local, resolve

BYTE_EOT = 256
"""End-of-text token of byte-level token files: the first id past the 256 byte values (vocabulary 257, stored as
uint16), so it can never be confused with a byte of a document."""
EOT_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[EOS]")
"""Tokens looked up, in this order, as a tokenizer's end-of-text token (override with --eot-token)."""

BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>", "[BOS]", "[CLS]")
PAD_NAMES = ("<pad>", "<|pad|>", "[PAD]", "<|finetune_right_pad_id|>")
"""Tokens looked up, in this order, as a tokenizers-JSON tokenizer's bos and pad tokens (recorded in the sidecar
for export; an AutoTokenizer directory names its own)."""
PROBE_TEXT = "Hello world 123"
"""Encoded once at load: a tokenizer that gives no tokens for it has no vocabulary."""
BATCH_DOCS, BATCH_CHARS = 256, 1 << 20
"""Documents are tokenized in batches of up to BATCH_DOCS documents or BATCH_CHARS characters (whichever fills
first), cut in document order by the parent process: the batches never depend on --workers."""


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
                                    f"({first_line(e)}); pass a directory written by save_pretrained, or a "
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
            raise UserError(f"tokenizer {spec} is not a Hugging Face tokenizers JSON file ({first_line(e)}); pass "
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


def _made_by_prepare(out: Path) -> bool:
    """``out`` is a token file ``prepare`` wrote: its sidecar is prepare's and agrees with the file's size."""
    try:
        meta = json.loads(sidecar(out).read_text())
        return (isinstance(meta, dict) and meta.get("dtype") in TOKEN_DTYPES and isinstance(meta.get("n_tokens"), int)
                and out.stat().st_size == meta["n_tokens"] * np.dtype(TOKEN_DTYPES[meta["dtype"]]).itemsize)
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
    _WORKER.update(tok=tok, eot=eot_id, dtype=TOKEN_DTYPES[dtype])
    counted = {"docs": 0}
    prog = Progress("prepare", unit="documents")

    def counting(it: Iterator) -> Iterator:
        for d in it:
            counted["docs"] += 1
            prog.update(1)
            yield d

    docs = counting(read_documents(files, field, split, raw_bytes=tok is None, streaming=streaming))
    if tok is None:
        workers = 1  # byte level: the bytes are the ids, copying them to other processes is all they would do
    written = {"bytes": 0}

    def write(t: Path) -> None:
        written["bytes"] = _write_tokens(t, _batches(docs), workers)
        if counted["docs"] == 0:  # refused before the rename: an earlier output stays as it was
            raise UserError(f"the inputs {inputs} hold no documents (an empty JSONL, Parquet or dataset?)")

    try:
        outp.parent.mkdir(parents=True, exist_ok=True)
        replace_atomically(outp, write)
        n_tokens = written["bytes"] // np.dtype(TOKEN_DTYPES[dtype]).itemsize
        meta = {"dtype": dtype, "vocab_size": vocab, "n_tokens": int(n_tokens), "eot_id": eot_id, **ids, **ident,
                "n_documents": counted["docs"], "inputs": inputs, "glob": pattern, "field": field}
        if split is not None:
            meta["split"] = split
        replace_atomically(sidecar(outp), lambda t: t.write_text(json.dumps(meta, indent=1)))
        prog.close()
    except OSError as e:
        raise UserError(f"cannot write the token file {outp}: {e.strerror or e}; choose a writable --out") from None
    finally:
        _WORKER.clear()
        prog.close(ok=False)  # after a failure: end a terminal's bar line, no done line
    return meta
