"""The step observers (dettrain/loop/observers.py) keep the ledger's order and the exit code when two checks fire at
one step: the step line, the live check's divergence event, then the non_finite event, and the run stops with the
non-finite status (4) rather than the live check's (3).  Real LiveCheck, real LedgerWriter, one process (world 1:
the live check's broadcast is the identity there)."""

from __future__ import annotations

import math

import pytest
import torch

from dettrain import dist as D
from dettrain.config import Config, to_container
from dettrain.errors import UserError
from dettrain.loop.nonfinite import EXIT_NON_FINITE, NonFiniteStop
from dettrain.loop.observers import CheckFinite, CheckReference, Step, WriteLedger, exit_code
from dettrain.record.ledger import LEDGER_NAME, LedgerWriter, f32_bits, parse_lines
from dettrain.record.reference import EXIT_DIVERGED, DivergenceStop, LiveCheck

HEALTHY = {"kind": "step", "step": 0, "loss": 5.5, "loss_bits": f"{f32_bits(5.5):08x}", "batch": "0" * 15 + "1",
           "grad": "0" * 15 + "2", "param": "0" * 15 + "3", "opt": "0" * 15 + "4", "lr": 1e-3, "grad_norm": 1.0}


def _run(tmp_path, line: dict) -> tuple[Step, list[dict]]:
    """One step ``line`` through the checks and the ledger writer against a reference holding HEALTHY."""
    cfg = Config()
    cfg.det.reference = str(tmp_path / "ref")
    cfg.det.on_divergence = "stop"
    cfg_dict = to_container(cfg)
    ref = LedgerWriter(tmp_path / "ref" / LEDGER_NAME, {"config": cfg_dict})
    ref.write(HEALTHY)
    ref.close()
    info = D.DistInfo(rank=0, world=1, local_rank=0, device=torch.device("cpu"), backend=None)
    run = tmp_path / "run"
    observers = [CheckReference(LiveCheck(cfg, info, run, cfg_dict)), CheckFinite(cfg),
                 WriteLedger(LedgerWriter(run / LEDGER_NAME, {"config": cfg_dict}))]
    step = Step(dict(line), micro=[], started=0.0, seconds=1.0, compiling=False)
    for obs in observers:
        obs.on_step(step)
    for obs in reversed(observers):
        obs.close(exit_code(step.stop))
    return step, parse_lines(run / LEDGER_NAME)[1:]


def test_non_finite_and_divergent_at_one_step_records_both_and_stops_with_4(tmp_path):
    nan = float("nan")
    step, lines = _run(tmp_path, {**HEALTHY, "loss": nan, "loss_bits": f"{f32_bits(nan):08x}", "param": "f" * 16})
    assert [x.get("event", x["kind"]) for x in lines] == ["step", "divergence", "non_finite"]
    assert lines[0]["step"] == lines[1]["step"] == lines[2]["step"] == 0 and math.isnan(lines[0]["loss"])
    assert isinstance(step.stop, NonFiniteStop) and exit_code(step.stop) == EXIT_NON_FINITE == 4


def test_divergence_alone_stops_with_3_and_a_healthy_step_not_at_all(tmp_path):
    step, lines = _run(tmp_path / "a", {**HEALTHY, "param": "f" * 16})
    assert [x.get("event", x["kind"]) for x in lines] == ["step", "divergence"]
    assert isinstance(step.stop, DivergenceStop) and exit_code(step.stop) == EXIT_DIVERGED == 3
    step, lines = _run(tmp_path / "b", HEALTHY)
    assert lines == [HEALTHY] and step.stop is None and exit_code(None) == 0


@pytest.mark.parametrize("stop,code", [(UserError("bad model"), 2), (DivergenceStop("x"), 3),
                                       (NonFiniteStop("x", {}), 4)])
def test_exit_code_of_each_agreed_stop(stop, code):
    assert exit_code(stop) == code
