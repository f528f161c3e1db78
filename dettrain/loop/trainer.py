"""The training loop, top to bottom: data -> forward -> backward -> canonical reduce -> clip -> step -> fingerprint
-> ledger.

Tiers 0-2 sync gradients with PyTorch DDP (the baseline users know); tiers 3-4 with dettrain's canonical reducer
(collectives.py), whose summation order is written in our code.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from pathlib import Path

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
from dettrain.loop.collectives import canonical_mean
from dettrain.loop.compile import compile_model
from dettrain.loop.engines import Partials, build_engine, check_engine
from dettrain.loop.nonfinite import check_step as check_finite
from dettrain.loop.optim import lr_at
from dettrain.loop.resolve import resolve
from dettrain.models import attention as attention_route
from dettrain.models.llama import build_model, num_params
from dettrain.record import rundir
from dettrain.record.fingerprint import combine_over_ranks, fingerprint_many_deferred, format_fp
from dettrain.record.ledger import LEDGER_NAME, LedgerWriter, f32_bits
from dettrain.record.reference import EXIT_DIVERGED, DivergenceStop, LiveCheck
from dettrain.record.wandb_io import WandbMirror, mfu, peak_flops, resolve_wandb
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


def device_bytes(device: torch.device) -> int | None:
    """Total memory of ``device`` (CPU: physical RAM), None if unknown."""
    try:
        if device.type == "cuda":
            return int(torch.cuda.get_device_properties(device).total_memory)
        if device.type == "cpu":
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (OSError, ValueError, RuntimeError):
        pass
    return None


def check_fits(mcfg, device: torch.device) -> None:
    """dettrain's LLaMA is built whole on the device before any sharding: refuse one whose fp32 parameters alone
    exceed the device's memory (e.g. model.vocab_size=2**31), counted on the meta device (no memory)."""
    from dettrain.models.custom import CustomModelConfig

    if isinstance(mcfg, CustomModelConfig):  # its factory is the user's: not run twice to count
        return
    total = device_bytes(device)
    if total is None:
        return
    n = num_params(build_model(mcfg, 0, "meta"))
    if 4 * n > total:
        raise UserError(f"the model has {n:,} parameters ({4 * n / 2**30:,.1f} GiB in fp32), more than the "
                        f"{total / 2**30:,.1f} GiB of {device}; it is built whole before sharding: reduce "
                        f"model.vocab_size={mcfg.vocab_size}, model.dim={mcfg.dim}, model.n_layers={mcfg.n_layers} or "
                        f"model.ffn_dim={mcfg.ffn_dim}")


