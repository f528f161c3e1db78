"""What watches each finished step: the checks, the run record, the progress log and checkpointing.

``Trainer.fit`` builds a ``Step`` after each optimizer step (its ledger line, this rank's micro-batches, its wall
time) and hands it to every observer in this order; an observer that is off (no det.reference, wandb disabled, a
rank other than 0) is simply not in the list:

    CheckReference  det.reference: the live check (record/reference.py); every rank, one broadcast per step while it
                    is active; adds the divergence event, and with det.on_divergence=stop asks to stop (exit 3)
    CheckFinite     a nan/inf loss or gradient norm (loop/nonfinite.py): adds the non_finite event and asks to stop
                    (exit 4); both values are agreed over ranks, so every rank decides the same without a collective
    WriteLedger     rank 0: the step line, then the step's events, each appended and fsynced (record/ledger.py)
    MirrorToWandb   rank 0: the same step as a wandb row, after the ledger line (wandb never holds a step the
                    ledger lacks), with perf/* numbers except for the compiling step
    LogProgress     the start line, the compile notice, a line every log.every steps and at evaluations, the done line
    Checkpoint      every rank: ckpt.every, train.stop_after, the last step (ckpt.final), and preemption (SIGUSR1,
                    SIGTERM, a first Ctrl-C: agreed by one integer all-reduce per step, then checkpoint and exit 75;
                    agreed while the next step is in flight (train.overlap_steps), after that step)

The checks only *ask* to stop (``Step.stop``): the record still gets the step line and its events, the log its
lines, and ``fit`` raises the stop after the last observer, on every rank at the same step.  ``fit`` then closes
every observer once, last built first, with the exit code (0 done or preempted, 2 a model refused at its first
step, 3 live-check stop, 4 non-finite): the done line, the wandb run's exit code, the ledger's file.
"""

from __future__ import annotations

import logging
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from dettrain import checkpoint as ckpt
from dettrain.errors import EXIT_USAGE, UserError
from dettrain.loop.nonfinite import NonFiniteStop
from dettrain.loop.nonfinite import check_step as check_finite
from dettrain.progress import duration, eta
from dettrain.record import schema
from dettrain.record.ledger import LEDGER_NAME, LedgerWriter, f32_bits
from dettrain.record.reference import DivergenceStop, LiveCheck, Verdict
from dettrain.record.wandb_io import WandbMirror, mfu

if TYPE_CHECKING:
    from dettrain.loop.trainer import Trainer

log = logging.getLogger("dettrain")


@dataclass
class Step:
    """One finished optimizer step, as the observers see it."""

    line: dict  # the ledger step line (Trainer.train_step's, plus val_loss when evaluated after it)
    micro: list  # this rank's micro-batches of the step (the live check saves them at a divergence)
    started: float  # time.perf_counter() when the step began (before its batch was drawn)
    seconds: float  # wall time of drawing the batch and the step, up to the agreed loss (the device has synced);
    # an overlapped step's (train.overlap_steps) from where the previous step's line was read
    compiling: bool  # the first step of a compiled model: its time is compile time, not throughput
    in_flight: bool = False  # the next step's first micro-batch is queued already (train.overlap_steps)
    verdict: Verdict | None = None  # the live check's (det.reference)
    events: list[dict] = field(default_factory=list)  # ledger event lines that follow the step line
    stop: BaseException | None = None  # a check's request: every rank stops once the observers are done

    @property
    def number(self) -> int:
        """The ledger's step number (0-based)."""
        return self.line["step"]

    def add_eval(self, val_loss: float) -> None:
        """The validation loss of the updated model (eval.every), carried by the step line."""
        self.line.update(val_loss=val_loss, val_loss_bits=f"{f32_bits(val_loss):08x}")


def exit_code(stop: BaseException | None) -> int:
    """The exit status a run ends with after ``stop`` (None: the loop ran out or was preempted after its checkpoint;
    the 75 of a preemption is raised by ``run`` once every rank is through)."""
    if stop is None:
        return 0
    if isinstance(stop, UserError):
        return EXIT_USAGE
    return stop.exit_code  # NonFiniteStop, DivergenceStop


class Observer:
    """Watches every step (``on_step``, in ``fit``'s order) and is closed once (``close``) with the exit code."""

    def on_step(self, step: Step) -> None:
        raise NotImplementedError

    def close(self, exit_code: int) -> None:  # noqa: ARG002 - most observers hold nothing to close
        return None


