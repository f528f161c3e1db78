"""The training loop, top to bottom: data -> forward -> backward -> reduce -> clip -> step -> fingerprints -> the
step's observers (checks, ledger, wandb, log, checkpoint).

``Trainer.fit`` is the loop (draw the step's micro-batches, queue the step, read its line, evaluate when due, hand
the ``Step`` to the observers of loop/observers.py, stop where a check or a preemption says so; with
train.overlap_steps the next step's first micro-batch is queued before a plain step's line is read, ``overlaps``);
``train_step`` is one optimizer step (``_step``, a generator that queues it, then the line), whose ledger line
loop/step_record.py builds from the fingerprints taken along the way.  The model, its
compile, the engine and the kernel switches come from ``build_run`` (loop/build.py), the one assembly the tools use
too; the Trainer adds the data, the sampler and the live check.

Gradients are synced by the engine ``dist.engine`` names (sync/engines/): ``auto`` is torch DDP at tiers 0-2
(the baseline users know) and dettrain's flat canonical reducer (collectives.py) at tiers 3-4, whose summation
order is written in our code; ``flat`` runs that reducer at every tier; ``fsdp2`` shards with torch FSDP2 and from
tier 3 on replaces its reduce-scatter with the canonical one.  DDP is refused at tiers 3-4 (NCCL/Gloo would sum).
The walk from ``python -m dettrain`` to the optimizer update: docs/architecture.md.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from dettrain import checkpoint as ckpt
from dettrain import dist as D
from dettrain.config import Config, config_hash, to_container, validate
from dettrain.data import StepSampler, ValidationSet, data_fingerprint, load_tokens, split_samples
from dettrain.determinism import (
    TIERS,
    apply_tier,
    audit,
    seed_micro_batch,
    seed_process,
    set_env_before_cuda,
    versions,
)
from dettrain.errors import UserError
from dettrain.kernels import batch_invariant as bi
from dettrain.loop.build import Run, build_run
from dettrain.loop.observers import (
    CheckFinite,
    Checkpoint,
    CheckReference,
    LogProgress,
    MirrorToWandb,
    Observer,
    Step,
    WriteLedger,
    exit_code,
)
from dettrain.loop.step_record import StepRecorder
from dettrain.record import rundir
from dettrain.record.fingerprint import combine_over_ranks
from dettrain.record.ledger import LEDGER_NAME
from dettrain.record.reference import LiveCheck
from dettrain.record.wandb_io import WandbMirror, peak_flops, resolve_wandb
from dettrain.signals import early_signal
from dettrain.sync.collectives import canonical_mean
from dettrain.sync.engines import Engine
from dettrain.sync.optim import lr_at
from dettrain.tiers import policy

log = logging.getLogger("dettrain")
# named ranges of a step in torch.profiler traces (a no-op costing ~1 us when no profiler runs)
_phase = torch.profiler.record_function


def check_logits_shape(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int) -> None:
    """The model's output must be (B, T, vocab_size) for targets (B, T): the loss flattens both, so a time-major
    (T, B, V) output would otherwise train on misaligned targets without a word.  A shape compare, no sync."""
    if logits.dim() != 3 or tuple(logits.shape[:2]) != tuple(targets.shape) or logits.shape[-1] != vocab_size:
        raise UserError(f"the model returned logits of shape {tuple(logits.shape)} for tokens of shape "
                        f"{tuple(targets.shape)}; it must return (B, T, model.vocab_size) = "
                        f"{(*targets.shape, vocab_size)} (batch first, one row of logits per token)")


def forward_backward(eng: Engine, autocast, tok: torch.Tensor, k: int, vocab_size: int,
                     cuda_graphs: bool = False) -> torch.Tensor:
    """Micro-batch ``k`` of a step on tokens ``tok`` (B, T+1): forward under the engine's micro-batch context and
    ``autocast``, the fp32 loss, and the engine's backward; returns the detached loss.  The memory planner
    (tools/memory.py) drives the engine through this same function.  ``cuda_graphs``: the compiled modules replay
    as CUDA graphs (train.cuda_graphs), so each micro-batch starts a new replay and the loss is copied out."""
    if cuda_graphs:  # what the last micro-batch's graphs wrote is dead: their memory is replayed into
        torch.compiler.cudagraph_mark_step_begin()
    x, y = tok[:, :-1], tok[:, 1:]
    with eng.micro(k):
        with _phase("dettrain.forward"), autocast:
            logits = eng.forward_module(x)
        with _phase("dettrain.loss"):
            check_logits_shape(logits, y, vocab_size)  # never reshape a wrong layout silently
            loss = bi.cross_entropy(logits, y)  # F.cross_entropy in fp32, or the batch-invariant kernel
        with _phase("dettrain.backward"):
            eng.backward(loss, k)  # sums (tiers 3-4: canonical order); buckets launch during backward
    # under CUDA graphs the loss lives in the loss graph's memory, rewritten at the next micro-batch
    return loss.detach().clone() if cuda_graphs else loss.detach()


class _Queued:
    """A step whose every kernel is queued (``Trainer._step``): ``line()`` reads it back, the step's one host sync."""

    def __init__(self, record: StepRecorder, loss: torch.Tensor, lr: float, gnorm) -> None:
        self.record, self.loss, self.lr, self.gnorm = record, loss, lr, gnorm

    def line(self) -> dict:
        return self.record.line(self.loss, self.lr, self.gnorm)


