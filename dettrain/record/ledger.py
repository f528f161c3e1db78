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

and, every ``log.tensor_every`` steps, ``tensors``: {"grad": {name: fp}, "param": {name: fp}}; after the steps
that evaluate (``eval.every``), ``val_loss`` (the validation loss of the updated model, fp32 value) and
``val_loss_bits`` (its bit pattern, 8 hex digits) on the step line itself, so truncating, resuming and every step
reader handle them with the step.  Other line kinds
(``"kind": "event"``: resume, divergence, ...) may appear; readers skip what they do not know.  Lines hold no wall
times, so two identical runs write identical ledgers byte for byte.

The fingerprint fields (loss_bits, batch, grad, param, opt) are declared in schema.py, with their kinds, labels and
widths; a field declared there later is written, checked, compared and mirrored like these.

A crash can leave a torn last line: every reader here ignores an unparsable *last* line (and only the last).
Every other line must be a JSON object, and every step line must have the fields above with their types (``step``
an integer >= 0, ``loss`` a number, ``loss_bits`` 8 and the fingerprints 16 lowercase hex digits; ``opt``
and every field the schema does not mark required may be absent): ``read_ledger`` raises UserError naming the file
and line otherwise.

Comparing lines (``differing_fields``, ``ulps``, ``tensor_diff``, ``config_differences``) lives here too, so the diff
tool and the live reference check (reference.py) share one definition of "equal".
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from pathlib import Path
from typing import Any

from dettrain.errors import UserError, io_error
from dettrain.record import schema
from dettrain.record.schema import f32_bits  # noqa: F401  (imported from here by the loop, the API and trace)

LEDGER_NAME = "ledger.jsonl"
_HEX8 = re.compile(r"^[0-9a-f]{8}$")
_HEX = re.compile(r"^[0-9a-f]+$")


def __getattr__(name: str) -> Any:
    """FP_FIELDS (the fingerprint keys), STAGES ((key, stage) pairs) and STAGE_NAME ({key: stage}), in the order a
    step computes them: read from schema.FIELDS when asked, so they follow it."""
    if name == "FP_FIELDS":
        return schema.keys()
    if name == "STAGES":
        return tuple(schema.stage_names().items())
    if name == "STAGE_NAME":
        return schema.stage_names()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def step_error(rec: Any) -> str | None:
    """What is wrong with one step line (None when it has the fields and types readers rely on)."""
    if not isinstance(rec, dict):
        return f"a step line must be a JSON object, got {type(rec).__name__}"
    if "step" not in rec:
        return "step line without 'step'"
    st = rec["step"]
    if not isinstance(st, int) or isinstance(st, bool) or st < 0:
        return f"'step' must be an integer >= 0, got {json.dumps(st)[:40]}"
    if not _number(rec.get("loss")):
        return f"step {st}: 'loss' must be a number, got {json.dumps(rec.get('loss'))[:40]}"
    for kind in ("bits32", "fp64"):  # the loss's bits first, then the fingerprints, each in the schema's order
        for f in (f for f in schema.FIELDS if f.kind == kind and (f.required or f.key in rec)):
            v, digits = rec.get(f.key), schema.KINDS[kind]
            if isinstance(v, str) and len(v) == digits and _HEX.match(v):
                continue
            if kind == "bits32":
                return f"step {st}: '{f.key}' must be {digits} lowercase hex digits, got {json.dumps(v)[:40]}"
            what = "missing" if f.key not in rec else f"got {json.dumps(v)[:40]}"
            return f"step {st}: fingerprint '{f.key}' must be {digits} lowercase hex digits ({what})"
    for f in ("lr", "grad_norm", "val_loss"):
        if rec.get(f) is not None and not _number(rec[f]):
            return f"step {st}: '{f}' must be a number, got {json.dumps(rec[f])[:40]}"
    vb = rec.get("val_loss_bits")
    if ("val_loss" in rec) != ("val_loss_bits" in rec) or (vb is not None and not (isinstance(vb, str)
                                                                                and _HEX8.match(vb))):
        return f"step {st}: 'val_loss' and 'val_loss_bits' (8 lowercase hex digits) go together, got {json.dumps(vb)}"
    t = rec.get("tensors")
    if t is not None and not (isinstance(t, dict) and all(isinstance(x, dict) for x in t.values())):
        return f"step {st}: 'tensors' must be an object of {{kind: {{name: fingerprint}}}}"
    return None


