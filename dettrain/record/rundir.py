"""The run directory: where it is, one run at a time in it, and what a new run may do to what is already there.

Invariants, each decided on rank 0 and broadcast, so every rank takes the same exit (their tests: docs/reliability.md):

- **One run per run dir.**  Rank 0 holds ``fcntl.flock(LOCK_EX)`` on ``<run_dir>/.dettrain.lock`` for the whole
  run; the file names the holder (host, pid, start time).  The kernel drops the lock when the holder's process
  ends, however it ends (exit, exception, SIGKILL), so a lock is never stale.  A second run into the same dir is
  refused at start-up (exit 2) with the dir and the holder.  flock works across nodes on NFS (Linux emulates it
  with POSIX locks) and on Lustre mounted with ``-o flock``.
- **A fresh run never overwrites.**  ``ckpt.resume=none`` into a dir whose ledger holds step lines, or that holds
  checkpoints, is refused (exit 2) unless ``ckpt.overwrite=true``, which moves every old file aside into
  ``<run_dir>/overwritten/<time>/`` (nothing is deleted).  A header-only ledger (a run stopped before its first
  step) holds nothing to lose and is replaced.
- **Resume continues the same ledger.**  Resuming from step k needs ``<run_dir>/ledger.jsonl`` to hold step lines
  0..k-1, each once, in order, of the same run: its header's config (plus the changes recorded in it) equals this
  run's on every key of the config hash except those ``ckpt.allow_config_change`` permits, and its step k-1 has the
  parameter/optimizer fingerprints the checkpoint was saved with.  Lines >= k (written after the checkpoint, before
  the crash) are dropped by the ledger writer.
- **Hydra multirun** (``-m``): job N of a sweep runs in ``<run dir>/<N>``, so jobs that share DETTRAIN_RUN_ID or
  ``run_dir`` never share a ledger; without either, the sweep's jobs share one id (``outputs/<exp>/<sweep id>/<N>``).
- **Early signals** (a signal during start-up is honoured like a later one, never a half-made run dir) are
  dettrain/signals.py's; ``install_early_signal_flag`` and ``early_signal`` are re-exported here.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import socket
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dettrain.errors import UserError, io_error  # noqa: F401 - io_error re-exported (tools/export.py)
from dettrain.signals import early_signal, install_early_signal_flag  # noqa: F401 - re-exported

if TYPE_CHECKING:
    from dettrain.config import Config
    from dettrain.dist import DistInfo

LOCK_NAME = ".dettrain.lock"
OVERWRITTEN_DIR = "overwritten"
LEDGER_NAME = "ledger.jsonl"  # the same as ledger.LEDGER_NAME (not imported: this module stays torch-free)
CKPT_DIR = "checkpoints"
_RUN_ID = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]*$")  # a plain name: one path component, not hidden, not '..'


# ---- where ----------------------------------------------------------------------------------------------
def multirun_job() -> int | None:
    """Hydra's job number when this process runs a multirun sweep (``-m``), else None."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        hc = HydraConfig.get()
    except (ImportError, ValueError):  # ValueError: no Hydra app is running (e.g. called from Python)
        return None
    return int(hc.job.num) if hc.mode == RunMode.MULTIRUN else None


_sweep_id: list[str] = []
"""The id of the multirun sweep this process runs (set by its first job without DETTRAIN_RUN_ID or run_dir)."""


def resolve_run_dir(cfg: Config, info: DistInfo, job: int | None = None) -> Path:
    """One run dir for every rank: run_dir, else outputs/<exp>/<id> with id from DETTRAIN_RUN_ID, torchrun's
    rendezvous id (stable across elastic restarts), or rank 0's timestamp broadcast to all ranks.  Job ``job`` of a
    Hydra multirun gets the subdirectory ``<job>`` of it (every rank of a job has the same job number); without an
    explicit id every job of one sweep shares the first job's timestamp id: ``outputs/<exp>/<sweep id>/<job>``."""
    if cfg.run_dir:
        base = Path(cfg.run_dir)
    else:
        rid = os.environ.get("DETTRAIN_RUN_ID", "")
        if rid and not _RUN_ID.match(rid):
            # a path ('../../x', 'a/b', '/abs') would put the run outside outputs/<exp>/ or in another run's dir
            raise UserError(f"DETTRAIN_RUN_ID={rid!r} is not a plain name: use letters, digits, '.', '_' and '-' "
                            "only, not starting with '.' (or set run_dir=PATH to choose the directory itself)")
        if not rid:
            te = os.environ.get("TORCHELASTIC_RUN_ID", "")
            rid = te if te and te != "none" else ""
        if not rid and job is not None and _sweep_id:
            rid = _sweep_id[0]  # a later job of this multirun sweep: the sweep's id, so its jobs sit side by side
        if not rid:
            from dettrain import dist as D

            rid = D.broadcast_object(time.strftime("%Y%m%d-%H%M%S-") + f"{os.getpid()}", info)
            if job is not None:
                # Hydra's launcher runs a sweep's jobs one after another in this process (on every rank alike):
                # keep the first job's id for the rest, giving outputs/<exp>/<sweep id>/<job> for every job
                _sweep_id[:] = [rid]
        base = Path("outputs") / cfg.exp_name / rid
    return base if job is None else base / str(job)


