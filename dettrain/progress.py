"""Progress of long work (``prepare``, ``export``, ``to-torch``, ``trace``) and the durations of the step line.

On a terminal a bar redrawn in place (tqdm's when it is installed, else a one-line bar of our own); anywhere else
(a log file, a pipe, a batch job) plain lines, one at each tenth of the work and one at the end, so a log never
fills with carriage returns.  Both go to stderr: stdout stays for what a command prints as its result.
``DETTRAIN_PROGRESS=off`` silences them, ``=lines`` forces plain lines on a terminal too.

    with Progress("export", total=4, unit="stage") as p:
        p.update(1, "read checkpoint")
"""

from __future__ import annotations

import os
import sys
import time
from typing import IO, Any

__all__ = ["Progress", "duration", "eta"]


def duration(seconds: float) -> str:
    """``seconds`` as a person reads it: 4.2s, 3m05s, 2h07m."""
    if seconds < 60:
        return f"{seconds:.1f}s"
    s = int(round(seconds))
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def eta(done: int, total: int, elapsed: float) -> float | None:
    """Seconds left at the average rate so far (None before anything is done)."""
    if done <= 0 or elapsed <= 0:
        return None
    return max(total - done, 0) * elapsed / done


class Progress:
    """Progress of ``total`` units of work (None: unknown, a count only), drawn as its stream allows; ``quiet``:
    nothing at all (another rank than 0)."""

    def __init__(self, desc: str, total: int | None = None, unit: str = "it", stream: IO[str] | None = None,
                 quiet: bool = False) -> None:
        self.desc, self.total, self.unit = desc, total, unit
        self.stream = sys.stderr if stream is None else stream
        self.n = 0
        self.t0 = time.perf_counter()
        self._tenth = 0  # tenths of total already reported as lines
        self._last_line = self.t0  # plain lines without a total: at most one every 30 s
        self._bar: Any = None
        mode = os.environ.get("DETTRAIN_PROGRESS", "auto")
        tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.mode = "off" if quiet or mode == "off" else "bar" if tty and mode != "lines" else "lines"
        if self.mode == "bar":
            try:
                from tqdm import tqdm
            except ImportError:  # tqdm is optional: our own one-line bar
                tqdm = None
            if tqdm is not None:
                self._bar = tqdm(total=total, desc=desc, unit=unit, file=self.stream, leave=True)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(ok=exc[0] is None)

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def _text(self, note: str) -> str:
        el = self.elapsed()
        if self.total:
            left = eta(self.n, self.total, el)
            text = (f"{self.desc}: {self.n}/{self.total} {self.unit} ({100 * self.n // self.total}%), "
                    f"elapsed {duration(el)}" + ("" if left is None else f", eta {duration(left)}"))
        else:
            text = f"{self.desc}: {self.n:,} {self.unit}, elapsed {duration(el)}"
        return text + (f" | {note}" if note else "")

    def update(self, n: int = 1, note: str = "") -> None:
        """``n`` more units done; ``note``: what was just done (shown beside the count)."""
        self.n += n
        if self.mode == "off":
            return
        if self._bar is not None:
            if note:
                self._bar.set_postfix_str(note, refresh=False)
            self._bar.update(n)
            return
        if self.mode == "bar":
            frac = min(self.n / self.total, 1.0) if self.total else None
            bar = "" if frac is None else "[" + "#" * int(frac * 24) + "." * (24 - int(frac * 24)) + "] "
            self.stream.write(f"\r{bar}{self._text(note)}\x1b[K")
            self.stream.flush()
            return
        now = time.perf_counter()
        if self.total:
            tenth = 10 * min(self.n, self.total) // self.total
            if tenth <= self._tenth or self.n >= self.total:  # the last one is close()'s line
                return
            self._tenth = tenth
        elif now - self._last_line < 30:
            return
        self._last_line = now
        self.stream.write(self._text(note) + "\n")
        self.stream.flush()

    def close(self, ok: bool = True) -> None:
        """The final state: a done line (plain), the bar left complete (terminal); nothing more after a failure."""
        if self.mode == "off":
            return
        if self._bar is not None:
            self._bar.close()
        elif self.mode == "bar":
            self.stream.write("\n")
        elif ok:
            self.stream.write(f"{self.desc}: done, {self.n:,} {self.unit} in {duration(self.elapsed())}\n")
        self.stream.flush()
        self.mode = "off"