class LedgerWriter:
    """Appends lines and fsyncs each, so a crash loses at most the line being written.

    A write that fails (no space left, quota, I/O error) is undone to the end of the last whole line before the
    error is raised as a UserError naming the file: the lines already there stay intact and readable, and the run
    can continue with ckpt.resume=auto once the disk has room."""

    def __init__(self, path: Path, header: dict | None, resume_step: int | None = None) -> None:
        self.path = Path(path)
        self._where = os.path.abspath(self.path)  # what _check_still_there stats, whatever the cwd becomes
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if resume_step is not None and self.path.exists():
                truncate_after(self.path, resume_step)
                self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
                header = None
            else:
                self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_TRUNC, 0o666)
        except OSError as e:
            raise _write_error(self.path, e) from None
        if header is not None:
            self.write({"kind": "header", **header})

    def write(self, obj: dict) -> None:
        data = (json.dumps(obj, sort_keys=False, separators=(",", ":")) + "\n").encode()
        self._check_still_there(obj)
        start = os.lseek(self._fd, 0, os.SEEK_END)
        try:
            view = memoryview(data)
            while view:  # os.write may write less than asked (a nearly full disk)
                view = view[os.write(self._fd, view):]
            os.fsync(self._fd)
        except OSError as e:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, start)  # drop the partial line: the file ends with a whole line again
            raise _write_error(self.path, e, obj.get("step") if obj.get("kind") == "step" else None) from None

    def _check_still_there(self, obj: dict) -> None:
        """The open file must still be the one at ``self.path``: a ledger deleted (``rm``) or replaced under a running
        job would take every further line with it, and the run would report success for a record that no longer
        exists.  Two stat calls per line (microseconds, no device sync); UserError naming the ledger."""
        mine = os.fstat(self._fd)
        try:
            there = os.stat(self._where)
            same = (there.st_ino, there.st_dev) == (mine.st_ino, mine.st_dev)
        except OSError:
            same = False
        if mine.st_nlink == 0 or not same:
            step = obj.get("step") if obj.get("kind") == "step" else None
            at = f" (at step {step}, which is not recorded)" if step is not None else ""
            raise UserError(f"the ledger {self.path} was deleted or replaced while this run was writing it{at}; the "
                            "run stops, as it can no longer keep its record. Restore the file and continue with "
                            "ckpt.resume=auto, or start afresh in another run_dir")

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _write_error(path: Path, e: OSError, step: int | None = None) -> UserError:
    err = io_error("write the ledger", path, e)
    if step is not None:
        err = UserError(f"{err} (at step {step}; the lines before it are intact: continue with ckpt.resume=auto "
                        "once the problem is fixed)")
    return err


def parse_lines(path: Path) -> list[dict]:
    """The parsed lines of a ledger file (a torn last line dropped); UserError naming the file and line."""
    return [x for _, x in _numbered_lines(path)]


def _numbered_lines(path: Path) -> list[tuple[int, Any]]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise UserError(f"cannot read ledger {path}: {e.strerror}") from e
    raw = text.split("\n")
    if raw and raw[-1] == "":
        raw.pop()
    out = []
    for i, line in enumerate(raw):
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            if i == len(raw) - 1:
                break  # torn last line after a crash: tolerated
            raise UserError(f"{path}: line {i + 1} is not valid JSON ({e.msg}); the ledger is corrupt") from e
        if not isinstance(obj, dict):
            raise UserError(f"{path}: line {i + 1} is not a JSON object (a {type(obj).__name__}); the ledger is "
                             "corrupt")
        out.append((i + 1, obj))
    return out