class CheckReference(Observer):
    """det.reference: compare the step with the reference run's (every rank: the verdict is broadcast while the
    check is active); it drops per-tensor fingerprints the ledger does not need, so it runs before the writers."""

    def __init__(self, live: LiveCheck) -> None:
        self.live = live

    def on_step(self, step: Step) -> None:
        step.verdict = self.live.check(step.line, step.micro)
        if step.verdict.event is not None:
            step.events.append(step.verdict.event)
        if step.verdict.stop:
            step.stop = DivergenceStop(step.verdict.message)


class CheckFinite(Observer):
    """Stop every rank at the first non-finite loss or gradient norm (agreed values: the same verdict everywhere)."""

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg

    def on_step(self, step: Step) -> None:
        halt = check_finite(step.line, self.cfg)
        if halt is not None:
            step.events.append(halt.event)
            step.stop = halt  # also over a divergence stop at the same step: the non-finite value is the cause


class WriteLedger(Observer):
    """Rank 0: the step line and its events, appended and fsynced one by one (record/ledger.py)."""

    def __init__(self, writer: LedgerWriter) -> None:
        self.writer = writer

    @classmethod
    def open(cls, path: Path, header: dict, resumed: ckpt.Resumed | None, data_files: dict | None) -> WriteLedger:
        """A fresh ledger with ``header``, or, resumed, the run's ledger cut after the resumed step (accepted config
        and data changes recorded in its header) with the ``resume`` event appended."""
        if resumed is None:
            return cls(LedgerWriter(path, header))
        ckpt.record_header_changes(path, resumed.step, resumed.header_changes, data_files=data_files)
        led = cls(LedgerWriter(path, header, resume_step=resumed.step))
        led.event(resumed.event)
        return led

    def event(self, ev: dict) -> None:
        self.writer.write(ev)

    def on_step(self, step: Step) -> None:
        self.writer.write(step.line)
        for ev in step.events:
            self.writer.write(ev)

    def close(self, exit_code: int) -> None:  # noqa: ARG002 - every line is on disk already
        self.writer.close()


class MirrorToWandb(Observer):
    """Rank 0: the step as a wandb row (a wandb failure turns the mirror off, never the run: record/wandb_io.py)."""

    def __init__(self, mirror: WandbMirror, tokens_per_step: int, n_params: int, world: int,
                 peak_flops: float | None) -> None:
        self.mirror, self.tokens_per_step = mirror, tokens_per_step
        self.n_params, self.world, self.peak = n_params, world, peak_flops  # perf/mfu: None peak on a CPU

    def on_step(self, step: Step) -> None:
        perf = None
        if not step.compiling:  # the compiling step's time is compile time, not throughput
            tok_s = self.tokens_per_step / max(step.seconds, 1e-9)
            perf = {"tokens_per_s": tok_s, "mfu": mfu(self.n_params, tok_s, self.world, self.peak)}
        self.mirror.log(step.line, step.verdict, perf)

    def close(self, exit_code: int) -> None:
        self.mirror.finish(exit_code=exit_code)