def _run(gen) -> _Queued:
    """Drive a step generator (``Trainer._step``) to its end, from wherever it stands; returns its value."""
    try:
        while True:
            next(gen)
    except StopIteration as e:
        return e.value


# ---- the trainer ------------------------------------------------------------------------------------------
class Trainer:
    def __init__(self, cfg: Config, info: D.DistInfo, run_dir: Path, built: Run | None = None,
                 tokens: np.ndarray | None = None) -> None:
        """``built``: the run's assembly when the caller has built it already (``build_run``); ``tokens``: the
        token array to train on instead of ``load_tokens(cfg.data)`` (the memory planner's random tokens: it
        measures this class's ``train_step`` on data it makes up)."""
        self.cfg, self.info, self.run_dir = cfg, info, run_dir
        t = cfg.train
        self.M = t.global_batch // t.micro_batch  # micro-batches per step, global indices 0..M-1
        self.policy = policy(cfg.det.tier)  # what the tier turns on (dettrain/tiers.py)
        self.canonical = self.policy.canonical_sum
        self.device = info.device
        # the choices, the kernel switches, model, compile, engine and autocast: one assembly (loop/build.py), the
        # same the memory planner, verify and trace build; closed by close() (run() calls it)
        self.built = built = build_run(cfg, info) if built is None else built
        self.resolved, self.engine_name, self.autocast = built.resolved, built.engine_name, built.autocast
        self.attention, self.model, self.compiled = built.attention, built.model, built.compiled
        self.n_params, self.engine = built.n_params, built.engine
        self.cuda_graphs = built.compiled.cuda_graphs  # train.cuda_graphs resolved (loop/compile.py)
        try:
            self._load_data(tokens)
        except BaseException:
            built.close()
            raise
        self.step = 0
        # the first step this process trains watches which parameters get a gradient (model.allow_unused)
        self._probe_pending = True
        self.preempted = 0  # the signal that stopped the run (SIGUSR1/SIGTERM), after its checkpoint
        # train.overlap_steps resolved: the next step's first micro-batch is queued before a step's line is read
        self.overlap = built.resolved.overlap_steps
        self.preempt_after = 0  # a signal every rank agreed on while a step was in flight: checkpoint after it

    def _load_data(self, tokens: np.ndarray | None = None) -> None:
        """The token data (``tokens``, else data.path's), its checks, the validation set and the step sampler (the
        engine says which global micro-batches each rank runs), and the live check."""
        cfg, info, t = self.cfg, self.info, self.cfg.train
        self.tokens = load_tokens(cfg.data) if tokens is None else tokens
        # data.val_fraction: the sampler sees only the training samples (the held-out ones are never drawn)
        self.dataset, val_ds = split_samples(cfg.data, self.tokens, cfg.model.seq_len)
        # the data is part of the run: rank 0 records the files' fingerprints in the header, and a resume refuses
        # a changed file (rundir.check_resume_ledger); a sampled hash keeps this cheap on huge files (data/__init__.py)
        self.data_fp = data_fingerprint(cfg.data, self.tokens) if info.is_main else None
        checked = [("data", self.tokens)] + ([("data.val_path", val_ds.tokens)] if cfg.data.val_path else [])
        for what, toks in checked:
            if int(toks.max()) >= cfg.model.vocab_size:
                raise UserError(f"{what} holds token id {int(toks.max())} >= model.vocab_size="
                                 f"{cfg.model.vocab_size}; raise model.vocab_size")
        self.val = None  # the fixed validation micro-batches of this rank (eval.*)
        if cfg.eval.every > 0:
            if val_ds is None:
                raise UserError(f"eval.every={cfg.eval.every} needs data.val_fraction or data.val_path")
            src = "data.val_path" if cfg.data.val_path is not None else "data.val_fraction"
            self.val = ValidationSet(val_ds, cfg.eval.batches, t.micro_batch, info.rank, info.world,
                                     self.engine.assignment, source=src)
        self.sampler = StepSampler(self.dataset, cfg.seed, t.global_batch, t.micro_batch, info.rank, info.world,
                                   cfg.data.num_workers, assignment=self.engine.assignment)
        # live check against det.reference: agreed on by all ranks at start-up, so built on every rank
        self.live = LiveCheck(cfg, info, self.run_dir, to_container(cfg)) if cfg.det.reference else None

    def close(self) -> None:
        """Close the engine and put back every process-wide switch of the built run (``Run.close``)."""
        self.built.close()

    @property
    def layout(self):
        """The canonical flat layout (world-independent offsets of every parameter)."""
        return self.engine.layout

    # ---- fingerprints --------------------------------------------------------------------------------------
    def fingerprints(self, per_tensor: bool, keys: tuple[str, ...] = ("grad", "param", "opt")):
        """Step fingerprints of ``keys`` combined over ranks, and per-tensor ones as hex (collective: all ranks)."""
        return combine_over_ranks(self.engine.partials(keys, per_tensor), per_tensor, self.info)

    # ---- one optimizer step --------------------------------------------------------------------------------
    def train_step(self, micro, after_micro: Callable[[], None] | None = None) -> dict:
        """One optimizer step over this rank's micro-batches ``micro``; returns its ledger step line (a collective:
        every rank calls it at the same step).  Does not advance ``self.step``: the caller does, once the step's
        evaluation (if due) has run.  ``after_micro``: called after each micro-batch's backward (the memory
        planner resets its tracker's per-module statistics there)."""
        return _run(self._step(self.step, micro, after_micro)).line()

    def _step(self, n: int, micro, after_micro: Callable[[], None] | None = None):
        """Step ``n`` as a generator: it queues the first micro-batch, yields once (``fit`` reads the previous
        step's line there, while this one runs: train.overlap_steps), queues the rest (reduce, clip, update,
        fingerprints) and returns the ``_Queued`` step, whose ``line()`` is the step's one host sync.  Nothing in
        it reads a value back from the device."""
        cfg, info, eng = self.cfg, self.info, self.engine
        lr = lr_at(n, cfg.train.lr, cfg.train.steps, cfg.optim)
        record = StepRecorder(eng, info, n, per_tensor=self._per_tensor_due(n),
                              micro_batch=cfg.train.micro_batch, seq_len=cfg.model.seq_len)
        losses = []
        probe = eng.probe_grads() if self._probe_pending else None
        eng.begin_step(len(micro))
        for k, mb in enumerate(micro):
            seed_micro_batch(cfg.seed, n, mb.index)  # dropout etc. keyed by global micro-batch index
            tok = mb.tokens.to(self.device, non_blocking=True)
            record.batch(tok, mb.index)  # hashed where the tokens are used (on CUDA: queued on the device)
            losses.append(forward_backward(eng, self.autocast, tok, k, cfg.model.vocab_size, self.cuda_graphs))
            if after_micro is not None:
                after_micro()
            if k == 0:
                yield
        if probe is not None:  # every backward of the step is done: the hooks have seen every gradient
            self._probe_pending = False
            self._handle_unused(probe.unused(), n)
        with _phase("dettrain.reduce"):
            loss = canonical_mean(torch.stack(losses), info.world, self.sampler.gathered_order())
            gnorm = eng.reduce(scale=1.0 / self.M)  # the reduced gradient and its norm, agreed on by every rank
        record.grad()  # the reduced gradient before clipping (what every rank agreed on)
        with _phase("dettrain.clip_step"):
            eng.clip_(cfg.optim.clip_grad_norm, gnorm)
            eng.step(lr)
        record.param_opt()
        return _Queued(record, loss, lr, gnorm)

    def overlaps(self, n: int, first: int, end: int) -> bool:
        """Whether ``fit`` queues step n+1's first micro-batch before reading step n's line (train.overlap_steps):
        only between two plain steps, so that whatever reads the model, the sampler or the RNG streams after a step
        (an evaluation, a scheduled checkpoint, the live check, the end of the run) sees no step in flight.  A
        pure function of the config and the step numbers (and of a preemption every rank agreed on), so every rank
        queues its collectives in the same order."""
        if not self.overlap or self.live is not None or self.preempt_after or n == first or n + 1 >= end:
            return False
        done, ck = n + 1, self.cfg.ckpt
        scheduled = bool(ck.every and done % ck.every == 0) or (ck.final and done == self.cfg.train.steps)
        return not (scheduled or self.eval_due(n))

    def _per_tensor_due(self, n: int) -> bool:
        """Per-tensor fingerprints at step ``n``: every log.tensor_every steps, and every step while the live check
        is active (it needs them at a divergent step, which it only knows after the step, when the pre-clip
        gradients are gone; it drops the unneeded ones).  The same answer on every rank."""
        every = self.cfg.log.tensor_every
        return (every > 0 and n % every == 0) or (self.live is not None and self.live.needs_tensors(n))

    def _handle_unused(self, unused: list[str], n: int) -> None:
        """Trainable parameters no rank saw a gradient for in this (the first) step: refused, or with
        model.allow_unused left out of the update and of weight decay.  The same verdict on every rank."""
        if not unused:
            return
        shown = ", ".join(unused[:5]) + (f" (+{len(unused) - 5} more)" if len(unused) > 5 else "")
        if not self.cfg.model.allow_unused:
            raise UserError(f"{len(unused)} trainable parameter(s) received no gradient in step {n}: "
                            f"{shown}; weight decay would shrink them every step while nothing trains them. "
                            "Freeze them in the model (p.requires_grad_(False)), or set model.allow_unused=true to "
                            "leave them out of the update and of weight decay")
        self.engine.freeze(unused)
        if self.info.is_main:
            log.info(f"model.allow_unused: {len(unused)} parameter(s) without a gradient are left as they are (no "
                     f"update, no weight decay): {shown}")

    # ---- validation ----------------------------------------------------------------------------------------
    def eval_due(self, step: int) -> bool:
        """Evaluate after ``step``: every eval.every steps and after the schedule's last step, a pure function of
        the step (so a resumed run evaluates where an uninterrupted one does; train.stop_after is not a last step)."""
        every = self.cfg.eval.every
        return every > 0 and ((step + 1) % every == 0 or step + 1 == self.cfg.train.steps)

    def evaluate(self) -> float:
        """The validation loss: forward only (no_grad, eval mode: dropout off) over the fixed validation
        micro-batches, the same ``bi.cross_entropy`` as training, and ``canonical_mean`` of the per-micro-batch mean
        losses in global index order (one tree over eval.batches leaves: the same bits on any power-of-two world
        size at tier 4).  A collective: every rank calls it at the same step."""
        assert self.val is not None
        losses = []
        self.model.eval()
        try:
            with torch.no_grad():
                for mb in self.val.local_batches():
                    if self.cuda_graphs:
                        torch.compiler.cudagraph_mark_step_begin()
                    tok = mb.tokens.to(self.device, non_blocking=True)
                    with self.autocast:
                        logits = self.engine.forward_module(tok[:, :-1])  # FSDP2 gathers its shards as in training
                    check_logits_shape(logits, tok[:, 1:], self.cfg.model.vocab_size)
                    loss = bi.cross_entropy(logits, tok[:, 1:])
                    losses.append(loss.clone() if self.cuda_graphs else loss)
        finally:
            self.model.train()
        return float(canonical_mean(torch.stack(losses), self.info.world, self.val.order).item())

    # ---- header and loop -----------------------------------------------------------------------------------
    def header(self, cfg_dict: dict) -> dict:
        return {"config": cfg_dict, "config_hash": config_hash(cfg_dict), "versions": versions(),
                "world_size": self.info.world, "tier": self.cfg.det.tier, "tier_name": TIERS[self.cfg.det.tier],
                "threads": torch.get_num_threads(), "backend": self.info.backend, "device": str(self.device),
                "n_params": self.n_params, "n_tokens": int(len(self.tokens)), "data_files": self.data_fp,
                "engine": self.engine_name,
                "compile": self.compiled.header(), "wandb": resolve_wandb(self.cfg, config_hash(cfg_dict)),
                "attention": self.attention.header(self.model),
                "pretrained": getattr(self.model, "pretrained_identity", lambda: None)(),  # weights' sha256
                "audit": audit(self.cfg.det.tier, threads=self.cfg.det.threads, world=self.info.world,
                               attention=self.attention.header(self.model))}

    def fit(self, cfg_dict: dict, guard: ckpt.PreemptionGuard | None = None) -> None:
        """Train from ``self.step`` (0, or the resumed checkpoint's) to train.steps, or through train.stop_after;
        every rank runs it.  Stops early, on every rank at the same step, for a preemption signal (after its
        checkpoint; ``run`` exits 75), a model refused at its first step, a live-check stop or a non-finite step
        (raised after the record is closed).  A step the loop queued ahead (train.overlap_steps) and did not finish
        because of a stop is dropped: nothing of it was applied."""
        cfg = self.cfg
        # ckpt.resume: model, optimizer, RNG streams, sampler and step of a checkpoint (before the sampler's
        # iterator exists); the ledger then drops step lines >= the resumed step and continues
        resumed = ckpt.resume(self, cfg_dict)
        # the ledger must hold exactly steps 0..k-1 of this same run (rundir.py); refused on every rank otherwise
        # ... and of the same data files (their fingerprints in its header), unless ckpt.allow_config_change=[data]
        rundir.check_resume_ledger(self.run_dir, resumed, cfg, cfg_dict, self.info, data_fp=self.data_fp)
        end = cfg.train.steps if cfg.train.stop_after is None else cfg.train.stop_after + 1
        observers = self._observers(cfg_dict, resumed, guard, end)
        self.model.train()
        it = iter(self.sampler)
        first, stop = self.step, None
        ahead = None  # the next step, its first micro-batch queued before this step's line was read: (gen, micro, t)
        read_at = None  # when the last step line was read: an overlapped step's wall time starts there
        while self.step < end and not self.preempted and stop is None:
            if ahead is None:
                started = time.perf_counter()
                micro = next(it)
                gen = self._step(self.step, micro)
            else:
                (gen, micro, started), ahead = ahead, None
            try:
                queued = _run(gen)
            except UserError as e:  # a model that breaks the contract at its first step (same verdict on every rank)
                stop = e
                break
            error = None
            if self.overlaps(self.step, first, end):
                # train.overlap_steps: the next step's first micro-batch goes on the device's queue before this
                # step's line is read, so the device runs it while the host reads the line, writes the ledger and
                # logs; the next step's sampler draw and seeds are its own (a pure function of its number)
                t = time.perf_counter()
                nxt = next(it)
                g = self._step(self.step + 1, nxt)
                try:
                    next(g)
                    ahead = (g, nxt, t)
                except Exception as e:  # noqa: BLE001 - this step's line is written first, then it is raised
                    error = e
            line = queued.line()  # the step's one host sync: its fingerprints, loss and grad norm
            now = time.perf_counter()
            # the step's wall time ends at its agreed loss and grad norm (.item(): the device has synchronized); an
            # overlapped step's starts where the previous line was read (its first micro-batch ran before that)
            step = Step(line, micro, started, now - max(started, read_at or started),
                        compiling=self.compiled.enabled and self.step == first, in_flight=ahead is not None)
            read_at = now
            if self.eval_due(self.step):  # the updated model, before the step line is written (it carries the loss)
                step.add_eval(self.evaluate())
            self.step += 1  # completed steps: what a checkpoint taken now holds
            for obs in observers:  # the checks, the record, the log, checkpointing (observers.py)
                obs.on_step(step)
            stop = step.stop
            if error is not None:
                if not isinstance(error, UserError):
                    raise error
                stop = stop or error
        if ahead is not None:  # a stop with the next step begun: it is dropped (nothing of it was applied)
            ahead[0].close()
        for obs in reversed(observers):
            obs.close(exit_code(stop))
        if stop is not None:  # decided alike on every rank at this step
            D.barrier(self.info)  # nobody leaves before rank 0 has closed the ledger (torchrun kills the rest)
            raise stop

    def _observers(self, cfg_dict: dict, resumed: ckpt.Resumed | None, guard: ckpt.PreemptionGuard | None,
                   end: int) -> list[Observer]:
        """The step observers of this rank, in the order they see a step (observers.py); on rank 0 this opens the
        ledger (its header, or the resumed ledger) and the wandb run."""
        cfg, info = self.cfg, self.info
        observers: list[Observer] = [CheckReference(self.live)] if self.live is not None else []
        observers.append(CheckFinite(cfg))
        ledger = None
        if info.is_main:
            header = self.header(cfg_dict)
            ledger = WriteLedger.open(self.run_dir / LEDGER_NAME, header, resumed, self.data_fp)
            observers.append(ledger)
            # wandb mirrors the ledger; a wandb failure turns the mirror off, never the run
            mirror = WandbMirror.open(cfg, self.run_dir, header, None if resumed is None else resumed.step)
            if mirror is not None:
                # perf/mfu's denominator: the dense bf16 peak of this device, None on a CPU or an unknown GPU
                peak = peak_flops(torch.cuda.get_device_name(self.device)) if self.device.type == "cuda" else None
                observers.append(MirrorToWandb(mirror, cfg.train.global_batch * cfg.model.seq_len, self.n_params,
                                               info.world, peak))
        observers.append(LogProgress(self, end))
        observers.append(Checkpoint(self, cfg_dict, guard, end, ledger))
        return observers


