"""The library API: make your own PyTorch loop bitwise reproducible with a handful of lines.

    import dettrain
    info = dettrain.setup(tier=4, seed=0)                     # tier settings, process group, seeds
    model = MyModel().to(info.device)                          # fp32 parameters, any nn.Module
    sync = dettrain.GradSync(model, accumulate="tree")         # canonical gradient sync ("fold" for tier 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)       # any optimizer
    ledger = dettrain.StepLedger("out/ledger.jsonl", model, opt, config={...})
    for step in range(steps):
        losses = []
        for k, index in enumerate(sync.my_micro_batches(M)):   # this rank's global micro-batch indices
            dettrain.seed_micro_batch(seed, step, index)       # dropout keyed by the global index, not the rank
            loss = loss_fn(model(x[index]), y[index])
            sync.backward(loss, k)                             # k-th of this rank's micro-batches
            losses.append(loss)
        sync.reduce()                                          # p.grad = the step's mean gradient, canonical order
        norm = sync.clip_grad_norm_(1.0)                       # the canonical norm (same bits on any world size)
        opt.step()
        ledger.log(step, loss=sync.mean(losses), batch=global_tokens_of_step)   # before zero_grad
        opt.zero_grad(set_to_none=False)

At accelerate/Fabric's level: ``GradSync(model, precision="bf16")`` with ``with sync.autocast():`` around the
forward (bf16 compute, fp32 master weights and reduction), ``GradSync(model, shard=True)`` (the FSDP2 engine behind
the same calls; build the optimizer after it), ``sampler(my_dataset, ...)`` over any map-style Dataset,
``save_checkpoint(..., extra={"scheduler": sched, ...})`` / ``load_checkpoint(..., extra=...)`` for any Stateful,
and ``ledger.log(step, ..., lr=lr)``: extra numbers in the ledger line and the wandb row.

``accumulate="tree"`` sums the M micro-batch gradients of a step by one balanced binary tree over their global
indices (the same bits on 1, 2, 4 ... ranks; M and the world size powers of two); ``"fold"`` adds the local ones
in order and the ranks' partial sums by a fixed tree (identical reruns on a fixed world size, whatever the backend
or bucket size picks).  Either way no float is summed inside NCCL or Gloo (collectives.CanonicalReducer).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

from dettrain import dist as D
from dettrain.determinism import DetConfig, apply_tier, audit, seed_process, set_env_before_cuda, versions
from dettrain.errors import UserError
from dettrain.record import schema
from dettrain.record.fingerprint import combine, fingerprint, fingerprint_many, sum_u64
from dettrain.record.ledger import LedgerWriter
from dettrain.sync.collectives import CanonicalReducer, FlatLayout, canonical_mean
from dettrain.tiers import lowest, policy

ACCUMULATE = {"fold": "canonical_sum", "tree": "world_invariant"}


def setup(tier: int = 3, seed: int = 0, threads: int = 1, backend: str = "auto") -> D.DistInfo:
    """Apply determinism tier ``tier`` (0-4) to this process, start the process group (under torchrun) and seed
    every process-wide stream from ``seed``.  Returns the rank, world size and device."""
    policy(tier)  # a UserError naming the valid tiers
    set_env_before_cuda(tier)
    info = D.init(D.DistConfig(backend=backend))
    apply_tier(DetConfig(tier=tier, threads=threads))
    seed_process(seed, info.rank)
    return info


class GradSync:
    """Canonical gradient sync for any model and optimizer (a DDP replacement whose sums are ordered by dettrain).

    Replicated (default): the parameters become views into one flat fp32 buffer (``collectives.CanonicalReducer``);
    after ``reduce()`` every ``p.grad`` holds the step's mean gradient, the same bits on every rank.
    ``shard=True``: the FSDP2 engine (``fully_shard`` per block, ZeRO-3) with its canonical reduce-scatter; the
    parameters become DTensors holding this rank's rows, and ``p.grad`` this rank's rows of the same mean gradient
    (at accumulate='tree' the same bits as the replicated sync; build the optimizer after GradSync).
    ``precision="bf16"``: bf16 compute under ``sync.autocast()`` with fp32 master weights and fp32 reduction, as
    the trainer's train.precision=bf16 (torch.autocast; sharded, FSDP2's MixedPrecisionPolicy)."""

    def __init__(self, model: nn.Module, *, accumulate: str = "fold", bucket_mb: float = 25.0,
                 precision: str = "fp32", shard: bool = False) -> None:
        if accumulate not in ACCUMULATE:
            raise UserError(f"accumulate={accumulate!r}: use 'fold' (identical reruns on a fixed world size) or "
                            "'tree' (the same bits on any power-of-two world size)")
        if precision not in ("fp32", "bf16"):
            raise UserError(f"precision={precision!r}: use 'fp32' or 'bf16' (bf16 compute, fp32 master weights and "
                            "reduction)")
        rank, world = (torch.distributed.get_rank(), torch.distributed.get_world_size()) \
            if torch.distributed.is_initialized() else (0, 1)
        if accumulate == "tree" and world & (world - 1):
            raise UserError(f"accumulate='tree' needs a power-of-two world size, got {world} ranks")
        device = next(model.parameters()).device
        self.model, self.rank, self.world = model, rank, world
        self.mixed = precision == "bf16"
        tier = lowest(ACCUMULATE[accumulate]).tier
        self.engine = self.reducer = None
        if shard:
            self.engine = _sharded_engine(model, D.DistInfo(rank, world, 0, device, None), tier, self.mixed)
            self.invariant, self.assignment = self.engine.policy.world_invariant, self.engine.assignment
        else:
            self.reducer = CanonicalReducer(model, rank, world, bucket_mb, tier, False, device)
            self.invariant, self.assignment = self.reducer.invariant, "block"
        self.device = device
        self._count = 0
        self._norm: torch.Tensor | float | None = None

    def autocast(self):
        """The context of the forward and loss: bf16 autocast with precision='bf16' (replicated), else nothing
        (fp32, or sharded: FSDP2 casts the gathered parameters itself)."""
        from dettrain.sync.engines import Engine

        if self.engine is not None:
            return type(self.engine).autocast(self.device, self.mixed)
        return Engine.autocast(self.device, self.mixed)

    def my_micro_batches(self, total: int) -> range:
        """This rank's global micro-batch indices of a step of ``total``: an aligned block of total / world
        (sharded at accumulate='tree': round-robin rank, rank + world, ..., each round a block of the tree)."""
        from dettrain.data import micro_indices

        if total % self.world:
            raise UserError(f"{total} micro-batches per step do not divide over {self.world} ranks")
        per = total // self.world
        if self.invariant and per & (per - 1):
            raise UserError(f"accumulate='tree' needs a power-of-two number of micro-batches per rank, got {per}")
        self._count = per
        return micro_indices(total, self.rank, self.world, self.assignment)

    def backward(self, loss: torch.Tensor, k: int, count: int | None = None) -> None:
        """``loss.backward()`` of this rank's k-th micro-batch of ``count`` (default: from my_micro_batches)."""
        n = count or self._count
        if not n:
            raise UserError("GradSync.backward: give count=, or call my_micro_batches(total) first")
        self._last_count = n
        if self.engine is not None:
            if k == 0:
                self.engine.begin_step(n)
            self.engine.backward(loss, k)  # each round reduce-scattered canonically, the tree built on shards
            return
        if k == 0:
            self.reducer.begin_step(n)
        self.reducer.begin_micro(k)
        loss.backward()  # buckets launch from the hooks during the last micro-batch's backward
        self.reducer.end_micro(k)

    def reduce(self) -> None:
        """Finish the sync: every p.grad = (sum of the step's micro-batch gradients) / M, in canonical order."""
        M = self._last_count * self.world
        if self.engine is not None:
            self._norm = self.engine.reduce(1.0 / M)  # the canonical norm, computed with the scaling
            return
        self._norm = None
        self.reducer.finish(scale=1.0 / M)
        for _, p, o, k in self.reducer.layout.entries:
            p.grad = self.reducer.grad[o : o + k].view_as(p)

    def grad_norm(self) -> float:
        """L2 norm of the reduced gradient, by one split-independent definition (collectives.exact_sumsq)."""
        if self.engine is not None:
            return float(self._norm)
        return self.reducer.grad_norm()

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Scale the gradient by max_norm / (norm + 1e-6) when that is below 1; returns the norm before."""
        norm = self.grad_norm()
        if self.engine is not None:
            self.engine.clip_(max_norm, norm)
            return norm
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            self.reducer.grad.mul_(coef)
        return norm

    def mean(self, values: list[torch.Tensor]) -> float:
        """Mean of per-micro-batch scalars (this rank's, in order) over the whole step, in canonical order."""
        from dettrain.data import micro_indices

        total = len(values) * self.world  # the gathered values are rank-major: put them in global index order
        order = [j for r in range(self.world) for j in micro_indices(total, r, self.world, self.assignment)]
        return float(canonical_mean(torch.stack([v.detach() for v in values]), self.world, order).item())


def _sharded_engine(model: nn.Module, info: D.DistInfo, tier: int, mixed: bool):
    """The FSDP2 engine (from the registry, as ``dist.engine=fsdp2`` builds it) around ``model`` for GradSync.
    The user's optimizer updates the shards: the engine's own AdamW moments are released."""
    from dettrain.config import Config
    from dettrain.sync.engines import engine_from_config

    cfg = Config()
    cfg.det.tier, cfg.dist.engine = tier, "fsdp2"
    engine = engine_from_config(cfg, model, info, mixed_precision=mixed)  # checked: torch >= 2.9, one line else
    engine.exp_avg = engine.exp_avg_sq = None
    return engine


class StepLedger:
    """A ``ledger.jsonl`` that ``python -m dettrain.diff`` reads, for your own loop: fingerprints of the model's
    parameters and gradients and of the optimizer's state per step, in the canonical flat layout.

    ``log`` is a collective (every rank calls it, each hashes 1/W of the tensors); rank 0 writes."""

    def __init__(self, path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                 config: dict | None = None, tier: int | None = None, resume_step: int | None = None,
                 wandb: dict | bool | None = None) -> None:
        """``resume_step``: continue the ledger after ``load_checkpoint`` returned that step (lines from it on,
        written after the checkpoint, are dropped; the header stays).  ``wandb``: mirror every step line to wandb
        (rank 0; True, or settings ``mode`` offline|online|disabled, ``project``, ``entity``, ``group``,
        ``name``): the history rows ``dettrain panel`` and ``dettrain diff`` read, in the ledger's directory;
        a resumed ledger continues the same wandb run.  A wandb failure turns the mirror off, never the loop."""
        self.model, self.opt = model, optimizer
        self.layout = FlatLayout(model, 1, 25.0)
        self.rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        self.world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        self.info = D.DistInfo(self.rank, self.world, 0, next(model.parameters()).device, None)
        self.writer = None
        self.mirror = None
        from dettrain.config import config_hash

        chash = config_hash(config or {})
        refusal = _ledger_refusal(Path(path), chash) if self.rank == 0 and resume_step is None else None
        refusal = D.broadcast_object(refusal, self.info)  # every rank stops, none waits in log() for rank 0
        if refusal:
            raise UserError(refusal)
        if self.rank == 0:
            header = {"config": config or {}, "config_hash": chash, "versions": versions(),
                      "world_size": self.world,
                      "tier": tier, "threads": torch.get_num_threads(), "device": str(self.info.device),
                      "n_params": self.layout.numel, "source": "dettrain.StepLedger",
                      "audit": audit(tier, threads=torch.get_num_threads(), world=self.world) if tier is not None
                      else []}
            self.writer = LedgerWriter(Path(path), header, resume_step)
            self.mirror = _open_mirror(wandb, Path(path).parent, {"kind": "header", **header},
                                       resume_step is not None) if wandb else None

    def _parts(self) -> dict[str, list[tuple[torch.Tensor, int]]]:
        N = self.layout.numel
        out: dict[str, list[tuple[torch.Tensor, int]]] = {"grad": [], "param": [], "opt": []}
        for i, (_, p, off, _) in enumerate(self.layout.entries):
            sharded = _is_dtensor(p)  # GradSync(shard=True): every rank hashes its rows of every parameter
            if not sharded and i % self.world != self.rank:
                continue
            at = off + _row_start(p, self.rank, self.world) if sharded else off
            out["param"].append((_local(p.detach()).reshape(-1), at))
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            out["grad"].append((_local(g).reshape(-1), at))
            st = self.opt.state.get(p, {}) if self.opt is not None else {}
            tensors = [k for k in sorted(st) if torch.is_tensor(st[k]) and st[k].shape == p.shape]
            for j, k in enumerate(tensors):  # every per-element state tensor, in name order
                out["opt"].append((_local(st[k]).reshape(-1), j * N + at))
        return out

    def log(self, step: int, *, loss: float, batch: torch.Tensor | None = None, **extra) -> dict:
        """Write step ``step``: loss (float), the fingerprint of ``batch`` (the step's global token ids, any
        tensor the same on every rank), of parameters, gradients (as ``p.grad`` holds them now: call it after
        ``optimizer.step()`` and before ``zero_grad``) and optimizer state; ``extra`` JSON fields, the numeric
        ones also in the wandb mirror's row of the step (``train/<name>``, or the name as given when it has a
        ``/``)."""
        parts = self._parts()
        names = (*schema.from_source("reduced"), *schema.from_source("updated"))
        local = [combine(fingerprint_many(parts[k])) for k in names]
        values = dict(zip(names, sum_u64(local, self.info)))
        if batch is not None:
            values.update(dict.fromkeys(schema.from_source("tokens"), fingerprint(batch.reshape(-1))))
        rec = schema.step_line(int(step), float(loss), values, extra)  # the fields as record/schema.py declares
        if self.writer is not None:
            self.writer.write(rec)
            if self.mirror is not None:  # after the ledger line: wandb never holds a step the ledger lacks
                self.mirror.log(rec, extra=extra)
        return rec

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.mirror is not None:
            self.mirror.finish()
            self.mirror = None


def _ledger_refusal(path: Path, chash: str) -> str | None:
    """Why a fresh ledger (``resume_step=None``) may not replace the file at ``path``: it holds steps of a run of
    another config, or cannot be read as a ledger (None: nothing there, a header only, or this config's own run
    restarted from step 0, as the trainer's ``ckpt.resume=auto`` without a checkpoint rewrites it)."""
    from dettrain.record.ledger import read_ledger

    if not path.exists():
        return None
    try:
        header, steps = read_ledger(path)
    except ValueError as e:
        return (f"{path} exists and is not a ledger this loop may replace ({e}); write the ledger to another path, "
                "or move the file aside")
    if not steps or header.get("config_hash") == chash:
        return None
    return (f"{path} already holds {len(steps)} steps of another run (config_hash {header.get('config_hash')}, this "
            f"loop's {chash}) and a fresh StepLedger (resume_step=None) would replace it; continue it with "
            "resume_step=load_checkpoint(...), write to another path, or move the file aside")


def _is_dtensor(t: torch.Tensor) -> bool:
    return hasattr(t, "_local_tensor")


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's rows of a DTensor (FSDP2's shard), a plain tensor itself."""
    return t.to_local() if _is_dtensor(t) else t


def _row_start(p: torch.Tensor, rank: int, world: int) -> int:
    """Flat index of this rank's first element of a parameter FSDP2 shards by rows (torch.chunk pieces of dim 0)."""
    rows = p.shape[0] if p.dim() else 1
    chunk = -(-rows // world)
    return min(rank * chunk, rows) * (p.numel() // max(rows, 1))


def _open_mirror(settings: dict | bool, run_dir: Path, header: dict, resumed: bool):
    """Rank 0's ``WandbMirror`` of a user loop's ledger (None: disabled or wandb failed to start).  Settings not
    given come from the variables wandb users set (WANDB_MODE, WANDB_PROJECT, ...), else offline / dettrain /
    the group ``own_loop-<config hash[:8]>`` (reruns of one config side by side, as for ``python -m dettrain``)."""
    import logging
    import os
    import secrets

    from dettrain.record.wandb_io import ENV_MODES, ID_FILE, MODES, WandbMirror, default_group

    w = dict(settings) if isinstance(settings, dict) else {}
    env = os.environ
    mode = w.get("mode") or ENV_MODES.get(env.get("WANDB_MODE", ""), env.get("WANDB_MODE") or "offline")
    if mode not in MODES:
        raise UserError(f"wandb mode {mode!r} must be offline, online or disabled")
    if mode == "disabled":
        return None
    run_dir.mkdir(parents=True, exist_ok=True)
    id_file = run_dir / ID_FILE
    if resumed and id_file.is_file():  # the resumed loop continues its wandb run, as a resumed training run does
        rid, resume = id_file.read_text().strip(), "allow"
    else:
        rid, resume = secrets.token_hex(4), None  # not `random`: the seeded Python stream is the loop's
        id_file.write_text(rid + "\n")
    meta = {k: v for k, v in header.items() if k not in ("kind", "config")}
    try:
        import wandb

        run = wandb.init(mode=mode, dir=str(run_dir), id=rid, resume=resume, job_type="train",
                         project=w.get("project") or env.get("WANDB_PROJECT") or "dettrain",
                         entity=w.get("entity") or env.get("WANDB_ENTITY") or None,
                         group=w.get("group") or env.get("WANDB_RUN_GROUP") or default_group(
                             "own_loop", header.get("config_hash")),
                         name=w.get("name") or run_dir.name, config={**header["config"], "dettrain": meta},
                         settings=wandb.Settings(console="off", silent=True, init_timeout=60, finish_timeout=60))
    except Exception as e:  # noqa: BLE001 - any wandb failure must leave the loop alive
        logging.getLogger("dettrain").warning(f"wandb: could not start the mirror ({type(e).__name__}: {e}); the "
                                              f"ledger in {run_dir} has every step")
        return None
    return WandbMirror(run, timeout_s=60.0)  # wandb.init's and finish's own timeouts above


# ---- sampler and checkpoints for your own loop ---------------------------------------------------------------
def sampler(data: str | Path | np.ndarray | torch.utils.data.Dataset | None = None, *, seq_len: int | None = None,
            seed: int, global_batch: int, micro_batch: int, num_workers: int = 0, max_bytes: int = 4_000_000,
            collate=None, sync: GradSync | None = None):
    """The trainer's resumable step sampler (``dettrain.data.StepSampler``) for your loop: windows of seq_len + 1
    tokens of ``data`` (a token file written by ``dettrain prepare``, an array of token ids, or None: the embedded
    corpus of ``max_bytes`` bytes), or the items of your own map-style ``torch.utils.data.Dataset`` (``len`` and
    ``ds[i]``; ``collate``, default torch's ``default_collate``, makes a micro-batch of ``micro_batch`` items),
    in the global order of (seed, epoch) over the sample indices whatever the world size.  Each ``next`` gives
    this rank's micro-batches of the step, each with its global index (``mb.index``, for ``seed_micro_batch``)
    and its data (``mb.tokens`` (micro_batch, seq_len + 1), or your collated items, also as ``mb.batch``);
    ``state_dict()`` is what ``save_checkpoint`` stores, so a resumed loop draws exactly the samples the
    uninterrupted one would.  ``sync``: deal the micro-batches as that GradSync runs them (sharded at
    accumulate='tree': round-robin)."""
    from dettrain.data import DataConfig, SampleDataset, StepSampler, load_tokens

    user_ds = isinstance(data, torch.utils.data.Dataset) and not isinstance(data, SampleDataset)
    if not user_ds and seq_len is None:
        raise UserError("sampler: give seq_len= for token data (or pass your own torch.utils.data.Dataset)")
    if user_ds:
        dataset = ItemBatches(data, collate)
    elif data is None or isinstance(data, (str, Path)):
        tokens = load_tokens(DataConfig(path=None if data is None else str(data), max_bytes=max_bytes))
    else:
        tokens = np.asarray(data)
    if global_batch % micro_batch:
        raise UserError(f"global_batch={global_batch} is not a multiple of micro_batch={micro_batch}")
    rank, world = (torch.distributed.get_rank(), torch.distributed.get_world_size()) \
        if torch.distributed.is_initialized() else (0, 1)
    if (global_batch // micro_batch) % world:
        raise UserError(f"{global_batch // micro_batch} micro-batches per step do not divide over {world} ranks")
    if not user_ds:
        dataset = SampleDataset(tokens, seq_len)
    return StepSampler(dataset, seed, global_batch, micro_batch, rank, world, num_workers,
                       assignment=sync.assignment if sync is not None else "block")


class ItemBatches(torch.utils.data.Dataset):
    """A map-style dataset seen as the step sampler sees samples: ``n`` items, and one micro-batch per list of
    sample ids (``collate`` of the items, in the order of the ids)."""

    def __init__(self, items: torch.utils.data.Dataset, collate=None) -> None:
        try:
            self.n = len(items)
        except TypeError:
            raise UserError(f"sampler: the dataset {type(items).__name__} has no len(); a map-style Dataset "
                            "(__len__ and __getitem__) gives the global order over its indices") from None
        self.items = items
        self.collate = collate or torch.utils.data.default_collate

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, ids: list[int]):
        return self.collate([self.items[i] for i in ids])


LOOP_META = "loop.json"
"""The manifest of a user-loop checkpoint (``save_checkpoint``), written last; the trainer's are dettrain.json."""


def save_checkpoint(root: str | Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                    sampler_=None, *, keep: int = 2, extra: dict | None = None) -> Path:
    """Save the state after ``step`` completed steps into ``<root>/step_XXXXXXXX/``; a collective (every rank calls
    it).  Rank 0 writes the model and optimizer state dicts (replicas: GradSync keeps them the same bits on every
    rank) as ``state.pt``, keyed by parameter name as torch's own ``state_dict``; every rank writes its RNG
    streams (``rng/rank_XXXXX.json``); ``loop.json`` (step, world size, the sampler's state, sha256 of every file)
    is written last, and the directory is renamed from ``.tmp`` into place only then: a crash at any moment leaves
    the previous checkpoints intact.  The oldest beyond ``keep`` are removed.  Returns the checkpoint's path.

    ``extra``: more ``Stateful`` objects by name (anything with ``state_dict()``/``load_state_dict()``: an LR
    scheduler, a GradScaler, your own counters), saved from rank 0 beside the model (their state must be the same
    on every rank, as a replicated loop's is).  A sharded model (GradSync(shard=True)) is gathered into full
    tensors keyed by parameter name (torch.distributed.checkpoint.state_dict), its optimizer state too, so the
    checkpoint loads onto any world size."""
    import shutil

    from dettrain.checkpoint.state import rng_state
    from dettrain.checkpoint.storage import _fsync_dir, _sha256_file, _write_json, ckpt_name

    rank, world = (torch.distributed.get_rank(), torch.distributed.get_world_size()) \
        if torch.distributed.is_initialized() else (0, 1)
    root = Path(root)
    final = root / ckpt_name(step)
    tmp = root / (final.name + ".tmp")
    if rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)  # left by a save that crashed
        (tmp / "rng").mkdir(parents=True)
    _barrier()
    _write_json(tmp / "rng" / f"rank_{rank:05d}.json", rng_state())
    state = _full_state(model, optimizer)  # a collective when sharded
    if rank == 0:
        state["extra"] = {name: obj.state_dict() for name, obj in (extra or {}).items()}
        torch.save(state, tmp / "state.pt")
    _barrier()  # every rank's RNG file is on disk before rank 0 hashes and seals the directory
    if rank == 0:
        files = sorted(p for p in tmp.rglob("*") if p.is_file())
        _write_json(tmp / LOOP_META, {"step": int(step), "world_size": world, "optimizer": _kind(optimizer),
                                      "sampler": None if sampler_ is None else sampler_.state_dict(),
                                      "sampler_geometry": _geometry(sampler_),
                                      "sha256_files": {p.relative_to(tmp).as_posix(): _sha256_file(p)
                                                       for p in files}})
        _fsync_dir(tmp)
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        _fsync_dir(root)
        for old in _loop_checkpoints(root)[keep:]:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def _loop_checkpoints(root: Path) -> list[Path]:
    """Complete user-loop checkpoints under ``root``, newest first."""
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.is_dir() and p.name.startswith("step_")
                   and not p.name.endswith(".tmp") and (p / LOOP_META).is_file()), key=lambda p: p.name, reverse=True)


