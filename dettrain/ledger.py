"""The run ledger: ``ledger.jsonl``, one JSON object per line, appended and flushed every step.

Line 1 is the header (``"kind": "header"``): config, config hash, versions, devices, world size, tier, audit.
Then one line per optimizer step (``"kind": "step"``) with at least::

    step       optimizer step index (0-based)
    loss       global mean loss of the step (fp32 value as a JSON number, exact)
    loss_bits  the fp32 loss bit pattern, 8 hex digits
    batch      fingerprint of the step's global batch of token ids (16 hex digits)
    grad       fingerprint of the reduced gradient, before clipping, in the canonical flat layout
    param      fingerprint of the parameters after the update
    opt        fingerprint of the optimizer state after the update (exp_avg then exp_avg_sq)
    lr, grad_norm

and, every ``log.tensor_every`` steps, ``tensors``: {"grad": {name: fp}, "param": {name: fp}}.  Other line kinds
(``"kind": "event"``: resume, divergence, ...) may appear; readers skip what they do not know.  Lines hold no wall
times, so two identical runs write identical ledgers byte for byte.

A crash can leave a torn last line: every reader here ignores an unparsable *last* line (and only the last).
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

LEDGER_NAME = "ledger.jsonl"
FP_FIELDS = ("batch", "loss_bits", "grad", "param", "opt")


def f32_bits(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


class LedgerWriter:
    """Appends lines and flushes + fsyncs each, so a crash loses at most the line being written."""

    def __init__(self, path: Path, header: dict | None, resume_step: int | None = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is not None and self.path.exists():
            truncate_after(self.path, resume_step)
            self._f = open(self.path, "a", encoding="utf-8")
        else:
            self._f = open(self.path, "w", encoding="utf-8")
            if header is not None:
                self.write({"kind": "header", **header})

    def write(self, obj: dict) -> None:
        self._f.write(json.dumps(obj, sort_keys=False, separators=(",", ":")) + "\n")
        self._f.flush()
        os.fsync(self._f.fileno())

    def close(self) -> None:
        self._f.close()


def _parse_lines(path: Path) -> list[dict]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise ValueError(f"cannot read ledger {path}: {e.strerror}") from e
    raw = text.split("\n")
    if raw and raw[-1] == "":
        raw.pop()
    out = []
    for i, line in enumerate(raw):
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError as e:
            if i == len(raw) - 1:
                break  # torn last line after a crash: tolerated
            raise ValueError(f"{path}: line {i + 1} is not valid JSON ({e.msg}); the ledger is corrupt") from e
    return out


def read_ledger(path: str | Path) -> tuple[dict, list[dict]]:
    """(header, step lines) of a ledger file or run dir; raises ValueError with the path on bad input."""
    p = Path(path)
    if p.is_dir():
        p = p / LEDGER_NAME
    if not p.is_file():
        raise ValueError(f"no ledger at {p}: pass a run dir that holds {LEDGER_NAME} or a ledger file")
    lines = _parse_lines(p)
    if not lines or lines[0].get("kind") != "header":
        raise ValueError(f"{p}: first line is not a dettrain ledger header")
    steps = [x for x in lines[1:] if x.get("kind") == "step"]
    return lines[0], steps


def truncate_after(path: Path, resume_step: int) -> None:
    """Keep the header, events and step lines < resume_step (dropping a torn last line); atomic rewrite."""
    lines = _parse_lines(path)
    keep = [x for x in lines if x.get("kind") != "step" or x["step"] < resume_step]
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for x in keep:
            f.write(json.dumps(x, separators=(",", ":")) + "\n")
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)