def run(cfg: Config, hydra_files: dict | None = None) -> Path:
    """Train with a resolved config; returns the run dir.  ``hydra_files`` (name -> yaml text) are written by rank 0
    under <run_dir>/.hydra/."""
    # first of all: from here on SIGUSR1/SIGTERM mean "checkpoint at the end of the current step, then exit 75"
    # (dettrain/signals.py); one that came before (python -m dettrain flags them from its first
    # line) counts the same
    guard = ckpt.PreemptionGuard()
    guard.install()
    guard.signum = guard.signum or early_signal()
    set_env_before_cuda(cfg.det.tier)
    rank, world, _ = D.env_world()
    lock = None
    trainer = None
    try:
        validate(cfg, world)
        info = D.init(cfg.dist)
        apply_tier(cfg.det)
        seed_process(cfg.seed, info.rank)
        run_dir = rundir.resolve_run_dir(cfg, info, rundir.multirun_job())
        # rank 0 creates and locks the run dir and refuses to overwrite a run in it; every rank learns the verdict
        lock, note = rundir.open_run_dir(run_dir, cfg, info)
        rundir.setup_logging(run_dir, info)
        if note:
            log.info(note)
        cfg_dict = to_container(cfg)
        if info.is_main:
            rundir.write_run_files(run_dir, cfg_dict, hydra_files or {})
        trainer = Trainer(cfg, info, run_dir)
        trainer.fit(cfg_dict, guard)
        D.barrier(info)
        if trainer.preempted:  # checkpoint written: tell the launcher to requeue (ckpt.resume=auto continues)
            raise SystemExit(ckpt.REQUEUE_EXIT_CODE)
        return run_dir
    finally:
        guard.restore()
        if trainer is not None:
            # the engine before the process group goes (dist.shutdown says why); torch's attention and the kernel
            # switches back for whatever runs next
            trainer.close()
        D.shutdown()
        if lock is not None:
            lock.release()  # after the last write; the kernel would drop it at exit anyway