def _kind(obj) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def _geometry(sampler_) -> dict | None:
    """What a sampler's (epoch, position) means: the same position in another geometry is other samples."""
    names = {"seed": "seed", "global_batch": "G", "micro_batch": "m"}
    if sampler_ is None or not all(hasattr(sampler_, a) for a in names.values()) or not hasattr(sampler_, "ds"):
        return None  # a sampler of the user's own: its state_dict is all there is
    return {**{k: int(getattr(sampler_, a)) for k, a in names.items()},
            "seq_len": int(getattr(sampler_.ds, "seq_len", 0)), "n_samples": int(len(sampler_.ds))}


def _newest_complete(root: Path) -> tuple[Path | None, list[str]]:
    """(the checkpoint load_checkpoint takes under ``root``, or None for a fresh start; why each newer directory
    was skipped).  UserError for a root that is a file, a trainer's checkpoint, or a step directory without
    ``loop.json`` and no complete one before it."""
    from dettrain.checkpoint.storage import META_NAME

    if root.exists() and not root.is_dir():
        raise UserError(f"load_checkpoint: {root} is a file; pass the checkpoints directory save_checkpoint wrote "
                        "(or one step_XXXXXXXX directory in it)")
    if (root / LOOP_META).is_file():
        return root, []
    if (root / META_NAME).is_file():
        raise UserError(f"load_checkpoint: {root} is a trainer's checkpoint ({META_NAME}, no {LOOP_META}); it resumes "
                        "with ckpt.resume=PATH; pass the directory save_checkpoint wrote into")
    if not _loop_checkpoints(root) and _loop_checkpoints(root / "checkpoints"):
        raise UserError(f"load_checkpoint: {root} holds no checkpoint but {root / 'checkpoints'} does; pass that "
                        "directory (the root given to save_checkpoint)")
    if root.name.startswith("step_") and root.is_dir():
        raise UserError(f"load_checkpoint: {root} has no {LOOP_META}: it is damaged or was not written by "
                        "save_checkpoint; pass its parent to take the newest complete checkpoint")
    found = _loop_checkpoints(root)
    # a step directory without loop.json is never left by save_checkpoint (it renames after writing it): damage
    broken = sorted((p for p in (root.iterdir() if root.is_dir() else []) if p.is_dir() and p.name.startswith("step_")
                     and not p.name.endswith(".tmp") and not (p / LOOP_META).is_file()),
                    key=lambda p: p.name, reverse=True)
    newest = found[0] if found else None
    skipped = [f"{p} has no {LOOP_META} (damaged)" for p in broken if newest is None or p.name > newest.name]
    if newest is None and skipped:
        raise UserError(f"load_checkpoint: no complete checkpoint in {root} ({'; '.join(skipped)}); remove the "
                        "damaged directories to start afresh, or restore them")
    return newest, skipped


