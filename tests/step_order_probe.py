"""`python -m dettrain` that writes, as JSON lines to $STEP_ORDER_LOG, the order in which the trainer queues each
micro-batch (``seed_micro_batch(seed, step, index)``, called once per micro-batch before its forward) and reads each
step line (``StepRecorder.line``, the step's one host sync).  tests/test_overlap_steps.py reads it to check where
train.overlap_steps queues the next step's first micro-batch."""

from __future__ import annotations

import json
import os
import runpy
import sys

import dettrain.loop.trainer as trainer
from dettrain.loop import step_record

_log = open(os.environ["STEP_ORDER_LOG"], "a", encoding="utf-8")  # noqa: SIM115 - open for the whole run
_seed = trainer.seed_micro_batch
_line = step_record.StepRecorder.line


def seed_micro_batch(seed, step, index):
    _log.write(json.dumps(["micro", step, index]) + "\n")
    _log.flush()
    return _seed(seed, step, index)


def line(self, *args, **kwargs):
    _log.write(json.dumps(["line", self.step]) + "\n")
    _log.flush()
    return _line(self, *args, **kwargs)


trainer.seed_micro_batch = seed_micro_batch
step_record.StepRecorder.line = line
sys.argv = ["dettrain", *sys.argv[1:]]
runpy.run_module("dettrain", run_name="__main__", alter_sys=True)
