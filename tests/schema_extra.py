"""A fingerprint field added in one place: ``EXTRA`` appended to record/schema.py's ``FIELDS`` (``install``).

Run as a script it trains as ``python -m dettrain`` does, with the field installed: ``SCHEMA_EXTRA_FLIP=K`` makes
its value differ from step K on (a run that parts from another in this field alone)."""

from __future__ import annotations

import os
import runpy
import sys

from dettrain.record import schema

FLIP = 0x5A5A5A5A5A5A5A5A  # what the value changes by from step SCHEMA_EXTRA_FLIP on


def value(line: dict, flip: int | None) -> int:
    """The field's value: a function of the step line (its parameter fingerprint and step), flipped from ``flip``."""
    v = int(line["param"], 16) ^ (line["step"] * 0x9E3779B97F4A7C15 & schema.MASK64)
    return v ^ FLIP if flip is not None and line["step"] >= flip else v


def extra_field(flip: int | None = None) -> schema.Field:
    return schema.Field("extra", "extra", 5, "extra stage", "fp64", lambda line: value(line, flip),
                        "the extra fingerprint differs (the test's own field)", "extra (low 24 bits)", progress=True)


def install(flip: int | None = None) -> None:
    schema.FIELDS = (*schema.FIELDS, extra_field(flip))


if __name__ == "__main__":
    flip = os.environ.get("SCHEMA_EXTRA_FLIP")
    install(None if flip is None else int(flip))
    sys.argv = ["dettrain", *sys.argv[1:]]
    runpy.run_module("dettrain", run_name="__main__", alter_sys=True)
