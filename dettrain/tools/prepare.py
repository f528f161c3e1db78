"""Tokenize text files, JSONL, Parquet or a saved dataset into a token file for ``data.path``.

    python -m dettrain.data prepare INPUTS... --out tokens.bin [--tokenizer FILE|DIR|ID] [--field text] [--split S]
                                    [--workers N] [--glob PATTERN] [--eot-token TOKEN] [--no-eot] [--force]
                                    [--streaming]
    dettrain prepare ...  (the same)

Inputs, in the order given (directories walked recursively in sorted path order, names matching --glob): a text
file is one document; a ``.jsonl``/``.ndjson`` file one document per line (its --field, default ``text``); a
``.parquet`` file one per row (the --field column, needs pyarrow); a directory written by
``datasets.Dataset.save_to_disk`` one per row (needs datasets; --split picks a DatasetDict's split, default train).
An input that is no local path is a Hub dataset id (``org/name``): its snapshot in the Hugging Face cache
(``HF_HOME``, ``HF_HUB_OFFLINE`` honoured; downloaded when online), read by ``datasets.load_dataset``, one document
per row of --split (default train); --streaming reads it row by row, for data larger than memory.
Each document ends with an end-of-text token unless --no-eot; byte level without --tokenizer.  --tokenizer is a
tokenizers JSON file, a tokenizer directory (``transformers.AutoTokenizer``, or its tokenizer.json without
transformers) or a Hub model id: the tokenizer of ``model.pretrained=ID``, resolved the same way.  Documents
are tokenized in batches over --workers processes (default: every core); the output is the same bytes whatever
the worker count.

A ``.json`` sidecar beside the output records the dtype, the vocabulary size (``model.vocab_size=0`` reads it),
``eot_id``, the tokenizer's ``bos_id``/``eos_id``/``pad_id`` and the ``tokenizer`` (absolute path, with its
sha256; null at byte level).  The work is ``dettrain.data.prepare``; this is its command line.

It never writes over its inputs: an ``--out`` that is an input file or lies inside an input directory is refused,
and so is an existing file it did not write itself (``--force`` overwrites that one).  The token file and its
sidecar are written to temporary files and renamed into place, so a failure leaves nothing half-written.

Exit status: 0 written, 2 bad input (a missing or unreadable tokenizer, no input files, a file that is not UTF-8,
a JSONL line or Parquet file without --field, an --out refused as above ...).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dettrain.data import EOT_NAMES, prepare
from dettrain.errors import UserError
from dettrain.hub import is_local

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dettrain.data", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="tokenize text, JSONL, Parquet or a saved dataset into a token file")
    p.add_argument("inputs", nargs="+", help="files and directories (walked recursively in sorted path order), "
                   "concatenated in the order given: a text file is one document, a .jsonl line or .parquet row "
                   "one each, a saved datasets directory or a Hub dataset id (org/name) one per row")
    p.add_argument("--out", required=True, help="output token file (a .json sidecar is written beside it)")
    p.add_argument("--tokenizer", default=None, help="a tokenizers JSON file, a tokenizer directory "
                   "(AutoTokenizer) or a Hub model id from the Hugging Face cache (default: byte level)")
    p.add_argument("--field", default="text", help="the text field of JSONL objects, Parquet files and datasets "
                   "(default: text)")
    p.add_argument("--split", default=None, help="the split of a saved DatasetDict (default: train)")
    p.add_argument("--workers", type=int, default=None, help="tokenizer processes (default: every core; the "
                   "output is the same whatever the number)")
    p.add_argument("--glob", default="*", help="file name pattern inside directories (default: every file)")
    p.add_argument("--eot-token", default=None, help="the tokenizer's end-of-text token (default: the first of "
                   f"{', '.join(EOT_NAMES)} it has)")
    p.add_argument("--no-eot", action="store_true", help="no end-of-text token between documents (byte level: "
                   "vocabulary 256 and uint8 instead of 257 and uint16)")
    p.add_argument("--streaming", action="store_true", help="read Hub datasets row by row (load_dataset "
                   "streaming=True): data larger than memory or disk's datasets cache")
    p.add_argument("--force", action="store_true", help="overwrite an existing --out that prepare did not write "
                   "(an input file is never overwritten)")
    args = ap.parse_args(argv)
    if args.tokenizer and is_local(args.tokenizer) and not Path(args.tokenizer).exists():
        print(f"error: tokenizer {args.tokenizer!r} does not exist; pass a tokenizer.json file or a tokenizer "
              "directory (save_pretrained)", file=sys.stderr)
        return 2
    try:
        meta = prepare(args.inputs, args.out, args.tokenizer, eot=not args.no_eot, eot_token=args.eot_token,
                       pattern=args.glob, force=args.force, field=args.field, split=args.split,
                       workers=args.workers, streaming=args.streaming)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    eot = f", end-of-text id {meta['eot_id']}" if meta["eot_id"] is not None else ""
    print(f"wrote {meta['n_tokens']} tokens of {meta['n_documents']} documents ({meta['dtype']}, vocab "
          f"{meta['vocab_size']}{eot}) to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
