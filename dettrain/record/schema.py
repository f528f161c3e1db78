"""The fingerprint fields of a ledger step line, declared once.

``FIELDS`` lists them in the order a step computes them (data -> loss -> gradients -> parameters -> optimizer
state), which is the order ``dettrain diff`` reads a divergence in.  Each field says its JSON key, the label and
width of its column in diff's table, the stage it stands for, its kind (how many hex digits), where the trainer
takes it (``SOURCES``), diff's likely cause when it differs first, and the title of its panel.  Everything that
lists the fields follows this tuple, read when used: the trainer's step line (loop/step_record.py) and its
progress line, the library's ``StepLedger``, the ledger reader (ledger.py), the live reference check, ``diff``,
the wandb mirror (``fp/<key>``, ``fp24/<key>``), ``panel`` and ``trace``.

A new fingerprint field is one more ``Field`` here.  Its source is a function of the step line (the line's other
values; the same on every rank), or a step value a producer already hands over: the token batch, the loss, or an
engine partial named by the key (a new engine partial is the engine's own code too).  Give it ``required=False``,
so ledgers written before it still read.  This module imports nothing from the loop.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

MASK64 = (1 << 64) - 1

# source -> where the trainer (loop/step_record.py) and StepLedger (api.py) take the value
SOURCES = {
    "tokens": "the step's global batch of token ids (each micro-batch hashed where it is used)",
    "loss": "the fp32 bit pattern of the step's agreed mean loss",
    "reduced": "the engine's partial named by the key, of the reduced gradient before clipping",
    "updated": "the engine's partial named by the key, after the optimizer step",
}
# kind -> hex digits of its value in the ledger: a 64-bit fingerprint, or the 32 bits of an fp32 value
KINDS = {"fp64": 16, "bits32": 8}


@dataclass(frozen=True)
class Field:
    """One fingerprint field of a step line (see the module docstring)."""

    key: str  # the step line's JSON key; wandb logs fp/<key> and fp24/<key>
    label: str  # its column in diff's table
    width: int  # that column's width
    stage: str  # what it stands for, in reports: "gradients diverged first"
    kind: str  # a KINDS key
    source: str | Callable[[dict[str, Any]], int]  # a SOURCES key, or a function of the step line so far
    why: str  # the likely cause when this field is the first that differs
    panel: str  # the title of its fp24 line panel (dettrain panel)
    required: bool = False  # a step line without it is malformed (a later field is not: older ledgers lack it)
    progress: bool = False  # shown, 8 hex digits, on the trainer's progress line


FIELDS: tuple[Field, ...] = (
    Field("batch", "data", 5, "data", "fp64", "tokens",
          "the two runs fed different token batches (seed, data file, sample order, global batch)",
          "data (batch fingerprint, low 24 bits)", required=True),
    Field("loss_bits", "loss", 4, "loss", "bits32", "loss",
          "same batch and parameters, different forward result (kernels, precision, threads, model config)",
          "loss (fp32 bits, low 24)", required=True),
    Field("grad", "grad", 4, "gradients", "fp64", "reduced",
          "same loss, different reduced gradient (backward kernels, reduction order, world size, tier)",
          "gradients (low 24 bits)", required=True),
    Field("param", "param", 5, "parameters", "fp64", "updated",
          "same gradient, different update (learning rate, schedule, clipping, optimizer settings)",
          "parameters (low 24 bits)", required=True, progress=True),
    Field("opt", "opt", 4, "optimizer state", "fp64", "updated",
          "same parameters, different optimizer moments (betas, eps, optimizer state)",
          "optimizer state (low 24 bits)"),
)


def keys() -> tuple[str, ...]:
    """The fields' keys, in the order a step computes them."""
    return tuple(f.key for f in FIELDS)


def stage_names() -> dict[str, str]:
    """{key: stage}, in the order a step computes them."""
    return {f.key: f.stage for f in FIELDS}


def field(key: str) -> Field:
    return next(f for f in FIELDS if f.key == key)


def from_source(source: str) -> tuple[str, ...]:
    """The keys of the fields taken from ``source`` (a SOURCES key): for "reduced" and "updated", the engine
    partials a step takes there."""
    return tuple(f.key for f in FIELDS if f.source == source)


def f32_bits(x: float) -> int:
    """The fp32 bit pattern of ``x``."""
    return struct.unpack("<I", struct.pack("<f", x))[0]


def hex_value(f: Field, v: int) -> str:
    """A field's value as the ledger writes it: lowercase hex of its kind's width."""
    digits = KINDS[f.kind]
    return f"{v & ((1 << 4 * digits) - 1):0{digits}x}"


def step_line(step: int, loss: float, values: dict[str, int], after: dict[str, Any]) -> dict[str, Any]:
    """A step line: kind, step, loss, the fields taken from the loss, every other field in ``FIELDS`` order, then
    ``after`` (lr, grad_norm, a user's own fields).  ``values``: the int of each field whose source is a step value
    (a missing one is 0, the fingerprint of nothing); a field whose source is a function gets it from the line
    (``after`` included)."""
    rec: dict[str, Any] = {"kind": "step", "step": step, "loss": loss}
    for f in FIELDS:
        if f.source == "loss":
            rec[f.key] = hex_value(f, f32_bits(loss))
    for f in FIELDS:
        if f.source == "loss":
            continue
        v = f.source({**rec, **after}) if callable(f.source) else values.get(f.key, 0)
        rec[f.key] = hex_value(f, v)
    rec.update(after)
    return rec