# ---- user-facing I/O errors -----------------------------------------------------------------------------
# ---- one run per run dir --------------------------------------------------------------------------------
class RunDirLock:
    """An exclusive flock on ``<run_dir>/.dettrain.lock``, held while the object lives (rank 0)."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> None:
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)  # the umask decides
        except OSError as e:
            raise io_error("write into the run dir", self.run_dir, e) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _describe_holder(os.pread(fd, 4096, 0))
            os.close(fd)
            raise UserError(f"run_dir {self.run_dir} is in use by another dettrain run ({holder}); one run per run "
                            "dir: wait for that run to end, or start this one with another run_dir=...") from None
        except OSError as e:
            os.close(fd)
            raise io_error("lock the run dir", self.run_dir, e) from None
        holder = json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                             "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}) + "\n"
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, holder.encode(), 0)
            os.fsync(fd)
        except OSError as e:
            os.close(fd)
            raise io_error("write into the run dir", self.run_dir, e) from None
        self._fd = fd

    def release(self) -> None:
        """Drop the lock (the file stays: removing it would race with a run that opened it meanwhile)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _describe_holder(raw: bytes) -> str:
    try:
        h = json.loads(raw.decode())
        return f"host {h['host']}, pid {h['pid']}, started {h['started']}"
    except (ValueError, KeyError, TypeError):
        return "holder not recorded yet"


# ---- what is already there ------------------------------------------------------------------------------
def _ledger_steps(ledger: Path) -> tuple[int, str | None]:
    """(number of step lines, None) of a ledger, or (-1, reason) when it cannot be read as one."""
    from dettrain.record.ledger import read_ledger

    try:
        _, steps = read_ledger(ledger)
    except ValueError as e:
        return -1, str(e)
    return len(steps), None


def _checkpoints(run_dir: Path) -> list[str]:
    root = run_dir / CKPT_DIR
    return sorted(p.name for p in root.glob("step_*")) if root.is_dir() else []


def _move_aside(run_dir: Path) -> Path:
    """Move every entry of ``run_dir`` except the lock and earlier move-asides into overwritten/<time>/."""
    dest = run_dir / OVERWRITTEN_DIR / time.strftime("%Y%m%d-%H%M%S")
    n = 0
    while dest.exists():
        n += 1
        dest = dest.with_name(f"{dest.name.split('.')[0]}.{n}")
    try:
        dest.mkdir(parents=True)
        for p in sorted(run_dir.iterdir()):
            if p.name not in (LOCK_NAME, OVERWRITTEN_DIR):
                p.rename(dest / p.name)
    except OSError as e:
        raise io_error("move the old run aside in", run_dir, e) from None
    return dest


