"""The training loop, top to bottom: data -> forward -> backward -> canonical reduce -> clip -> step -> fingerprint
-> ledger.

Tiers 0-2 sync gradients with PyTorch DDP (the baseline users know); tiers 3-4 with dettrain's canonical reducer
(collectives.py), whose summation order is written in our code.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from dettrain import dist as D
from dettrain.collectives import CanonicalReducer, FlatLayout, all_gather_flat, canonical_mean
from dettrain.config import Config, config_hash, to_container, validate
from dettrain.data import SampleDataset, StepSampler, load_tokens
from dettrain.determinism import TIERS, apply_tier, audit, seed_micro_batch, seed_process, set_env_before_cuda, versions
from dettrain.fingerprint import MASK64, combine, fingerprint, format_fp, segment_fingerprints
from dettrain.ledger import LEDGER_NAME, LedgerWriter, f32_bits
from dettrain.model import build_model, num_params
from dettrain.optim import FlatAdamW, lr_at

log = logging.getLogger("dettrain")


# ---- run directory and logging ----------------------------------------------------------------------------
def resolve_run_dir(cfg: Config, info: D.DistInfo) -> Path:
    """One run dir for every rank: run_dir, else outputs/<exp>/<id> with id from DETTRAIN_RUN_ID, torchrun's
    rendezvous id (stable across elastic restarts), or rank 0's timestamp broadcast to all ranks."""
    if cfg.run_dir:
        return Path(cfg.run_dir)
    rid = os.environ.get("DETTRAIN_RUN_ID", "")
    if not rid:
        te = os.environ.get("TORCHELASTIC_RUN_ID", "")
        rid = te if te and te != "none" else ""
    if not rid:
        rid = D.broadcast_object(time.strftime("%Y%m%d-%H%M%S-") + f"{os.getpid()}", info)
    return Path("outputs") / cfg.exp_name / rid