def torn_tail(path: Path) -> bool:
    """Whether the ledger's last line is torn (not JSON: a crash mid-write), which every reader drops."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(0, size - (1 << 20)))  # a step line is far shorter than 1 MiB
            tail = f.read().rstrip(b"\n").rsplit(b"\n", 1)[-1]
    except OSError:
        return False
    if not tail:
        return False
    try:
        json.loads(tail)
    except ValueError:
        return True
    return False


def read_ledger(path: str | Path) -> tuple[dict, list[dict]]:
    """(header, step lines) of a ledger file or run dir; raises UserError with the path on bad input."""
    p = Path(path)
    if p.is_dir():
        p = p / LEDGER_NAME
    if not p.is_file():
        raise UserError(f"no ledger at {p}: pass a run dir that holds {LEDGER_NAME} or a ledger file")
    lines = _numbered_lines(p)
    if not lines or lines[0][1].get("kind") != "header":
        raise UserError(f"{p}: first line is not a dettrain ledger header")
    steps = []
    for n, x in lines[1:]:
        if x.get("kind") != "step":
            continue  # events and kinds this reader does not know
        err = step_error(x)
        if err:
            raise UserError(f"{p}: line {n}: {err}; the ledger is malformed")
        steps.append(x)
    return lines[0][1], steps


def truncate_after(path: Path, resume_step: int) -> None:
    """Keep the header, events and step lines < resume_step (dropping a torn last line); atomic rewrite."""
    lines = parse_lines(path)
    keep = [x for x in lines if x.get("kind") != "step" or x["step"] < resume_step]
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            for x in keep:
                f.write(json.dumps(x, separators=(",", ":")) + "\n")
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(path)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink()  # the ledger itself is untouched: the rewrite goes through a temporary file
        raise _write_error(path, e) from None


# ---- comparing two ledgers' lines: shared by the diff tool (dettrain.diff) and the live check (det.reference) -----
def differing_fields(a: dict, b: dict) -> list[str]:
    """The step fingerprints that differ between two step lines, in the order the step computes them."""
    return [f for f in schema.keys() if a.get(f) != b.get(f)]


def _ordered(bits: int) -> int:
    """fp32 bits mapped to integers that are consecutive for consecutive floats (-0 and +0 both 0)."""
    return -(bits & 0x7FFFFFFF) if bits & 0x80000000 else bits


def _is_nan(bits: int) -> bool:
    return (bits & 0x7F800000) == 0x7F800000 and (bits & 0x007FFFFF) != 0


def ulps(bits_a: str | None, bits_b: str | None) -> int | None:
    """Distance in fp32 ULPs between two loss bit patterns (hex); None when unknown or NaN."""
    if bits_a is None or bits_b is None:
        return None
    a, b = int(bits_a, 16), int(bits_b, 16)
    if _is_nan(a) or _is_nan(b):
        return None
    return abs(_ordered(a) - _ordered(b))


def tensor_diff(a: dict, b: dict) -> dict[str, list[str]] | None:
    """{kind: names whose per-tensor fingerprints differ} at one step; None unless both lines have them."""
    ta, tb = a.get("tensors"), b.get("tensors")
    if not ta or not tb:
        return None
    out: dict[str, list[str]] = {}
    for kind in [k for k in ta if k in tb] + [k for k in tb if k not in ta]:
        x, y = ta.get(kind, {}), tb.get(kind, {})
        names = list(x) + [n for n in y if n not in x]  # the ledger's order (the model's layout)
        out[kind] = [n for n in names if x.get(n) != y.get(n)]
    return out


def flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts as {"a.b.c": leaf} (an empty dict below the top stays a leaf)."""
    if isinstance(d, dict):
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out if out or not prefix else {prefix[:-1]: {}}
    return {prefix[:-1]: d}


def config_differences(ha: dict, hb: dict) -> list[tuple[str, Any, Any]]:
    """(key, A, B) for every config key that differs between two headers (run_dir, which always does, left out)."""
    fa, fb = flatten(ha.get("config") or {}), flatten(hb.get("config") or {})
    keys = list(fa) + [k for k in fb if k not in fa]
    return [(k, fa.get(k), fb.get(k)) for k in keys if k != "run_dir" and fa.get(k) != fb.get(k)]