def _claim(run_dir: Path, cfg: Config) -> tuple[RunDirLock, str | None]:
    """Rank 0: create and lock the run dir and decide what this run may do to it.  Returns (lock, note)."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise io_error("create the run dir", run_dir, e) from None
    lock = RunDirLock(run_dir)
    lock.acquire()
    try:
        note = None
        ledger = run_dir / LEDGER_NAME
        n_steps, unreadable = _ledger_steps(ledger) if ledger.exists() else (0, None)
        ckpts = _checkpoints(run_dir)
        if cfg.ckpt.resume == "none" and (n_steps != 0 or ckpts):
            if cfg.ckpt.overwrite:
                note = f"ckpt.overwrite=true: the previous run's files were moved to {_move_aside(run_dir)}"
            else:
                held = [f"{ledger} holds {n_steps} step lines" if n_steps > 0 else
                        f"{ledger} is unreadable ({unreadable})" if n_steps < 0 else "",
                        f"{len(ckpts)} checkpoints in {run_dir / CKPT_DIR}" if ckpts else ""]
                raise UserError(
                    f"run_dir {run_dir} already holds a run ({'; '.join(h for h in held if h)}) and a fresh run "
                    "(ckpt.resume=none) would overwrite it. Continue it with ckpt.resume=auto, start elsewhere with "
                    f"run_dir=OTHER, or move the old files aside with ckpt.overwrite=true (kept in "
                    f"{run_dir / OVERWRITTEN_DIR}/<time>/)")
        if ledger.exists():  # continued or replaced below: must be writable (an immutable file is not)
            try:
                with open(ledger, "a", encoding="utf-8"):
                    pass
            except OSError as e:
                raise io_error("write the ledger", ledger, e) from None
    except BaseException:
        lock.release()
        raise
    return lock, note


def open_run_dir(run_dir: Path, cfg: Config, info: DistInfo) -> tuple[RunDirLock | None, str | None]:
    """Create, lock and check ``run_dir`` (rank 0 decides; a refusal is raised as UserError on every rank, so no
    rank waits for a peer that has left).  A collective.  Returns (rank 0's lock, a note to log) -- keep the lock
    for the whole run and ``release()`` it at the end."""
    from dettrain import dist as D

    lock, note, err = None, None, None
    if info.is_main:
        try:
            lock, note = _claim(run_dir, cfg)
        except UserError as e:
            err = str(e)
    err = D.broadcast_object(err, info)
    if err:
        if lock is not None:
            lock.release()
        raise UserError(err)
    return lock, note


# ---- resume checks the ledger ---------------------------------------------------------------------------
def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _covered(key: str, patterns) -> bool:
    return any(key == p or key.startswith(p + ".") for p in patterns)


def ledger_config_differences(header: dict, cfg_dict: dict, allowed: list[str]) -> dict[str, list]:
    """Keys of the config hash on which the ledger's run (its header config, with the changes the header records
    applied) and this run differ, minus those ``allowed`` covers: {key: [ledger's, this run's]}."""
    from dettrain.record.identity import NON_NUMERIC

    old = _flatten(header.get("config", {}))
    for change in header.get("config_changes", []):
        for k, (_, new) in change.get("changes", {}).items():
            if k != "world_size":
                old[k] = new
    now = _flatten(cfg_dict)
    return {k: [old.get(k), now.get(k)] for k in sorted(set(old) | set(now))
            if old.get(k) != now.get(k) and not _covered(k, NON_NUMERIC) and not _covered(k, allowed)}


def _ledger_problem(run_dir: Path, step: int | None, cfg_dict: dict, allowed: list[str],
                    saved_fps: dict | None, data_fp: dict | None = None) -> str | None:
    """Why the ledger cannot be continued from ``step`` (None: it can).  ``step`` None: starting at step 0 with
    ckpt.resume=auto and no checkpoint, which rewrites a ledger of the same run and refuses any other."""
    from dettrain.record.ledger import read_ledger

    ledger = run_dir / LEDGER_NAME
    fix = ("start afresh in another run_dir=... (or here with ckpt.resume=none ckpt.overwrite=true, which moves the "
           "old files aside), or restore the ledger "
           "that belongs to this run dir's checkpoints")
    if not ledger.is_file():
        if step is None:
            return None
        return (f"resuming from step {step} needs the ledger {ledger} with steps 0..{step - 1}, and it is missing; "
                f"{fix}")
    try:
        header, steps = read_ledger(ledger)
    except ValueError as e:
        return f"cannot continue the ledger {ledger}: {e}; {fix}"
    diffs = ledger_config_differences(header, cfg_dict, allowed)
    if diffs and (step is not None or steps):
        what = ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in diffs.items())
        return (f"the ledger {ledger} belongs to another run (its config differs: {what}); {fix}, or list the keys "
                "in ckpt.allow_config_change")
    if step is None:
        return None
    have = [s["step"] for s in steps if s.get("step", -1) < step]
    if have != list(range(step)):
        dup = sorted({x for x in have if have.count(x) > 1})
        gaps = sorted(set(range(step)) - set(have))
        if gaps and (not have or max(have) < gaps[0]):
            desc = f"shorter: its last step line is {max(have) if have else 'none'}"
        elif gaps:
            desc = f"gapped: steps {_span(gaps)} are missing"
        else:
            desc = f"duplicated: steps {_span(dup)} appear twice" if dup else "out of order"
        return (f"resuming from step {step} needs the ledger {ledger} to hold steps 0..{step - 1} each once, in "
                f"order; it is {desc}; {fix}")
    if step > 0 and saved_fps:
        last = next(s for s in reversed(steps) if s.get("step") == step - 1)
        bad = [f"{k} {last.get(k)} != {v}" for k, v in saved_fps.items() if last.get(k) != v]
        if bad:
            return (f"the ledger {ledger} belongs to another run: its step {step - 1} does not match the checkpoint's "
                    f"fingerprints ({'; '.join(bad)}); {fix}")
    # the data files the ledger's run read (headers before data_files existed are not checked)
    saved_data = header.get("data_files")
    if isinstance(saved_data, dict) and data_fp is not None and not _covered("data", allowed):
        from dettrain.data import fingerprint_changes

        changed = fingerprint_changes(saved_data, data_fp)
        if changed:
            return (f"the data changed since the ledger {ledger} was started: {'; '.join(changed)}; resuming would "
                    "not reproduce the uninterrupted run. Restore the file(s), or accept the change with "
                    "ckpt.allow_config_change=[data] (recorded in the ledger header)")
    return None


def _span(xs: list[int]) -> str:
    if not xs:
        return "-"
    return str(xs[0]) if len(xs) == 1 else f"{xs[0]}..{xs[-1]}" if xs == list(range(xs[0], xs[-1] + 1)) else \
        ",".join(map(str, xs[:8])) + ("..." if len(xs) > 8 else "")


def check_resume_ledger(run_dir: Path, resumed: Any, cfg: Config, cfg_dict: dict, info: DistInfo,
                        data_fp: dict | None = None) -> None:
    """Refuse (UserError on every rank) a resume whose ledger is missing, shorter, gapped or of another run, or
    whose header records other data files than ``data_fp`` (rank 0's ``data.data_fingerprint``) unless
    ckpt.allow_config_change covers ``data``.  ``resumed``: what ``checkpoint.resume`` returned (None: starting at
    step 0, which rewrites the ledger).  A collective."""
    from dettrain import dist as D

    if resumed is None and cfg.ckpt.resume == "none":
        return  # a fresh run: open_run_dir already refused to overwrite
    err = None
    if info.is_main:
        fps = None
        if resumed is not None:
            try:
                fps = json.loads((Path(resumed.path) / "dettrain.json").read_text()).get("fingerprints")
            except (OSError, ValueError):
                fps = None  # the checkpoint passed its own checks; without its fingerprints the step check is skipped
        err = _ledger_problem(Path(run_dir), None if resumed is None else int(resumed.step), cfg_dict,
                              list(cfg.ckpt.allow_config_change), fps, data_fp)
    err = D.broadcast_object(err, info)
    if err:
        raise UserError(err)


# ---- what a run writes at start-up ----------------------------------------------------------------------
class _QuietFileHandler(logging.FileHandler):
    """A log file that, when it cannot be written (a full disk), says so once and turns itself off, instead of
    printing logging's traceback at every line: the ledger, not the log, is what must not be lost."""

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: ARG002, N802 - logging's signature
        err = sys.exc_info()[1]
        print(f"dettrain: warning: cannot write the log file {self.baseFilename} ({err}); file logging is off",
              file=sys.stderr)
        self.close()
        logging.getLogger("dettrain").removeHandler(self)


def setup_logging(run_dir: Path, info: DistInfo) -> None:
    log = logging.getLogger("dettrain")
    try:
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        fh = _QuietFileHandler(run_dir / "logs" / f"rank{info.rank}.log")
    except OSError as e:
        raise io_error("write the log file in", run_dir / "logs", e) from None
    log.handlers.clear()
    log.setLevel(logging.INFO)
    log.propagate = False
    fh.setFormatter(logging.Formatter(f"%(asctime)s [rank {info.rank}] %(message)s"))
    log.addHandler(fh)
    if info.is_main:  # other ranks stay quiet on the console
        sh = logging.StreamHandler(sys.stdout)
        sh.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(sh)


def write_run_files(run_dir: Path, cfg_dict: dict, hydra_files: dict[str, str]) -> None:
    """Rank 0: the resolved config.yaml and Hydra's files (.hydra/) in the run dir."""
    from omegaconf import OmegaConf

    path = run_dir / "config.yaml"
    try:
        path.write_text(OmegaConf.to_yaml(OmegaConf.create(cfg_dict)))
        for name, text in hydra_files.items():
            path = run_dir / ".hydra" / name
            path.parent.mkdir(exist_ok=True)
            path.write_text(text)
    except OSError as e:
        raise io_error("write", path, e) from None