def setup_logging(run_dir: Path, info: D.DistInfo) -> None:
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    log.handlers.clear()
    log.setLevel(logging.INFO)
    log.propagate = False
    fh = logging.FileHandler(run_dir / "logs" / f"rank{info.rank}.log")
    fh.setFormatter(logging.Formatter(f"%(asctime)s [rank {info.rank}] %(message)s"))
    log.addHandler(fh)
    if info.is_main:  # other ranks stay quiet on the console
        sh = logging.StreamHandler(sys.stdout)
        sh.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(sh)


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
                                         foreach=False)
        self.tokens = load_tokens(cfg.data)
        self.dataset = SampleDataset(self.tokens, cfg.model.seq_len)
        if int(self.tokens.max()) >= cfg.model.vocab_size:
            raise ValueError(f"data holds token id {int(self.tokens.max())} >= model.vocab_size="
                             f"{cfg.model.vocab_size}; raise model.vocab_size")
        self.sampler = StepSampler(self.dataset, cfg.seed, t.global_batch, t.micro_batch, info.rank, info.world,
                                   cfg.data.num_workers)
        self.step = 0
        self.ledger: LedgerWriter | None = None

    # ---- fingerprints --------------------------------------------------------------------------------------
    def _named(self, what: str) -> list[tuple[str, torch.Tensor, int]]:
        """(name, flat tensor, global offset) of params/grads/optimizer state in the canonical layout (DDP tiers)."""
        out = []
        n_total = self.layout.numel
        for name, p, off, _ in self.layout.entries:
            if what == "param":
                out.append((name, p.detach().reshape(-1), off))
            elif what == "grad":
                out.append((name, p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel()), off))
            else:
                st = self.opt.state.get(p, {})
                for k, base in (("exp_avg", 0), ("exp_avg_sq", n_total)):
                    v = st.get(k)
                    out.append((f"{k}.{name}", (v if v is not None else torch.zeros_like(p)).reshape(-1),
                                base + off))
        return out

    def fingerprints(self, per_tensor: bool) -> tuple[dict[str, int], dict[str, dict[str, str]]]:
        """Step fingerprints of grad/param/opt (and per-tensor ones) combined over ranks."""
        N = self.layout.numel
        if self.canonical:
            r = self.reducer
            # each rank hashes the regions it owns (its shards when sharded; everything, on rank 0 only, if not)
            if r.shard and self.info.world > 1:
                regions = [(max(a, 0), min(b, N)) for a, b in r.owned() if a < N]
            else:
                regions = [(0, N)] if self.info.is_main else []
            parts: dict[str, int] = {}
            for key, buf, base in (("grad", r.grad, 0), ("param", r.param, 0), ("opt", self.opt.exp_avg, 0),
                                   ("opt", self.opt.exp_avg_sq, N)):
                parts[key] = (parts.get(key, 0) + sum(fingerprint(buf[a:b], base + a) for a, b in regions))
            totals = dict(zip(parts, sum_u64(list(parts.values()), self.info)))
            tensors: dict[str, dict[str, str]] = {}
            if per_tensor:
                segs = self.layout.segments()
                for key, buf in (("grad", r.grad), ("param", r.param)):
                    local: dict[str, int] = {}
                    for a, b in regions:
                        for name, v in segment_fingerprints(buf[a:b], a, segs).items():
                            local[name] = combine([local.get(name, 0), v])
                    tensors[key] = {k: format_fp(v) for k, v in sum_dicts(local, self.info).items()}
            return totals, tensors
        # DDP tiers: every rank holds everything; rank 0 hashes
        totals, tensors = {}, {}
        if self.info.is_main:
            for key in ("grad", "param", "opt"):
                named = self._named(key)
                vals = {n: fingerprint(t, off) for n, t, off in named}
                totals[key] = combine(vals.values())
                if per_tensor and key != "opt":
                    tensors[key] = {n: format_fp(v) for n, v in vals.items()}
        return totals, tensors

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
                loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))
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
            grad_fp_needed = True
        else:
            gnorm = None
            grad_fp_needed = True
        # fingerprint the reduced gradient before clipping (what every rank agreed on)
        per_tensor = cfg.log.tensor_every > 0 and self.step % cfg.log.tensor_every == 0
        gtotals, gtensors = self._grad_fps(per_tensor) if grad_fp_needed else ({}, {})
        clip = cfg.optim.clip_grad_norm
        if self.canonical:
            if clip > 0:
                coef = clip / (gnorm + 1e-6)
                if coef < 1.0:
                    for a, b in self.reducer.owned():
                        self.reducer.grad[a:b].mul_(coef)
            for g in self.opt.param_groups if hasattr(self.opt, "param_groups") else []:
                g["lr"] = lr
            self.opt.step(lr)
            self.reducer.gather_params()
        else:
            gnorm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip if clip > 0 else float("inf")))
            for g in self.opt.param_groups:
                g["lr"] = lr
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        totals, tensors = self._post_fps(per_tensor)
        batch_all = sum_u64([batch_fp], info)[0]
        lossf = float(loss.item())
        rec = {"kind": "step", "step": self.step, "loss": lossf, "loss_bits": f"{f32_bits(lossf):08x}",
               "batch": format_fp(batch_all), "grad": format_fp(gtotals.get("grad", 0)),
               "param": format_fp(totals.get("param", 0)), "opt": format_fp(totals.get("opt", 0)),
               "lr": lr, "grad_norm": gnorm}
        if per_tensor:
            rec["tensors"] = {**gtensors, **tensors}
        return rec

    def _grad_fps(self, per_tensor: bool):
        totals, tensors = self.fingerprints(per_tensor)
        return {"grad": totals.get("grad", 0)}, {k: v for k, v in tensors.items() if k == "grad"}

    def _post_fps(self, per_tensor: bool):
        totals, tensors = self.fingerprints(per_tensor)
        return totals, {k: v for k, v in tensors.items() if k != "grad"}

    # ---- header and loop -----------------------------------------------------------------------------------
    def header(self, cfg_dict: dict) -> dict:
        return {"config": cfg_dict, "config_hash": config_hash(cfg_dict), "versions": versions(),
                "world_size": self.info.world, "tier": self.cfg.det.tier, "tier_name": TIERS[self.cfg.det.tier],
                "threads": torch.get_num_threads(), "backend": self.info.backend, "device": str(self.device),
                "n_params": num_params(self.model), "n_tokens": int(len(self.tokens)),
                "audit": audit(self.cfg.det.tier)}

    def fit(self, cfg_dict: dict) -> None:
        cfg, info = self.cfg, self.info
        if info.is_main:
            self.ledger = LedgerWriter(self.run_dir / LEDGER_NAME, self.header(cfg_dict))
        end = cfg.train.steps if cfg.train.stop_after is None else cfg.train.stop_after + 1
        tok_per_step = cfg.train.global_batch * cfg.model.seq_len
        log.info(f"dettrain: {num_params(self.model):,} params, tier {cfg.det.tier} ({TIERS[cfg.det.tier]}), "
                 f"world {info.world}, {self.M} micro-batches/step, run dir {self.run_dir}")
        self.model.train()
        it = iter(self.sampler)
        t0 = time.perf_counter()
        last_t, last_step = t0, self.step
        while self.step < end:
            rec = self.train_step(next(it))
            if self.ledger is not None:
                self.ledger.write(rec)
            if (self.step + 1) % cfg.log.every == 0 or self.step + 1 == end:
                now = time.perf_counter()
                tps = tok_per_step * (self.step + 1 - last_step) / max(now - last_t, 1e-9)
                last_t, last_step = now, self.step + 1
                log.info(f"step {self.step + 1:>5}/{cfg.train.steps} | loss {rec['loss']:.4f} | lr {rec['lr']:.2e} "
                         f"| gnorm {rec['grad_norm']:.3f} | {tps:,.0f} tok/s | param {rec['param'][:8]}")
            self.step += 1
        elapsed = time.perf_counter() - t0
        log.info(f"done: {self.step} steps in {elapsed:.1f} s; ledger {self.run_dir / LEDGER_NAME}")
        if self.ledger is not None:
            self.ledger.close()


def run(cfg: Config, hydra_files: dict | None = None) -> Path:
    """Train with a resolved config; returns the run dir.  ``hydra_files`` (name -> yaml text) are written by rank 0
    under <run_dir>/.hydra/."""
    set_env_before_cuda(cfg.det.tier)
    rank, world, _ = D.env_world()
    validate(cfg, world)
    info = D.init(cfg.dist)
    try:
        apply_tier(cfg.det)
        seed_process(cfg.seed, info.rank)
        run_dir = resolve_run_dir(cfg, info)
        if info.is_main:
            run_dir.mkdir(parents=True, exist_ok=True)
        D.barrier(info)
        setup_logging(run_dir, info)
        cfg_dict = to_container(cfg)
        if info.is_main:
            (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(cfg_dict)))
            for name, text in (hydra_files or {}).items():
                (run_dir / ".hydra").mkdir(exist_ok=True)
                (run_dir / ".hydra" / name).write_text(text)
        trainer = Trainer(cfg, info, run_dir)
        trainer.fit(cfg_dict)
        D.barrier(info)
        return run_dir
    finally:
        D.shutdown()


def json_dump(obj) -> str:
    return json.dumps(obj, indent=1, default=str)