# ---- the trainer ------------------------------------------------------------------------------------------
class Trainer:
    def __init__(self, cfg: Config, info: D.DistInfo, run_dir: Path) -> None:
        self.cfg, self.info, self.run_dir = cfg, info, run_dir
        t = cfg.train
        self.M = t.global_batch // t.micro_batch  # micro-batches per step, global indices 0..M-1
        self.policy = policy(cfg.det.tier)  # what the tier turns on (dettrain/tiers.py)
        self.canonical = self.policy.canonical_sum
        self.device = info.device
        # train.precision, train.compile, det.batch_invariant, det.attention on this device, decided once (resolve.py)
        self.resolved = resolve(cfg, self.device)
        prec = self.resolved.precision
        self.engine_name = check_engine(cfg)
        # FSDP2 computes in bf16 through its MixedPrecisionPolicy (fp32 master and reduce); the others autocast
        mixed = prec == "bf16"
        self.autocast = (torch.autocast(self.device.type, dtype=torch.bfloat16) if mixed and
                         self.engine_name != "fsdp2" else contextlib.nullcontext())

        # det.batch_invariant (default: on at tier 4 on CUDA): model.py/cross_entropy use kernels/batch_invariant.py.
        # det.attention (default auto: at tier >= 2 on CUDA dettrain's Triton kernel, deterministic without atomics
        # and faster than the deterministic SDPA backward torch falls back to, BENCHMARKS.md) for dettrain's LLaMA,
        # HF models and F.scaled_dot_product_attention callers; in place before the model is built (its check
        # forward runs through it) and taken out by run() at the end
        bi.set_enabled(self.resolved.batch_invariant)
        self.attention = self.resolved.attention
        attention_route.install(self.attention)
        check_fits(cfg.model, self.device)  # a model that cannot be allocated: one line, not an allocator traceback
        self.model = build_model(cfg.model, cfg.seed, self.device)
        # train.compile: blocks + loss, in place; probed under the forward's autocast (compile.py)
        self.compiled = compile_model(self.model, cfg, self.device, autocast=self.autocast)
        self.compile_s: float | None = None  # wall time of the first (compiling) step
        self.n_params = num_params(self.model)  # before sharding: FSDP2 parameters hold only this rank's rows
        # the one gradient-sync seam (engines.py): DDP, the flat canonical reducer or FSDP2
        self.engine = build_engine(self.engine_name, self.model, info, cfg.det.tier, cfg.optim, lr=t.lr,
                                   bucket_mb=cfg.dist.bucket_mb, shard_optimizer=cfg.dist.shard_optimizer,
                                   mixed_precision=mixed,
                                   reshard_after_forward=D.resolve_reshard(cfg.dist.reshard_after_forward, info.world),
                                   allow_unused=cfg.model.allow_unused)
        self.tokens = load_tokens(cfg.data)
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
        self.step = 0
        # the first step this process trains watches which parameters get a gradient (model.allow_unused)
        self._probe_pending = True
        self.preempted = 0  # the signal that stopped the run (SIGUSR1/SIGTERM), after its checkpoint
        self.ledger: LedgerWriter | None = None
        self.mirror: WandbMirror | None = None  # rank 0's wandb run, opened in fit
        # live check against det.reference: agreed on by all ranks at start-up, so built on every rank
        self.live = LiveCheck(cfg, info, run_dir, to_container(cfg)) if cfg.det.reference else None

    @property
    def layout(self):
        """The canonical flat layout (world-independent offsets of every parameter)."""
        return self.engine.layout

    # ---- fingerprints --------------------------------------------------------------------------------------
    def fingerprints(self, per_tensor: bool, keys: tuple[str, ...] = ("grad", "param", "opt")):
        """Step fingerprints of ``keys`` combined over ranks, and per-tensor ones as hex (collective: all ranks)."""
        return combine_over_ranks(self.engine.partials(keys, per_tensor), per_tensor, self.info)

    # ---- one optimizer step --------------------------------------------------------------------------------
    def train_step(self, micro) -> dict:
        cfg, info, eng = self.cfg, self.info, self.engine
        lr = lr_at(self.step, cfg.train.lr, cfg.train.steps, cfg.optim)
        m, T = cfg.train.micro_batch, cfg.model.seq_len
        # the global batch fingerprint: element (sample j of micro-batch i, token t) has index (i*m+j)*(T+1)+t;
        # hashed where the tokens are used (on CUDA: queued on the device, read with everything else at the end)
        batch_parts = []
        losses = []
        probe = eng.probe_grads() if self._probe_pending else None
        eng.begin_step(len(micro))
        for k, mb in enumerate(micro):
            seed_micro_batch(cfg.seed, self.step, mb.index)  # dropout etc. keyed by global micro-batch index
            tok = mb.tokens.to(self.device, non_blocking=True)
            batch_parts.append((tok, mb.index * m * (T + 1)))
            x, y = tok[:, :-1], tok[:, 1:]
            with eng.micro(k):
                with _phase("dettrain.forward"), self.autocast:
                    logits = eng.forward_module(x)
                with _phase("dettrain.loss"):
                    check_logits_shape(logits, y, cfg.model.vocab_size)  # never reshape a wrong layout silently
                    loss = bi.cross_entropy(logits, y)  # F.cross_entropy in fp32, or the batch-invariant kernel
                with _phase("dettrain.backward"):
                    eng.backward(loss, k)  # sums (tiers 3-4: canonical order); buckets launch during backward
            losses.append(loss.detach())
        if probe is not None:  # every backward of the step is done: the hooks have seen every gradient
            self._probe_pending = False
            self._handle_unused(probe.unused())
        with _phase("dettrain.reduce"):
            loss = canonical_mean(torch.stack(losses), info.world, self.sampler.gathered_order())
            gnorm = eng.reduce(scale=1.0 / self.M)  # the reduced gradient and its norm, agreed on by every rank

        # fingerprint the reduced gradient before clipping (what every rank agreed on)
        per_tensor = cfg.log.tensor_every > 0 and self.step % cfg.log.tensor_every == 0
        # the live check needs them at a divergent step, which it only knows after the step: the pre-clip
        # gradients are gone by then, so take them every step while it is active (it drops the unneeded ones)
        per_tensor = per_tensor or (self.live is not None and self.live.needs_tensors(self.step))
        # local partials only here (no communication); combined with everything else in one gather below
        with _phase("dettrain.fp_grad"):
            g_part = eng.partials(("grad",), per_tensor)
        with _phase("dettrain.clip_step"):
            eng.clip_(cfg.optim.clip_grad_norm, gnorm)
            eng.step(lr)
        with _phase("dettrain.fp_param_opt"):
            p_part = eng.partials(("param", "opt"), per_tensor)
        with _phase("dettrain.combine"):
            batch = Partials({"batch": 0}, {}, [(fingerprint_many_deferred(batch_parts),
                                                 [("batch", None)] * len(batch_parts))])
            # the step's one host sync: every fingerprint and the loss
            totals, tensors = combine_over_ranks(g_part.merged(p_part).merged(batch), per_tensor, info)
            lossf = float(loss.item())
        rec = {"kind": "step", "step": self.step, "loss": lossf, "loss_bits": f"{f32_bits(lossf):08x}",
               "batch": format_fp(totals["batch"]), "grad": format_fp(totals.get("grad", 0)),
               "param": format_fp(totals.get("param", 0)), "opt": format_fp(totals.get("opt", 0)),
               "lr": lr, "grad_norm": gnorm}
        if per_tensor:
            rec["tensors"] = tensors
        return rec

    def _handle_unused(self, unused: list[str]) -> None:
        """Trainable parameters no rank saw a gradient for in this (the first) step: refused, or with
        model.allow_unused left out of the update and of weight decay.  The same verdict on every rank."""
        if not unused:
            return
        shown = ", ".join(unused[:5]) + (f" (+{len(unused) - 5} more)" if len(unused) > 5 else "")
        if not self.cfg.model.allow_unused:
            raise UserError(f"{len(unused)} trainable parameter(s) received no gradient in step {self.step}: "
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
                    tok = mb.tokens.to(self.device, non_blocking=True)
                    with self.autocast:
                        logits = self.engine.forward_module(tok[:, :-1])  # FSDP2 gathers its shards as in training
                    check_logits_shape(logits, tok[:, 1:], self.cfg.model.vocab_size)
                    losses.append(bi.cross_entropy(logits, tok[:, 1:]))
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
                "audit": audit(self.cfg.det.tier, threads=self.cfg.det.threads, world=self.info.world,
                               attention=self.attention.header(self.model))}

    def fit(self, cfg_dict: dict, guard: ckpt.PreemptionGuard | None = None) -> None:
        cfg, info = self.cfg, self.info
        # ckpt.resume: model, optimizer, RNG streams, sampler and step of a checkpoint (before the sampler's
        # iterator exists); the ledger then drops step lines >= the resumed step and continues
        resumed = ckpt.resume(self, cfg_dict)
        # the ledger must hold exactly steps 0..k-1 of this same run (rundir.py); refused on every rank otherwise
        # ... and of the same data files (their fingerprints in its header), unless ckpt.allow_config_change=[data]
        rundir.check_resume_ledger(self.run_dir, resumed, cfg, cfg_dict, info, data_fp=self.data_fp)
        if info.is_main:
            header = self.header(cfg_dict)
            if resumed is not None:
                ckpt.record_header_changes(self.run_dir / LEDGER_NAME, resumed.step, resumed.header_changes,
                                           data_files=self.data_fp)
            self.ledger = LedgerWriter(self.run_dir / LEDGER_NAME, header,
                                       resume_step=None if resumed is None else resumed.step)
            if resumed is not None:
                self.ledger.write(resumed.event)
            # wandb mirrors the ledger; a wandb failure turns the mirror off, never the run
            self.mirror = WandbMirror.open(cfg, self.run_dir, header)
        end = cfg.train.steps if cfg.train.stop_after is None else cfg.train.stop_after + 1
        tok_per_step = cfg.train.global_batch * cfg.model.seq_len
        log.info(f"dettrain: {self.n_params:,} params, tier {cfg.det.tier} ({TIERS[cfg.det.tier]}), engine "
                 f"{self.engine_name}, world {info.world}, {self.M} micro-batches/step, run dir {self.run_dir}")
        self.model.train()
        it = iter(self.sampler)
        t0 = time.perf_counter()
        last_t, last_step = t0, self.step
        first_compile = self.compiled.enabled  # the first step traces and compiles: say so, time it apart
        # perf/mfu's denominator: the dense bf16 peak of this device, None on a CPU or an unknown GPU
        peak = peak_flops(torch.cuda.get_device_name(self.device)) if self.device.type == "cuda" else None
        while self.step < end:
            t_step = time.perf_counter()
            micro = next(it)
            if first_compile:
                log.info(f"step {self.step}: compiling (torch.compile: {len(self.compiled.units)} blocks + loss) "
                         "...")
                t_first = time.perf_counter()
            try:
                rec = self.train_step(micro)
            except UserError:  # a model that breaks the contract at its first step (same verdict on every rank)
                self._close_record(exit_code=2)
                D.barrier(info)  # nobody leaves before rank 0 has closed the ledger (torchrun kills the rest)
                raise
            # the step's wall time ends at its agreed loss and grad norm (.item(): the device has synchronized)
            step_s = time.perf_counter() - t_step
            if self.eval_due(self.step):  # the updated model, before the step line is written (it carries the loss)
                val = self.evaluate()
                rec.update(val_loss=val, val_loss_bits=f"{f32_bits(val):08x}")
            verdict = self.live.check(rec, micro) if self.live is not None else None  # all ranks, same step
            if self.ledger is not None:
                self.ledger.write(rec)
                if verdict is not None and verdict.event is not None:
                    self.ledger.write(verdict.event)
            if self.mirror is not None:
                perf = None
                if not first_compile:  # the compiling step's time is compile time, not throughput
                    tok_s = tok_per_step / max(step_s, 1e-9)
                    perf = {"tokens_per_s": tok_s, "mfu": mfu(self.n_params, tok_s, info.world, peak)}
                self.mirror.log(rec, verdict, perf)
            if first_compile:  # tokens/s from here on leaves the compile out
                first_compile = False
                last_t, last_step = time.perf_counter(), self.step + 1
                self.compile_s = last_t - t_first
                log.info(f"step {self.step}: compile+first step {self.compile_s:.1f} s")
            halt = check_finite(rec, cfg)  # loss and grad norm are agreed values: every rank stops at this step
            if halt is not None:
                if self.ledger is not None:
                    self.ledger.write(halt.event)
                    self.ledger.close()
                    self.ledger = None
                if self.mirror is not None:
                    self.mirror.finish(exit_code=halt.exit_code)
                    self.mirror = None
                D.barrier(info)  # nobody leaves before rank 0 has closed the ledger (torchrun kills the rest)
                raise halt
            if (self.step + 1) % cfg.log.every == 0 or self.step + 1 == end or "val_loss" in rec:
                now = time.perf_counter()
                n = self.step + 1 - last_step
                speed = f"{tok_per_step * n / max(now - last_t, 1e-9):,.0f} tok/s" if n else "compiled"
                last_t, last_step = now, self.step + 1
                # the ledger's step number (0-based), then how many of train.steps are done (README "Step numbers")
                log.info(f"step {self.step:>5} ({self.step + 1}/{cfg.train.steps}) | loss {rec['loss']:.4f} "
                         f"| lr {rec['lr']:.2e} | gnorm {rec['grad_norm']:.3f} | {speed} | param {rec['param'][:8]}"
                         + (f" | val {rec['val_loss']:.4f}" if "val_loss" in rec else ""))
            if verdict is not None and verdict.stop:
                self._stop_diverged(verdict.message)
            self.step += 1
            if self._checkpoint_if_due(cfg_dict, guard, end):
                break
        elapsed = time.perf_counter() - t0
        first = f" (compile+first step {self.compile_s:.1f} s)" if self.compile_s is not None else ""
        log.info(f"done: {self.step} steps in {elapsed:.1f} s{first}; ledger {self.run_dir / LEDGER_NAME}")
        if self.ledger is not None:
            self.ledger.close()
        if self.mirror is not None:
            self.mirror.finish()

    def _checkpoint_if_due(self, cfg_dict: dict, guard: ckpt.PreemptionGuard | None, end: int) -> bool:
        """After a step: checkpoint every ckpt.every steps, at train.stop_after, after the last step (ckpt.final),
        and when any rank got SIGUSR1 or SIGTERM (all ranks agree on it here, so they checkpoint at the same step).
        True: stop now (preempted)."""
        cfg = self.cfg
        sig = guard.agreed(self.info) if guard is not None else 0
        sig = sig if self.step < cfg.train.steps else 0  # the run is complete: nothing left to requeue
        stopping = self.step == end < cfg.train.steps
        every = bool(cfg.ckpt.every and self.step % cfg.ckpt.every == 0)
        final = cfg.ckpt.final and self.step == cfg.train.steps
        if not (sig or stopping or every or final):
            return False
        reason = (f"preempted by {signal.Signals(sig).name}" if sig else "stop_after" if stopping
                  else "every" if every else "final")
        path = ckpt.save(self, cfg_dict, reason)
        if self.ledger is not None:
            ev = {"kind": "event", "event": "preempted" if sig else "checkpoint", "step": self.step,
                  "path": str(path.relative_to(self.run_dir)) if path.is_relative_to(self.run_dir) else str(path),
                  "reason": reason}
            if sig:
                ev["exit_code"] = ckpt.REQUEUE_EXIT_CODE
            self.ledger.write(ev)
        if sig:
            log.info(f"{signal.Signals(sig).name}: checkpoint {path} after step {self.step}; exiting with "
                     f"{ckpt.REQUEUE_EXIT_CODE} (requeue with ckpt.resume=auto)")
            self.preempted = sig
        return bool(sig)

    def _close_record(self, exit_code: int) -> None:
        """Close the ledger and the wandb run before stopping early (rank 0; a no-op elsewhere)."""
        if self.ledger is not None:
            self.ledger.close()
            self.ledger = None
        if self.mirror is not None:
            self.mirror.finish(exit_code=exit_code)
            self.mirror = None

    def _stop_diverged(self, message: str) -> None:
        """det.on_divergence=stop: close the ledger and wandb, then stop every rank at this same step."""
        if self.ledger is not None:
            self.ledger.close()
            self.ledger = None
        if self.mirror is not None:
            self.mirror.finish(exit_code=EXIT_DIVERGED)
            self.mirror = None
        D.barrier(self.info)  # torchrun kills every rank once one exits: nobody leaves before rank 0 is done
        raise DivergenceStop(message)


def run(cfg: Config, hydra_files: dict | None = None) -> Path:
    """Train with a resolved config; returns the run dir.  ``hydra_files`` (name -> yaml text) are written by rank 0
    under <run_dir>/.hydra/."""
    # first of all: from here on SIGUSR1/SIGTERM mean "checkpoint at the end of the current step, then exit 75"
    # (dettrain/checkpoint/preemption.py); one that came before (python -m dettrain flags them from its first
    # line) counts the same
    guard = ckpt.PreemptionGuard()
    guard.install()
    guard.signum = guard.signum or rundir.early_signal()
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
            trainer.engine.close()  # before the process group goes (dist.shutdown says why)
        attention_route.uninstall()  # torch's F.scaled_dot_product_attention back for whatever runs next
        D.shutdown()
        if lock is not None:
            lock.release()  # after the last write; the kernel would drop it at exit anyway
