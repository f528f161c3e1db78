"""Tokenize text files or directories into a token file for ``data.path``.

    python -m dettrain.data prepare FILES|DIRS... --out tokens.bin [--tokenizer tokenizer.json] [--glob PATTERN]
                                    [--eot-token TOKEN] [--no-eot] [--force]
    dettrain prepare ...  (the same)

One document per file (directories walked recursively in sorted path order), each followed by an end-of-text token
unless --no-eot; byte level without --tokenizer.  A ``.json`` sidecar beside the output records the dtype and the
vocabulary size (``model.vocab_size=0`` reads it).  The work is ``dettrain.data.prepare``; this is its command line.

It never writes over its inputs: an ``--out`` that is an input file or lies inside an input directory is refused,
and so is an existing file it did not write itself (``--force`` overwrites that one).  The token file and its
sidecar are written to temporary files and renamed into place, so a failure leaves nothing half-written.

Exit status: 0 written, 2 bad input (a missing or non-JSON tokenizer file, no input files, a file that is not UTF-8,
an --out refused as above ...).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dettrain.data import EOT_NAMES, prepare
from dettrain.errors import UserError

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dettrain.data", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="tokenize text files or directories into a token file for data.path")
    p.add_argument("inputs", nargs="+", help="files and directories (walked recursively in sorted path order), "
                   "one document per file, concatenated in the order given")
    p.add_argument("--out", required=True, help="output token file (a .json sidecar is written beside it)")
    p.add_argument("--tokenizer", default=None, help="Hugging Face tokenizers JSON (default: byte-level)")
    p.add_argument("--glob", default="*", help="file name pattern inside directories (default: every file)")
    p.add_argument("--eot-token", default=None, help="the tokenizer's end-of-text token (default: the first of "
                   f"{', '.join(EOT_NAMES)} it has)")
    p.add_argument("--no-eot", action="store_true", help="no end-of-text token between documents (byte level: "
                   "vocabulary 256 and uint8 instead of 257 and uint16)")
    p.add_argument("--force", action="store_true", help="overwrite an existing --out that prepare did not write "
                   "(an input file is never overwritten)")
    args = ap.parse_args(argv)
    if args.tokenizer and not Path(args.tokenizer).is_file():
        print(f"error: tokenizer file {args.tokenizer!r} does not exist", file=sys.stderr)
        return 2
    try:
        meta = prepare(args.inputs, args.out, args.tokenizer, eot=not args.no_eot, eot_token=args.eot_token,
                       pattern=args.glob, force=args.force)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    eot = f", end-of-text id {meta['eot_id']}" if meta["eot_id"] is not None else ""
    print(f"wrote {meta['n_tokens']} tokens of {meta['n_documents']} documents ({meta['dtype']}, vocab "
          f"{meta['vocab_size']}{eot}) to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