def _sharded(model: nn.Module) -> bool:
    return any(_is_dtensor(p) for p in model.parameters())


def _full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """{"model", "optimizer"} as rank 0 saves them: torch's own state dicts, or for a sharded model the full
    tensors by name (``get_state_dict(full_state_dict=True)``, gathered to rank 0's CPU; a collective)."""
    if not _sharded(model):
        return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {"model": msd, "optimizer": osd, "layout": "full_by_name"}


def load_checkpoint(root: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer, sampler_=None, *,
                    extra: dict | None = None) -> int | None:
    """Restore the newest complete checkpoint under ``root`` (``save_checkpoint``'s; ``root`` may also name one
    checkpoint directory) into the model, optimizer, sampler and this rank's RNG streams; returns its step (the
    next step to run), or None when there is none (a fresh start).  A newer step directory without loop.json is
    passed over with a logged warning; an optimizer of another class or a sampler of another geometry than the
    saved one, a root that is a file or a trainer's checkpoint, are UserErrors.  Every file's sha256 is checked first
    (UserError naming a damaged file); tensors load with ``torch.load(weights_only=True)``: nothing arbitrary is
    unpickled.  Parameters are copied in place, so GradSync's flat buffer keeps holding them.  ``extra``: the
    same names as ``save_checkpoint``'s, each given its saved state (UserError naming one the checkpoint lacks).
    A sharded model takes its rows of the full saved tensors, whatever the world size that saved them."""
    import json
    import logging

    from dettrain.checkpoint.state import set_rng_state
    from dettrain.checkpoint.storage import _sha256_file

    path, skipped = _newest_complete(Path(root))
    if path is None:
        return None
    for why in skipped:  # as the trainer's ckpt.resume=auto: a damaged newer checkpoint is passed over, said so
        logging.getLogger("dettrain").warning(f"load_checkpoint: {why}; resuming from {path} instead")
    try:
        meta = json.loads((path / LOOP_META).read_text())
        for rel, sha in meta["sha256_files"].items():
            if _sha256_file(path / rel) != sha:
                raise UserError(f"checkpoint {path} is damaged: {rel} does not match its sha256 in {LOOP_META}; "
                                "remove the checkpoint to resume from an earlier one")
        state = torch.load(path / "state.pt", map_location="cpu", weights_only=True)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"checkpoint {path} is unreadable ({type(e).__name__}: {e}); remove it to resume from an "
                        "earlier one") from None
    saved_opt, now_opt = meta.get("optimizer"), _kind(optimizer)
    if saved_opt is not None and saved_opt != now_opt:
        raise UserError(f"checkpoint {path} holds the state of a {saved_opt} optimizer, this loop's is {now_opt}: "
                        "its state would not mean the same; resume with the optimizer that saved it")
    saved_geo, now_geo = meta.get("sampler_geometry"), _geometry(sampler_)
    if saved_geo is not None and now_geo is not None and saved_geo != now_geo:
        what = ", ".join(f"{k} {saved_geo.get(k)} -> {now_geo.get(k)}" for k in now_geo
                         if saved_geo.get(k) != now_geo[k])
        raise UserError(f"checkpoint {path} saved a sampler of another geometry ({what}): its position would draw "
                        "other samples than the uninterrupted loop; resume with the sampler's saved settings")
    saved_extra = state.get("extra") or {}
    missing = sorted(set(extra or {}) - set(saved_extra))
    if missing:
        raise UserError(f"checkpoint {path} holds no state for extra {missing} (it has {sorted(saved_extra)}); "
                        "pass the names save_checkpoint was given")
    if state.get("layout") == "full_by_name" or _sharded(model):
        if state.get("layout") != "full_by_name" or not _sharded(model):
            raise UserError(f"checkpoint {path} was saved by a {'sharded' if state.get('layout') else 'replicated'}"
                            " loop; resume with the same GradSync(shard=...) setting")
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        # every rank read the same full tensors: each keeps its own rows (no broadcast needed)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                       options=StateDictOptions(full_state_dict=True))
    else:
        model.load_state_dict(state["model"])  # copy_ into the existing parameters (views into GradSync's buffer)
        optimizer.load_state_dict(state["optimizer"])
    for name, obj in (extra or {}).items():
        obj.load_state_dict(saved_extra[name])
    if sampler_ is not None and meta.get("sampler") is not None:
        sampler_.load_state_dict(meta["sampler"])
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    rng = path / "rng" / f"rank_{rank:05d}.json"
    if rng.is_file():  # a rank the saving world did not have keeps its seeded streams (draws are keyed anyway)
        set_rng_state(json.loads(rng.read_text()))
    return int(meta["step"])


def _barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def shutdown() -> None:
    """Destroy the process group that ``setup`` started."""
    D.shutdown()


__all__ = ["GradSync", "StepLedger", "load_checkpoint", "sampler", "save_checkpoint", "setup", "shutdown"]
