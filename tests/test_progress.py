"""Progress people can read: plain lines in a log, a bar on a terminal, elapsed time and ETA on the step line."""

from __future__ import annotations

import io
import re

from conftest import train

from dettrain.progress import Progress, duration, eta


class Terminal(io.StringIO):
    """A stream that says it is a terminal, as sys.stderr does in an interactive shell."""

    def isatty(self) -> bool:
        return True


def test_duration_and_eta():
    assert [duration(s) for s in (4.24, 185, 7620)] == ["4.2s", "3m05s", "2h07m"]
    assert eta(0, 10, 5.0) is None
    assert eta(2, 10, 4.0) == 16.0 and eta(10, 10, 4.0) == 0.0


def test_a_log_gets_a_line_per_tenth_and_a_done_line(monkeypatch):
    monkeypatch.delenv("DETTRAIN_PROGRESS", raising=False)
    out = io.StringIO()
    with Progress("export", total=20, unit="tensor", stream=out) as p:
        for _ in range(20):
            p.update(1)
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert len(lines) == 10, lines  # 10%, 20%, ... 90%, then done
    assert lines[0].startswith("export: 2/20 tensor (10%), elapsed ") and ", eta " in lines[0]
    assert lines[-1].startswith("export: done, 20 tensor in ")


def test_a_terminal_gets_a_bar_redrawn_in_place(monkeypatch):
    monkeypatch.delenv("DETTRAIN_PROGRESS", raising=False)
    out = Terminal()
    with Progress("prepare", total=5, unit="doc", stream=out) as p:
        for _ in range(5):
            p.update(1)
    text = out.getvalue()
    assert "\r" in text and text.count("\n") == 1 and "5/5" in text, text
    monkeypatch.setenv("DETTRAIN_PROGRESS", "off")
    quiet = Terminal()
    with Progress("prepare", total=5, stream=quiet) as p:
        p.update(5)
    assert quiet.getvalue() == ""


def test_the_step_line_shows_elapsed_time_and_eta(tmp_path):
    p = train(tmp_path / "r", "train.steps=4", "log.every=1")
    lines = [ln for ln in (p.stdout + p.stderr).splitlines() if re.match(r"step +\d+ \(\d+/4\)", ln)]
    assert len(lines) == 4, p.stdout[-3000:]
    assert all(re.search(r"\| elapsed \d+\.\ds \| eta \d+\.\ds$", ln) for ln in lines), lines
    assert lines[-1].endswith("| eta 0.0s")
