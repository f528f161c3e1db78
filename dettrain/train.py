"""The training loop, top to bottom: data -> forward -> backward -> canonical reduce -> clip -> step -> fingerprint
-> ledger.

Tiers 0-2 sync gradients with PyTorch DDP (the baseline users know); tiers 3-4 with dettrain's canonical reducer
(collectives.py), whose summation order is written in our code.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import time
from pathlib import Path

import torch

from dettrain import batch_invariant as bi
from dettrain import checkpoint as ckpt
from dettrain import dist as D
from dettrain import rundir
from dettrain.collectives import CanonicalReducer, FlatLayout, all_gather_flat, canonical_mean
from dettrain.config import Config, config_hash, to_container, validate
from dettrain.data import SampleDataset, StepSampler, load_tokens
from dettrain.determinism import (
    TIERS,
    apply_tier,
    audit,
    resolve_batch_invariant,
    seed_micro_batch,
    seed_process,
    set_env_before_cuda,
    versions,
)
from dettrain.errors import UserError
from dettrain.fingerprint import MASK64, combine, fingerprint, fingerprint_many, format_fp, segment_fingerprints
from dettrain.ledger import LEDGER_NAME, LedgerWriter, f32_bits
from dettrain.model import build_model, num_params
from dettrain.nonfinite import check_step as check_finite
from dettrain.optim import FlatAdamW, lr_at
from dettrain.reference import EXIT_DIVERGED, DivergenceStop, LiveCheck
from dettrain.wandb_io import WandbMirror

log = logging.getLogger("dettrain")


# ---- cross-rank integer sums (fingerprints combine exactly by integer addition) -----------------------------
def sum_u64(values: list[int], info: D.DistInfo) -> list[int]:
    if info.world == 1:
        return [v & MASK64 for v in values]
    values = [v & MASK64 for v in values]
    t = torch.tensor([v - (1 << 64) if v >= 1 << 63 else v for v in values], dtype=torch.int64)
    t = t.to(info.device)
    out = torch.empty(info.world * len(values), dtype=torch.int64, device=info.device)
    all_gather_flat(out, t)
    rows = out.view(info.world, -1).cpu().tolist()
    return [combine(r[i] for r in rows) for i in range(len(values))]


def sum_dicts(d: dict[str, int], info: D.DistInfo) -> dict[str, int]:
    allp = D.all_gather_objects(d, info)
    keys = sorted({k for x in allp for k in x})
    return {k: combine(x.get(k, 0) for x in allp) for k in keys}


# ---- the trainer ------------------------------------------------------------------------------------------
class Trainer:
    def __init__(self, cfg: Config, info: D.DistInfo, run_dir: Path) -> None:
        self.cfg, self.info, self.run_dir = cfg, info, run_dir
        t = cfg.train
        self.M = t.global_batch // t.micro_batch  # micro-batches per step, global indices 0..M-1
        self.L = self.M // info.world  # this rank's aligned block of them
        self.canonical = cfg.det.tier >= 3
        self.device = info.device
        prec = t.precision if t.precision != "auto" else ("bf16" if self.device.type == "cuda" else "fp32")
        self.autocast = (torch.autocast(self.device.type, dtype=torch.bfloat16) if prec == "bf16"
                         else contextlib.nullcontext())

        # det.batch_invariant (default: on at tier 4 on CUDA): model.py/cross_entropy use batch_invariant.py.
        # At tier >= 2 on CUDA attention runs dettrain's Triton kernel: deterministic without atomics, and faster
        # than the deterministic SDPA backward torch falls back to (BENCHMARKS.md)
        bi.set_enabled(resolve_batch_invariant(cfg.det, self.device))
        bi.set_attention(self.device.type == "cuda" and cfg.det.tier >= 2 and bi.HAVE_TRITON)
        self.model = build_model(cfg.model, cfg.seed, self.device)
        self.layout = FlatLayout(self.model, 1, cfg.dist.bucket_mb)  # world-independent offsets for fingerprints
        if self.canonical:
            self.reducer = CanonicalReducer(self.model, info.rank, info.world, cfg.dist.bucket_mb, cfg.det.tier,
                                            cfg.dist.shard_optimizer, self.device)
            self.opt = FlatAdamW(self.reducer.param, self.reducer.grad, self.reducer.owned(), cfg.optim)
            self.ddp = None
        else:
            self.reducer = None
            self.ddp = (torch.nn.parallel.DistributedDataParallel(
                self.model, bucket_cap_mb=cfg.dist.bucket_mb,
                device_ids=[info.local_rank] if self.device.type == "cuda" else None)
                if info.world > 1 else None)
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=t.lr, betas=(cfg.optim.beta1, cfg.optim.beta2),
                                         eps=cfg.optim.eps, weight_decay=cfg.optim.weight_decay,
                                         # fused on CUDA: one elementwise kernel, no reductions, deterministic
                                         foreach=False, fused=self.device.type == "cuda")
        self.tokens = load_tokens(cfg.data)
        self.dataset = SampleDataset(self.tokens, cfg.model.seq_len)
        if int(self.tokens.max()) >= cfg.model.vocab_size:
            raise UserError(f"data holds token id {int(self.tokens.max())} >= model.vocab_size="
                             f"{cfg.model.vocab_size}; raise model.vocab_size")
        self.sampler = StepSampler(self.dataset, cfg.seed, t.global_batch, t.micro_batch, info.rank, info.world,
                                   cfg.data.num_workers)
        self.step = 0
        self.preempted = 0  # the signal that stopped the run (SIGUSR1/SIGTERM), after its checkpoint
        self.ledger: LedgerWriter | None = None
        self.mirror: WandbMirror | None = None  # rank 0's wandb run, opened in fit
        # live check against det.reference: agreed on by all ranks at start-up, so built on every rank
        self.live = LiveCheck(cfg, info, run_dir, to_container(cfg)) if cfg.det.reference else None

    # ---- fingerprints --------------------------------------------------------------------------------------
    def _named(self, what: str) -> list[tuple[str, torch.Tensor, int]]:
        """(name, flat tensor, global offset) of params/grads/optimizer state in the canonical layout (DDP tiers)."""
        out = []
        n_total = self.layout.numel
        for name, p, off, _ in self.layout.entries:
            if what == "param":
                out.append((name, p.detach().reshape(-1), off))
            elif what == "grad":
                out.append((name, p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel(), device=p.device),
                            off))
            else:
                st = self.opt.state.get(p, {})
                for k, base in (("exp_avg", 0), ("exp_avg_sq", n_total)):
                    v = st.get(k)
                    out.append((f"{k}.{name}", (v if v is not None else torch.zeros_like(p)).reshape(-1),
                                base + off))
        return out

    def local_fingerprints(self, keys: tuple[str, ...], per_tensor: bool) -> tuple[dict[str, int], dict]:
        """This rank's partial fingerprints of ``keys`` (grad, param, opt) and, if asked, per-tensor partials of
        grad/param.  Integer partials: summing them over ranks (``sum_u64`` / ``sum_dicts``) gives the values."""
        N = self.layout.numel
        totals: dict[str, int] = dict.fromkeys(keys, 0)  # the same keys on every rank: they are gathered
        tensors: dict[str, dict[str, int]] = {}
        if self.canonical:
            r = self.reducer
            # each rank hashes its bucket shards (its own when sharded; any split works when every rank holds all):
            # the work is spread over the ranks and the integer partials add up exactly
            regions = [(a, min(b, N)) for a, b in r.layout.own_shards(self.info.rank) if a < N]
            opt = self.opt
            views = {"grad": lambda a, b: [(r.grad[a:b], a)], "param": lambda a, b: [(r.param[a:b], a)],
                     "opt": lambda a, b: [(opt.view("exp_avg", a, b), a), (opt.view("exp_avg_sq", a, b), N + a)]}
            segs = self.layout.segments()
            # every (buffer, region) of every key in one launch and one host sync on CUDA
            parts = [(key, t, off) for key in keys for a, b in regions for t, off in views[key](a, b)]
            for (key, _, _), v in zip(parts, fingerprint_many([(t, off) for _, t, off in parts])):
                totals[key] = combine([totals[key], v])
            for key in keys:
                if per_tensor and key != "opt":
                    local: dict[str, int] = {}
                    for a, b in regions:
                        for name, v in segment_fingerprints(views[key](a, b)[0][0], a, segs).items():
                            local[name] = combine([local.get(name, 0), v])
                    tensors[key] = local
        else:  # DDP tiers: every rank holds everything; rank r hashes the tensors i with i % world == r
            for key in keys:
                named = self._named(key)[self.info.rank :: self.info.world]
                vals = dict(zip((n for n, _, _ in named), fingerprint_many([(t, off) for _, t, off in named])))
                totals[key] = combine(vals.values())
                if per_tensor and key != "opt":
                    tensors[key] = vals
        return totals, tensors

    def fingerprints(self, per_tensor: bool, keys: tuple[str, ...] = ("grad", "param", "opt")):
        """Step fingerprints of ``keys`` combined over ranks, and per-tensor ones as hex (collective: all ranks)."""
        totals, tensors = self.local_fingerprints(keys, per_tensor)
        return self.combine_fingerprints(totals, tensors, per_tensor)

    def combine_fingerprints(self, totals: dict[str, int], tensors: dict, per_tensor: bool):
        names = sorted(totals)
        summed = dict(zip(names, sum_u64([totals[k] for k in names], self.info)))
        out_t: dict[str, dict[str, str]] = {}
        if per_tensor:
            for key in ("grad", "param"):
                if key in totals:
                    out_t[key] = {n: format_fp(v) for n, v in sum_dicts(tensors.get(key, {}), self.info).items()}
        return summed, out_t

    # ---- one optimizer step --------------------------------------------------------------------------------
    def train_step(self, micro) -> dict:
        cfg, info = self.cfg, self.info
        lr = lr_at(self.step, cfg.train.lr, cfg.train.steps, cfg.optim)
        m, T = cfg.train.micro_batch, cfg.model.seq_len
        # the global batch fingerprint: element (sample j of micro-batch i, token t) has index (i*m+j)*(T+1)+t
        batch_fp = combine(fingerprint(mb.tokens, mb.index * m * (T + 1)) for mb in micro)
        losses = []
        model = self.ddp or self.model
        if self.canonical:
            self.reducer.begin_step(len(micro))
        for k, mb in enumerate(micro):
            seed_micro_batch(cfg.seed, self.step, mb.index)  # dropout etc. keyed by global micro-batch index
            tok = mb.tokens.to(self.device, non_blocking=True)
            x, y = tok[:, :-1], tok[:, 1:]
            last = k == len(micro) - 1
            sync = contextlib.nullcontext() if (self.ddp is None or last) else self.ddp.no_sync()
            with sync:
                with self.autocast:
                    logits = model(x)
                loss = bi.cross_entropy(logits, y)  # F.cross_entropy in fp32, or the batch-invariant kernel
                if self.canonical:
                    self.reducer.begin_micro(k)
                    loss.backward()  # buckets launch from the hooks during the last micro-batch's backward
                    self.reducer.end_micro(k)
                else:
                    (loss / len(micro)).backward()  # DDP averages over ranks: together the mean over M
            losses.append(loss.detach())
        loss = canonical_mean(torch.stack(losses), info.world)

        if self.canonical:
            r = self.reducer
            r.finish(scale=1.0 / self.M)
            gnorm = r.grad_norm()
        else:
            gnorm = None
        # fingerprint the reduced gradient before clipping (what every rank agreed on)
        per_tensor = cfg.log.tensor_every > 0 and self.step % cfg.log.tensor_every == 0
        # the live check needs them at a divergent step, which it only knows after the step: the pre-clip
        # gradients are gone by then, so take them every step while it is active (it drops the unneeded ones)
        per_tensor = per_tensor or (self.live is not None and self.live.needs_tensors(self.step))
        # local partials only here (no communication); combined with everything else in one gather below
        g_local, g_tensors = self.local_fingerprints(("grad",), per_tensor)
        clip = cfg.optim.clip_grad_norm
        if self.canonical:
            if clip > 0:
                coef = clip / (gnorm + 1e-6)
                if coef < 1.0:
                    for a, b in self.reducer.owned():
                        self.reducer.grad[a:b].mul_(coef)
            self.opt.step(lr)
            self.reducer.gather_params()
        else:
            gnorm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip if clip > 0 else float("inf")))
            for g in self.opt.param_groups:
                g["lr"] = lr
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        p_local, p_tensors = self.local_fingerprints(("param", "opt"), per_tensor)
        totals, tensors = self.combine_fingerprints({**g_local, **p_local, "batch": batch_fp},
                                                    {**g_tensors, **p_tensors}, per_tensor)
        batch_all = totals["batch"]
        lossf = float(loss.item())
        rec = {"kind": "step", "step": self.step, "loss": lossf, "loss_bits": f"{f32_bits(lossf):08x}",
               "batch": format_fp(batch_all), "grad": format_fp(totals.get("grad", 0)),
               "param": format_fp(totals.get("param", 0)), "opt": format_fp(totals.get("opt", 0)),
               "lr": lr, "grad_norm": gnorm}
        if per_tensor:
            rec["tensors"] = tensors
        return rec

    # ---- header and loop -----------------------------------------------------------------------------------
    def header(self, cfg_dict: dict) -> dict:
        return {"config": cfg_dict, "config_hash": config_hash(cfg_dict), "versions": versions(),
                "world_size": self.info.world, "tier": self.cfg.det.tier, "tier_name": TIERS[self.cfg.det.tier],
                "threads": torch.get_num_threads(), "backend": self.info.backend, "device": str(self.device),
                "n_params": num_params(self.model), "n_tokens": int(len(self.tokens)),
                "audit": audit(self.cfg.det.tier, threads=self.cfg.det.threads, world=self.info.world)}

    def fit(self, cfg_dict: dict, guard: ckpt.PreemptionGuard | None = None) -> None:
        cfg, info = self.cfg, self.info
        # ckpt.resume: model, optimizer, RNG streams, sampler and step of a checkpoint (before the sampler's
        # iterator exists); the ledger then drops step lines >= the resumed step and continues
        resumed = ckpt.resume(self, cfg_dict)
        # the ledger must hold exactly steps 0..k-1 of this same run (rundir.py); refused on every rank otherwise
        rundir.check_resume_ledger(self.run_dir, resumed, cfg, cfg_dict, info)
        if info.is_main:
            header = self.header(cfg_dict)
            if resumed is not None:
                ckpt.record_header_changes(self.run_dir / LEDGER_NAME, resumed.step, resumed.header_changes)
            self.ledger = LedgerWriter(self.run_dir / LEDGER_NAME, header,
                                       resume_step=None if resumed is None else resumed.step)
            if resumed is not None:
                self.ledger.write(resumed.event)
            # wandb mirrors the ledger; a wandb failure turns the mirror off, never the run
            self.mirror = WandbMirror.open(cfg, self.run_dir, header)
        end = cfg.train.steps if cfg.train.stop_after is None else cfg.train.stop_after + 1
        tok_per_step = cfg.train.global_batch * cfg.model.seq_len
        log.info(f"dettrain: {num_params(self.model):,} params, tier {cfg.det.tier} ({TIERS[cfg.det.tier]}), "
                 f"world {info.world}, {self.M} micro-batches/step, run dir {self.run_dir}")
        self.model.train()
        it = iter(self.sampler)
        t0 = time.perf_counter()
        last_t, last_step = t0, self.step
        while self.step < end:
            micro = next(it)
            rec = self.train_step(micro)
            verdict = self.live.check(rec, micro) if self.live is not None else None  # all ranks, same step
            if self.ledger is not None:
                self.ledger.write(rec)
                if verdict is not None and verdict.event is not None:
                    self.ledger.write(verdict.event)
            if self.mirror is not None:
                self.mirror.log(rec, None if verdict is None else verdict.match)
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
            if (self.step + 1) % cfg.log.every == 0 or self.step + 1 == end:
                now = time.perf_counter()
                tps = tok_per_step * (self.step + 1 - last_step) / max(now - last_t, 1e-9)
                last_t, last_step = now, self.step + 1
                log.info(f"step {self.step + 1:>5}/{cfg.train.steps} | loss {rec['loss']:.4f} | lr {rec['lr']:.2e} "
                         f"| gnorm {rec['grad_norm']:.3f} | {tps:,.0f} tok/s | param {rec['param'][:8]}")
            if verdict is not None and verdict.stop:
                self._stop_diverged(verdict.message)
            self.step += 1
            if self._checkpoint_if_due(cfg_dict, guard, end):
                break
        elapsed = time.perf_counter() - t0
        log.info(f"done: {self.step} steps in {elapsed:.1f} s; ledger {self.run_dir / LEDGER_NAME}")
        if self.ledger is not None:
            self.ledger.close()
        if self.mirror is not None:
            self.mirror.finish()

    def _checkpoint_if_due(self, cfg_dict: dict, guard: ckpt.PreemptionGuard | None, end: int) -> bool:
        """After a step: checkpoint every ckpt.every steps, at train.stop_after, and when any rank got SIGUSR1 or
        SIGTERM (all ranks agree on it here, so they checkpoint at the same step).  True: stop now (preempted)."""
        cfg = self.cfg
        sig = guard.agreed(self.info) if guard is not None else 0
        sig = sig if self.step < cfg.train.steps else 0  # the run is complete: nothing left to requeue
        stopping = self.step == end < cfg.train.steps
        if not (sig or stopping or (cfg.ckpt.every and self.step % cfg.ckpt.every == 0)):
            return False
        reason = f"preempted by {signal.Signals(sig).name}" if sig else "stop_after" if stopping else "every"
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
    # (checkpoint.py); one that came before (python -m dettrain flags them from its first line) counts the same
    guard = ckpt.PreemptionGuard()
    guard.install()
    guard.signum = guard.signum or rundir.early_signal()
    set_env_before_cuda(cfg.det.tier)
    rank, world, _ = D.env_world()
    lock = None
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
        D.shutdown()
        if lock is not None:
            lock.release()  # after the last write; the kernel would drop it at exit anyway