class LogProgress(Observer):
    """The run's log lines: opened with the start line (and the compile notice before a compiled first step), a
    progress line every log.every steps, at the schedule's end and at every evaluation, the done line at a clean
    close.  Tests and users grep these lines: their wording is part of the interface.  The progress line ends with
    the wall time of this process so far and the time left to the end of this run (train.stop_after or
    train.steps) at the average step time since the first step (the compiling one left out)."""

    def __init__(self, tr: Trainer, end: int) -> None:
        cfg, info = tr.cfg, tr.info
        self.every, self.steps, self.end = cfg.log.every, cfg.train.steps, end
        self.tokens_per_step = cfg.train.global_batch * cfg.model.seq_len
        self.ledger_path = tr.run_dir / LEDGER_NAME
        self.done = tr.step  # completed steps (resumed ones included)
        self.compile_s: float | None = None  # wall time of the first (compiling) step
        self.device = tr.device
        log.info(f"dettrain: {tr.n_params:,} params, tier {cfg.det.tier} ({tr.policy.name}), engine "
                 f"{tr.engine_name}, world {info.world}, {tr.M} micro-batches/step, run dir {tr.run_dir}")
        if tr.compiled.enabled:  # the first step traces and compiles: say so, time it apart
            log.info(f"step {tr.step}: compiling (torch.compile: {len(tr.compiled.units)} blocks + loss) ...")
        self.t0 = time.perf_counter()
        self.last_t, self.last_step = self.t0, tr.step  # tokens/s over the steps since the last line
        self.rate_t, self.rate_step = self.t0, tr.step  # the ETA's average: from here (after a compiling step)

    def on_step(self, step: Step) -> None:
        self.done = step.number + 1
        if step.compiling:  # tokens/s from here on leaves the compile out
            self.last_t, self.last_step = time.perf_counter(), self.done
            self.rate_t, self.rate_step = self.last_t, self.done
            self.compile_s = self.last_t - step.started
            log.info(f"step {step.number}: compile+first step {self.compile_s:.1f} s")
        if isinstance(step.stop, NonFiniteStop):  # the stop's message reports this step instead
            return
        rec = step.line
        if self.done % self.every == 0 or self.done == self.end or "val_loss" in rec:
            now = time.perf_counter()
            n = self.done - self.last_step
            speed = f"{self.tokens_per_step * n / max(now - self.last_t, 1e-9):,.0f} tok/s" if n else "compiled"
            self.last_t, self.last_step = now, self.done
            left = eta(self.done - self.rate_step, self.end - self.rate_step, now - self.rate_t)
            timing = f"elapsed {duration(now - self.t0)}" + ("" if left is None else f" | eta {duration(left)}")
            # the ledger's step number (0-based), then how many of train.steps are done (docs/guide.md, "Step numbers")
            log.info(f"step {step.number:>5} ({self.done}/{self.steps}) | loss {rec['loss']:.4f} "
                     f"| lr {rec['lr']:.2e} | gnorm {rec['grad_norm']:.3f} | {speed}"
                     + "".join(f" | {f.key} {rec[f.key][:8]}" for f in schema.FIELDS if f.progress)
                     + (f" | val {rec['val_loss']:.4f}" if "val_loss" in rec else "") + f" | {timing}")

    def close(self, exit_code: int) -> None:
        if exit_code:  # a stop: its own message is the last word
            return
        elapsed = time.perf_counter() - self.t0
        first = f" (compile+first step {self.compile_s:.1f} s)" if self.compile_s is not None else ""
        peak = (f"; peak device memory {torch.cuda.max_memory_allocated(self.device) / 2**30:.2f} GiB"
                if self.device.type == "cuda" else "")
        log.info(f"done: {self.done} steps in {elapsed:.1f} s{first}{peak}; ledger {self.ledger_path}")


class Checkpoint(Observer):
    """After a step (every rank, a collective): checkpoint every ckpt.every steps, at train.stop_after, after the
    schedule's last step (ckpt.final), and when any rank got SIGUSR1, SIGTERM or a first Ctrl-C (``guard.agreed``:
    every rank learns it at the same step, checkpoints, and sets ``Trainer.preempted``, which ends the loop)."""

    def __init__(self, tr: Trainer, cfg_dict: dict, guard: ckpt.PreemptionGuard | None, end: int,
                 ledger: WriteLedger | None) -> None:
        self.tr, self.cfg_dict, self.guard, self.end = tr, cfg_dict, guard, end
        self.ledger = ledger  # rank 0's: the checkpoint and preemption events

    def on_step(self, step: Step) -> None:
        if step.stop is not None:  # a checked stop ends the run here, without a checkpoint
            return
        tr, cfg = self.tr, self.tr.cfg
        done = tr.step  # completed steps: what the checkpoint holds
        sig = self.guard.agreed(tr.info) if self.guard is not None else 0
        sig = sig or tr.preempt_after  # agreed at the step before, while this one was in flight
        sig = sig if done < cfg.train.steps else 0  # the run is complete: nothing left to requeue
        if sig and step.in_flight:
            # the next step has begun (train.overlap_steps): the checkpoint comes after it, when nothing is in flight
            # (every rank agreed on sig, so every rank waits alike; scheduled checkpoints never follow such a step)
            if not tr.preempt_after:
                log.info(f"{signal.Signals(sig).name}: the next step is in flight (train.overlap_steps); checkpoint "
                         "after it")
            tr.preempt_after = sig
            return
        stopping = done == self.end < cfg.train.steps
        every = bool(cfg.ckpt.every and done % cfg.ckpt.every == 0)
        final = cfg.ckpt.final and done == cfg.train.steps
        if not (sig or stopping or every or final):
            return
        reason = (f"preempted by {signal.Signals(sig).name}" if sig else "stop_after" if stopping
                  else "every" if every else "final")
        path = ckpt.save(tr, self.cfg_dict, reason)
        if self.ledger is not None:
            ev = {"kind": "event", "event": "preempted" if sig else "checkpoint", "step": done,
                  "path": str(path.relative_to(tr.run_dir)) if path.is_relative_to(tr.run_dir) else str(path),
                  "reason": reason}
            if sig:
                ev["exit_code"] = ckpt.REQUEUE_EXIT_CODE
            self.ledger.event(ev)
        if sig:
            log.info(f"{signal.Signals(sig).name}: checkpoint {path} after step {done}; exiting with "
                     f"{ckpt.REQUEUE_EXIT_CODE} (requeue with ckpt.resume=auto)")
            tr.preempted = sig
