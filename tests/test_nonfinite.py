"""A non-finite loss or gradient norm stops every rank at that step (nonfinite.py): exit 4, a message naming the
step and the usual suspects, the ledger intact with the step line and then a non_finite event."""

from __future__ import annotations

import json
import math

import pytest
from conftest import train

from dettrain.loop.nonfinite import EXIT_NON_FINITE
from dettrain.record.ledger import LEDGER_NAME, read_ledger


@pytest.mark.parametrize("nproc,tier,overlap", [(1, 3, False), (2, 4, False), (2, 2, False), (1, 3, True),
                                               (2, 4, True)])
def test_huge_learning_rate_stops_every_rank_at_the_first_non_finite_step(tmp_path, nproc, tier, overlap):
    """... also with train.overlap_steps=true, where the next step's first micro-batch is already queued when the
    non-finite line is read: it is dropped, and the record is the same."""
    d = tmp_path / "run"
    p = train(d, "train.lr=1e30", "train.steps=8", f"det.tier={tier}", f"train.overlap_steps={str(overlap).lower()}",
              nproc=nproc, check=False, timeout=300)
    lines = [json.loads(x) for x in (d / LEDGER_NAME).read_text().splitlines()]
    (ev,) = [x for x in lines if x.get("event") == "non_finite"]
    k = ev["step"]
    assert lines[-1] == ev and lines[-2]["kind"] == "step" and lines[-2]["step"] == k  # step line, then the event
    _, steps = read_ledger(d)
    assert [s["step"] for s in steps] == list(range(k + 1)) and k < 7
    last = steps[-1]
    assert not (math.isfinite(last["loss"]) and math.isfinite(last["grad_norm"]))
    assert all(math.isfinite(s["loss"]) and math.isfinite(s["grad_norm"]) for s in steps[:-1])
    if nproc == 1:
        assert p.returncode == EXIT_NON_FINITE == 4
        assert "Traceback" not in p.stderr, p.stderr[-3000:]
    else:  # torchrun exits 1 (its own ChildFailedError traceback) and names the first worker's status: 4.  Once
        # one rank has exited torchrun stops the rest, so how many more report 4 themselves is a race
        assert p.returncode != 0
        assert f"exitcode: {EXIT_NON_FINITE} " in p.stderr.replace("exitcode  :", "exitcode:"), p.stderr[-3000:]
    for needle in (f"at step {k}", "train.lr=1e+30", "optim.eps", "optim.clip_grad_norm"):
        assert needle in p.stderr, (needle, p.stderr[-2000:])
