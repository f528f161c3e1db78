"""Memory plan of an N-rank FSDP2 run without N devices: ``python -m dettrain.memory +exp=NAME --nproc N [k=v ...]``.

The config is composed exactly as training composes it (schema -> conf/config.yaml -> +exp -> overrides) and
validated for N ranks.  Rank 0 of an N-rank run is then played in this one process under a fake process group
(``FakeStore`` + ``init_process_group("fake")``: nothing crosses between ranks; reduce-scatters and all_to_alls
do nothing, and an all-gather copies the input into each of its W output chunks on the device, the local writes a
real all-gather makes), in one of two modes:

- measure (CUDA; or CPU for a small model): the trainer's own steps (``Trainer._step``, loop/trainer.py) of
  the run the trainer builds (``build_run``, loop/build.py: the same resolved choices, kernel switches, model,
  compile and autocast) with dettrain's FSDP2 engine, on made-up tokens: per micro-batch the seed, the tokens'
  copy and fingerprint, forward, loss and backward; then the canonical mean of the losses, ``reduce`` (the
  canonical norm), ``clip_``, ``step`` and the fingerprints read in the step's line.  So what a user running the
  trainer gets, engine changes included, is what is measured.  Reported: the allocator's peak
  (``torch.cuda.max_memory_allocated``), ``FSDPMemTracker``'s breakdown (it counts the engine's moments as
  optimizer state through ``EngineOptimizer``, an ``Optimizer`` view of them), and the measured compute-only step
  time, tokens/s and MFU (communication excluded: the fake group sends nothing; its all-gathers' local copies
  are counted);
- estimate (CPU, the default there): stock FSDP2 (``fully_shard`` by ``dettrain.sync.fsdp.shard_model``, as the
  engine shards) and torch AdamW under ``FakeTensorMode`` with ``FSDPMemTracker``: no memory is allocated, every
  size is exact, plus the engine's extras below, added analytically.  The engine does not run here: the
  estimate is kept as stock FSDP2 plus the extras on purpose, the reference the measured engine is checked
  against (tests/test_memory.py).  It shards one block a unit; on one rank the engine may shard several blocks as
  one unit (engines/fsdp2.py ``UNITS_ENV``; blocks under 32 Mi parameters only, within 256 Mi a unit), whose unreduced
  gradient at the end of the unit's backward (up to 1.5 GiB) the estimate leaves out; measure mode runs the
  engine's own units.

``--stock`` (measure mode) measures the baseline instead of the engine: the same stock FSDP2 step as the estimate
(torch's attention, ``clip_grad_norm_``, torch's fused AdamW on CUDA, tier-0 settings), with real tensors and the
blocks compiled as the trainer compiles them (``measure_stock``).  ``--compare-stock R`` runs R interleaved rounds
of both, one process each, and prints the engine's tokens/s over stock's (``compare_stock``); ``--json FILE``
appends one summary line per run.

Every step the planner runs (modes and variants alike) has two micro-batches per rank (one when a rank has a single
micro-batch per step; ``--rounds``: more): from the second on, FSDP2's accumulated sharded gradient is alive during
forward.  A first step runs untracked before the tracked one (the tracker slows every op; the moments exist by then
in both modes).  What a step of two micro-batches does not hold but a full step of dettrain's
engine does is added explicitly, as persistent shard-sized fp32 buffers and one communication buffer:

- tier 3: nothing (the engine accumulates in FSDP2's own sharded gradient, as stock FSDP2 does);
- tier 4: the binary counter over the M / W rounds of round-robin micro-batches (M micro-batches per step, W
  ranks): at the last round log2(M / W) partials of one fp32 shard each are alive at once (one fewer on one rank,
  which reduces pairs of micro-batches).  A measured step of two micro-batches holds one of them itself (several
  ranks), so only the rest is added; ``--rounds all`` measures a step of all M / W and adds nothing.  With
  ``dist.offload_partials`` the partials are listed as pinned host memory instead, outside the device peak, and the
  device gets the copies staged back (at most 256 MiB), unless the measured step ran every round;
- tiers 3-4, estimate only: the canonical reduce-scatter's ``all_to_all`` receive buffer, one parameter group's
  unsharded gradient (the largest ``fully_shard`` group; groups are reduce-scattered one after another), in bf16
  with bf16 compute (the engine's rows travel in bf16; its reduce-scatter input is then bf16 too, where the stock
  estimate counts fp32: the estimate stays an upper bound), else fp32.  A
  measured run reduce-scatters through the engine's own ``CanonicalReduceScatter`` (its ``all_to_all`` moves no
  bytes under the fake group, its tree over the W rows runs), so that buffer and the sums' time are in the
  measurement.

These are added to the tracked (or measured) peak, an upper bound: it overstates the peak by the communication buffer
when the persistent buffers are not all alive at the peak's moment.  The output ends with ``peak per rank: X GiB``.
``--profile FILE`` (measure mode) profiles one more step after the timed ones: its op table to FILE, a Chrome trace
to FILE.trace.json.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import math
import os
import sys
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from dettrain.errors import EXIT_USAGE, UserError
from dettrain.tiers import policy

__all__ = ["GIB", "EngineOptimizer", "Plan", "Report", "add_engine_extras", "append_json",
           "build_sharded", "compare_stock", "compose_config", "drive", "estimate_cpu", "fake_group",
           "finish_report", "group_elements", "main", "make_optimizer", "measure", "measure_stock", "on_off",
           "one_step", "plan_memory", "render", "resolve_plan", "row", "shard_elements", "summary", "tracked_steps",
           "tracker_breakdown", "trainer_config", "trainer_tokens"]

GIB = 1024**3


# ---- the config, as training composes it -------------------------------------------------------------------------
def compose_config(overrides: list[str], world: int):
    """The validated ``Config`` of ``overrides`` for ``world`` ranks; a bad override raises UserError."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from dettrain.config import conf_dir, register, to_config, validate

    register()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3", job_name="dettrain"):
            dcfg = compose(config_name="config", overrides=list(overrides))
        cfg = to_config(dcfg)
    except (HydraException, OmegaConfBaseException) as e:
        msg = " ".join(str(e).split())
        raise UserError(f"bad config override ({' '.join(overrides) or 'none'}): {msg}") from None
    finally:
        GlobalHydra.instance().clear()
    try:
        validate(cfg, world)
    except UserError:
        raise
    except ValueError as e:
        raise UserError(str(e)) from None
    return cfg


# ---- what is planned ----------------------------------------------------------------------------------------------
@dataclass
class Plan:
    """The run being planned, resolved from the config."""

    exp_name: str
    model_name: str
    world: int
    tier: int
    engine: str  # dist.engine as resolved at this tier (engines.resolve_engine)
    micro_batch: int
    seq_len: int
    micro_per_step: int  # M: micro-batches per optimizer step over all ranks
    mixed_precision: bool  # bf16 compute with fp32 master weights and reduce
    activation_checkpointing: bool
    reshard_after_forward: bool
    compile: bool
    offload_partials: bool = False  # tier 4, dist.offload_partials: the counter's partials in pinned host memory
    run_rounds: int | None = None  # --rounds: micro-batches per rank the measured step runs (None: the default)

    @property
    def rounds(self) -> int:
        """Micro-batches per rank and step (M / W): the rounds of round-robin assignment at tier 4."""
        return self.micro_per_step // self.world

    @property
    def micro_per_rank_run(self) -> int:
        """Micro-batches per step the planner runs: ``--rounds`` when given, else two when the rank accumulates
        (the second forward runs with the first one's sharded gradients alive, as every later one does), else
        one."""
        return self.run_rounds if self.run_rounds is not None else min(2, self.rounds)

    @property
    def partials(self) -> int:
        """Shard-sized partial sums the tier-4 binary counter holds at once (log2 of the rounds; 0 below tier 4).
        On one rank the engine reduces pairs of micro-batches, so the counter starts a level up: one fewer."""
        if not (policy(self.tier).world_invariant and self.rounds > 1):
            return 0
        return int(math.log2(self.rounds)) - (1 if self.world == 1 else 0)

    @property
    def partials_run(self) -> int:
        """Of those, the ones alive at once in the step the planner runs (``micro_per_rank_run`` micro-batches, the
        same counter): one on several ranks (the first micro-batch's, during the second), none on one rank (one
        pair, reduced at once)."""
        if not self.partials:
            return 0
        return max(0, int(math.log2(self.micro_per_rank_run)) - (1 if self.world == 1 else 0))

    @property
    def partials_on_device(self) -> int:
        """Of ``partials``, those the device holds: none with dist.offload_partials (pinned host memory)."""
        return 0 if self.offload_partials else self.partials

    @property
    def accumulators(self) -> int:
        """Extra persistent fp32 shards of dettrain's FSDP2 engine on top of FSDP2's own sharded gradient: tier 4's
        binary-counter partials (tier 3 accumulates into FSDP2's own sharded gradient, as stock FSDP2 does)."""
        return self.partials_on_device if policy(self.tier).world_invariant else 0


def resolve_plan(cfg, world: int, device: torch.device) -> Plan:
    from dettrain.dist import resolve_reshard
    from dettrain.loop.resolve import resolve
    from dettrain.sync.engines import resolve_engine

    t = cfg.train
    resolved = resolve(cfg, device, world)  # precision and compile as the trainer decides them (loop/resolve.py)
    return Plan(
        exp_name=cfg.exp_name, model_name=cfg.model.name, world=world, tier=cfg.det.tier,
        engine=resolve_engine(cfg.dist.engine, cfg.det.tier), micro_batch=t.micro_batch, seq_len=cfg.model.seq_len,
        micro_per_step=t.global_batch // t.micro_batch, mixed_precision=resolved.mixed_precision,
        activation_checkpointing=bool(cfg.model.activation_checkpointing),
        reshard_after_forward=resolve_reshard(cfg.dist.reshard_after_forward, world),
        compile=resolved.compile and device.type == "cuda",  # on CPU the planner never compiles
        offload_partials=bool(cfg.dist.offload_partials) and policy(cfg.det.tier).world_invariant,
    )


@dataclass
class Report:
    """Bytes per rank: the peak's breakdown, the extras of dettrain's engine, optional measured speed."""

    method: str
    params: int
    n_shard: int  # elements of one rank's padded shard of all parameters (FSDP2 pads dim 0 to a multiple of W)
    largest_group: int  # elements of the largest fully_shard parameter group (unsharded)
    breakdown: dict[str, int] = field(default_factory=dict)  # the tracked peak, by category
    overhead: int = 0  # allocator peak minus the tracker's peak (CUDA), else 0
    overhead_label: str = ""
    extras: dict[str, int] = field(default_factory=dict)
    step_s: float | None = None
    device: str = "cpu"
    # a measured run at tiers 3-4 reduce-scatters through the engine's CanonicalReduceScatter: its receive buffer
    # and its sums are in the measurement
    canonical_rs_measured: bool = False
    # tier-4 counter partials a measured run held itself (its step runs fewer micro-batches than a real one)
    partials_measured: int = 0
    host: dict[str, int] = field(default_factory=dict)  # pinned host memory per rank (dist.offload_partials)
    # "engine": dettrain's FSDP2 engine at the config's tier; "stock": the stock FSDP2 baseline (measure_stock)
    variant: str = "engine"

    @property
    def peak(self) -> int:
        return sum(self.breakdown.values()) + self.overhead + sum(self.extras.values())


def shard_elements(model: torch.nn.Module, world: int) -> int:
    """Elements of rank 0's padded shard: FSDP2 splits each parameter along dim 0 into W equal padded chunks."""
    n = 0
    for p in model.parameters():
        shape = tuple(p.shape)  # a DTensor reports its global shape
        rest = math.prod(shape[1:]) if len(shape) > 1 else 1
        n += -(-shape[0] // world) * rest if shape else 1
    return n


def group_elements(units: list) -> int:
    """Largest number of (unsharded) parameter elements managed by one fully_shard call."""
    seen: set[int] = set()
    sizes = []
    for unit in units:  # blocks first, root last: the root owns what no block owns
        own = [p for p in unit.parameters() if id(p) not in seen]
        seen.update(id(p) for p in own)
        sizes.append(sum(p.numel() for p in own))
    return max(sizes) if sizes else 0


def tracker_breakdown(snapshot: dict) -> dict[str, int]:
    """FSDPMemTracker's peak snapshot (keyed by its reference types) folded into the five reported categories."""
    cats = {"parameters": ("Sharded Param", "Unsharded Param"),
            "gradients": ("Sharded Grad", "Unsharded Grad"),
            "optimizer state": ("OptState",),
            "activations": ("Activation", "Temp", "Inputs"),
            "communication/other buffers": ("All Gather", "Reduce Scatter", "Buffer")}
    by_name = {getattr(k, "value", k): v for k, v in snapshot.items()}
    out = {cat: sum(by_name.get(n, 0) for n in names) for cat, names in cats.items()}
    known = sum(out.values())
    if by_name.get("Total", known) != known:  # a reference type this version adds: keep the sum exact
        out["communication/other buffers"] += by_name["Total"] - known
    return out


def add_engine_extras(report: Report, plan: Plan) -> None:
    """Add what dettrain's FSDP2 engine allocates beyond stock FSDP2 at ``plan.tier`` (module docstring)."""
    shard = 4 * report.n_shard  # fp32
    pol = policy(plan.tier)
    how = (f"log2(M/W)=log2({plan.micro_per_step}/{plan.world})" if plan.world > 1 else
           f"log2(M/2)=log2({plan.micro_per_step}/2): pairs on one rank")
    if pol.world_invariant and plan.offload_partials:
        # every counter entry waits in host memory (sync/offload.py, HostLevels); the device stages a few back
        if plan.partials:
            report.host[f"tier-4 partials ({plan.partials} x fp32 shard, {how}), pinned"] = plan.partials * shard
            # a measured run of every round has its staged copies in its peak; else count the most they take
            if not report.step_s or plan.micro_per_rank_run < plan.rounds:
                from dettrain.sync.offload import HostLevels

                report.extras["tier-4 partials staged back on the device (at most)"] = min(
                    HostLevels.STAGE_BYTES, plan.partials * shard)
    elif pol.world_invariant:
        more = plan.partials - report.partials_measured
        if report.partials_measured:  # the measured step held some itself: only the rest comes on top
            report.extras[f"tier-4 partials ({more} more x fp32 shard: {plan.partials} at once, {how}; "
                          f"{report.partials_measured} measured)"] = more * shard
        else:
            report.extras[f"tier-4 partials ({plan.partials} x fp32 shard, {how})"] = plan.partials * shard
    # one rank: FSDP2 copies, no all_to_all; measured runs use the canonical reduce-scatter itself
    if pol.canonical_sum and plan.world > 1 and not report.canonical_rs_measured:
        from dettrain.sync.engines.fsdp2 import bf16_rows

        # bf16 compute: the engine's rows travel in the gradients' bf16 (engines/fsdp2.py), half of fp32's bytes
        rows = "bf16" if bf16_rows(plan.mixed_precision, plan.world) else "fp32"
        report.extras[f"all_to_all receive buffer (largest group's {rows} gradient)"] = \
            (2 if rows == "bf16" else 4) * report.largest_group


# ---- playing rank 0 -----------------------------------------------------------------------------------------------
@contextlib.contextmanager
def fake_group(world: int, device_type: str):
    """Rank 0 of a ``world``-rank fake process group (nothing crosses ranks; all-gathers copy locally) and its 1-D
    device mesh."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    if dist.is_initialized():
        raise RuntimeError("dettrain.memory needs a process without a process group (it creates a fake one)")
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    try:
        yield init_device_mesh(device_type, (world,))  # outside FakeTensorMode: the mesh needs real tensors
    finally:
        dist.destroy_process_group()


def build_sharded(cfg, plan: Plan, mesh, device: torch.device):
    """Meta build -> compile (optional) -> shard_model -> to_empty; returns (model, units, number of parameters)."""
    from dettrain.loop.compile import compile_module
    from dettrain.models.llama import build_model, num_params
    from dettrain.sync.fsdp import shard_model, transformer_blocks

    model = build_model(cfg.model, cfg.seed, "meta")
    n_params = num_params(model)
    if plan.compile:  # per block, before sharding, as the trainer does (dettrain.loop.compile)
        for block in transformer_blocks(model):
            compile_module(block)
    units = shard_model(model, mesh, mixed_precision=plan.mixed_precision,
                        reshard_after_forward=plan.reshard_after_forward)
    model.to_empty(device=device)
    model.train()
    return model, units, n_params


def make_optimizer(model: torch.nn.Module, cfg, device: torch.device) -> torch.optim.Optimizer:
    # foreach=False on CPU: with foreach the tracker reports bogus optimizer memory under fake tensors; fused on
    # CUDA, as in the stock-FSDP2 anchor run (docs/llm_7b.md)
    kw = {"fused": True} if device.type == "cuda" else {"foreach": False}
    o = cfg.optim
    return torch.optim.AdamW(model.parameters(), lr=cfg.train.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                             weight_decay=o.weight_decay, **kw)


def one_step(model, opt, tokens: torch.Tensor, micro: int, after_micro=None, *, scale: float = 1.0,
             max_norm: float = 0.0) -> None:
    """``micro`` micro-batch forward/backward passes and the optimizer step of stock FSDP2, as a user writes them:
    from the second micro-batch on, FSDP2's sharded gradients (accumulated by ``+=``) are alive during forward.
    ``scale`` multiplies each loss (1/M: the step's mean), ``max_norm`` > 0 clips with torch's
    ``clip_grad_norm_`` (both the measured stock baseline and the estimate ask for them)."""
    from dettrain.kernels import batch_invariant as bi

    x, y = tokens[:, :-1], tokens[:, 1:]
    for _ in range(micro):
        logits = model(x)
        loss = bi.cross_entropy(logits, y)  # fp32 loss over the (bf16) logits, like loop/trainer.py
        (loss * scale if scale != 1.0 else loss).backward()
        del logits, loss
        if after_micro is not None:
            after_micro()
    if max_norm > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    opt.step()
    opt.zero_grad(set_to_none=True)


def tracked_steps(model, opt, tokens: torch.Tensor, micro: int, **step_kw) -> dict:
    """One step to create the AdamW moments, then one under FSDPMemTracker, each of ``micro`` micro-batches; its
    peak snapshot for this device.  The first step's peak is below the second's (no moments yet), so it runs
    untracked (the tracker slows every op); the tracker picks up the moments as optimizer state on entry."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    one_step(model, opt, tokens, micro, **step_kw)
    tracker = FSDPMemTracker(model, opt)
    tracker.track_inputs((tokens,))
    with tracker:
        # per-module stats cover one forward only (the tracker refuses a second one); the global peak is kept
        one_step(model, opt, tokens, micro, after_micro=tracker.reset_mod_stats, **step_kw)
    peaks = tracker.get_tracker_snapshot("peak")
    return peaks.get(tokens.device, next(iter(peaks.values()), {}))


def estimate_cpu(cfg, plan: Plan) -> Report:
    """FakeTensorMode + FSDPMemTracker on CPU: no memory is allocated, every size is exact."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    device = torch.device("cpu")
    with fake_group(plan.world, device.type) as mesh, FakeTensorMode():
        model, units, n_params = build_sharded(cfg, plan, mesh, device)
        opt = make_optimizer(model, cfg, device)
        tokens = torch.randint(0, cfg.model.vocab_size, (plan.micro_batch, plan.seq_len + 1), device=device)
        # the measured stock baseline's step (measure_stock), under fake tensors
        snap = tracked_steps(model, opt, tokens, plan.micro_per_rank_run, scale=1.0 / plan.micro_per_step,
                             max_norm=cfg.optim.clip_grad_norm)
        return Report("CPU estimate (FakeTensorMode + FSDPMemTracker, nothing allocated)", n_params,
                      shard_elements(model, plan.world), group_elements(units), tracker_breakdown(snap))


def write_profile(path: str, fn, cuda: bool) -> None:
    """Run ``fn`` (one more step) under torch.profiler; write its op table, slowest first, to ``path``, and a
    Chrome trace next to it (``path`` + ``.trace.json``)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=40, max_name_column_width=80)
    with open(path, "w") as f:
        f.write(f"one measured step under torch.profiler, ops by {key}\n{table}\n")
    prof.export_chrome_trace(path + ".trace.json")


class EngineOptimizer(torch.optim.Optimizer):
    """The engine's update seen as a torch ``Optimizer``, which is what FSDPMemTracker follows: ``state`` holds the
    engine's optimizer tensors (``Engine.state_dict()``'s ``optim/<name>/<moment>``, by parameter), ``step()`` is
    ``Engine.step(lr)``.  Through ``step()`` the tracker's hooks run, so it counts the moments as optimizer state
    and what the update allocates as such."""

    def __init__(self, engine, lr: float) -> None:
        sd = engine.state_dict()
        params = {k[len("model/"):]: t for k, t in sd.items() if k.startswith("model/")}
        super().__init__(list(params.values()), {"lr": lr})
        self.engine = engine
        for key, t in sd.items():
            if key.startswith("optim/"):
                name, moment = key[len("optim/"):].rsplit("/", 1)
                self.state[params[name]][moment] = t

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ARG002 - Optimizer's signature
        self.engine.step(self.param_groups[0]["lr"])


@contextlib.contextmanager
def process_settings():
    """Put back, on the way out, every process-wide setting a measured run changes: what ``apply_tier`` sets (the
    thread count, deterministic algorithms, fp32 matmul precision, cuDNN's flags, Inductor's determinism flags),
    dettrain's batch-invariant kernels and compiled loss, and the attention route.  A caller (a test, a notebook)
    runs on with its own settings, whatever tier the run played."""
    import torch._inductor.config as inductor

    from dettrain.determinism import inductor_flags
    from dettrain.kernels import batch_invariant as bi
    from dettrain.models import attention as attention_route

    cudnn = torch.backends.cudnn
    saved = (torch.get_num_threads(), torch.are_deterministic_algorithms_enabled(),
             torch.get_float32_matmul_precision(), cudnn.allow_tf32, cudnn.benchmark, cudnn.deterministic,
             inductor_flags())
    try:
        yield
    finally:
        bi.set_enabled(False)
        bi.set_loss_fn(None)  # compile_model may have compiled the loss: later runs in this process start eager
        attention_route.uninstall()
        threads, deterministic, precision, cudnn.allow_tf32, cudnn.benchmark, cudnn.deterministic, flags = saved
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)
        torch.set_float32_matmul_precision(precision)
        for name, value in flags.items():
            setattr(inductor, name, value)


def trainer_config(cfg, plan: Plan):
    """The config the measured trainer runs: ``cfg`` with ``plan.micro_per_rank_run`` micro-batches per rank and
    step (the global batch W x that x micro_batch), made-up data (``trainer_tokens``) instead of data.path, and
    no evaluation or live check (the planner measures training steps)."""
    import dataclasses

    t = cfg.train
    train = dataclasses.replace(t, global_batch=plan.world * plan.micro_per_rank_run * t.micro_batch)
    data = dataclasses.replace(cfg.data, path=None, val_path=None, val_fraction=0.0)
    return dataclasses.replace(cfg, train=train, data=data, eval=dataclasses.replace(cfg.eval, every=0),
                               det=dataclasses.replace(cfg.det, reference=None))


def trainer_tokens(cfg, steps: int) -> np.ndarray:
    """Random token ids (uint32, seeded by ``cfg.seed``) for ``steps`` steps of ``cfg``'s global batch, so no sample
    is drawn twice within them (the sampler's epochs then never matter)."""
    n = steps * cfg.train.global_batch * cfg.model.seq_len + 1
    return np.random.default_rng(cfg.seed).integers(0, cfg.model.vocab_size, n, dtype=np.uint32)


def measure(cfg, plan: Plan, device: torch.device, timed_steps: int, profile: str | None = None) -> Report:
    """Real steps of rank 0 under the fake group, each the trainer's own (``Trainer._step`` and its line, as
    ``Trainer.fit`` runs them, train.overlap_steps included; loop/trainer.py: the micro-batches' seeds, token
    copies and batch fingerprints, forward, loss and backward, the canonical mean of the losses, reduce and norm,
    clip, update, and the fingerprints read in the step's line) of the run ``build_run`` builds with dettrain's
    FSDP2 engine: tracker breakdown, allocator peak (CUDA), step time; with ``profile``, one more step under
    torch.profiler after the timed ones (``write_profile``).  The trainer reads made-up tokens
    (``trainer_config``) and runs ``plan.micro_per_rank_run`` micro-batches a step.

    Runs on CPU too (real tensors, no allocator statistics: the tracker's peak stands for it), which is how the test
    suite exercises this path without a GPU."""
    import tempfile
    from pathlib import Path

    from dettrain import dist as D
    from dettrain.determinism import apply_tier
    from dettrain.loop.build import build_run
    from dettrain.loop.trainer import Trainer, _run
    from dettrain.sync.engines import FSDP2Engine

    mcfg = trainer_config(cfg, plan)
    with process_settings(), fake_group(plan.world, device.type), tempfile.TemporaryDirectory() as tmp:
        apply_tier(mcfg.det)  # the tier's kernels and settings, as the trainer applies them (they change the time)
        info = D.DistInfo(rank=0, world=plan.world, local_rank=0, device=device, backend="fake")
        # the trainer's assembly (loop/build.py): the choices resolved as training resolves them, the kernel
        # switches, the model built and compiled, then sharded by the FSDP2 engine (the engine this tool plans,
        # whatever dist.engine resolves to); on a CPU the planner never compiles
        built = build_run(mcfg, info, engine=FSDP2Engine.name, compile=plan.compile)
        steps = 4 + timed_steps + (1 if profile else 0)  # drive's first, tracked or second, warm-up, timed, profiled
        trainer = Trainer(mcfg, info, Path(tmp), built=built, tokens=trainer_tokens(mcfg, steps))
        model, n_params = built.model, built.n_params
        from torch.distributed.fsdp import FSDPModule

        units = [m for m in model.modules() if isinstance(m, FSDPModule)]  # the fully_shard units, root first
        units = units[1:] + units[:1]  # blocks first, root last, as group_elements reads them
        opt = EngineOptimizer(built.engine, cfg.train.lr)  # the tracker's view of the moments (not stepped)
        model.train()
        batches = iter(trainer.sampler)

        ahead: list = []  # the next step, its first micro-batch queued before the last line was read
        # as Trainer.fit runs steps: with train.overlap_steps on (true, or auto on CUDA) the next step's first
        # micro-batch is queued before a step's line (its one host sync) is read; compiled only (the eager plan's
        # tracked step passes after_micro, which must see each of its own micro-batches)
        overlap = trainer.overlap and plan.compile

        def step(after_micro=None) -> None:
            gen = ahead.pop() if ahead else trainer._step(trainer.step, next(batches), after_micro)
            queued = _run(gen)
            if overlap:
                nxt = trainer._step(trainer.step + 1, next(batches))
                next(nxt)
                ahead.append(nxt)
            queued.line()
            trainer.step += 1

        snap, step_s, allocated = drive(step, model, opt, None, plan, device, timed_steps, profile)
        for gen in ahead:  # the step queued after the last measured one: dropped
            gen.close()
        n_shard, largest = shard_elements(model, plan.world), group_elements(units)
        trainer.close()
        del model, opt, step, built
    return finish_report("measured: real steps of rank 0 of the trainer with dettrain's FSDP2 engine under a fake "
                         "process group", device, snap, allocated, n_params, n_shard, largest, step_s,
                         canonical_rs_measured=policy(plan.tier).canonical_sum,
                         partials_measured=0 if plan.offload_partials else plan.partials_run)


def drive(step, model, opt, tokens: torch.Tensor | None, plan: Plan, device: torch.device, timed_steps: int,
          profile: str | None) -> tuple[dict, float, int | None]:
    """The measured sequence of both variants, ``step(after_micro=None)`` being one optimizer step of
    ``plan.micro_per_rank_run`` micro-batches: the first steps (eager: one step, then one under FSDPMemTracker;
    compiled: two, as the tracker does not follow compiled code), one more warm-up, ``timed_steps`` timed steps,
    then the optional profiled one.  ``tokens``: the input the tracker counts as such (None: the trainer's
    micro-batches, made per step).  Returns the tracker's peak snapshot (empty when compiled), the mean step time
    in seconds and the allocator's peak (CUDA; else None)."""
    cuda = device.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    if plan.compile:  # the tracker does not follow compiled code: the allocator's peak only
        for _ in range(2):
            step()
        snap = {}
    else:
        # one step first (the tracker slows every op; the moments exist from the start, so the tracked step is no
        # different), then one under FSDPMemTracker
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

        step()
        tracker = FSDPMemTracker(model, opt)
        if tokens is not None:
            tracker.track_inputs((tokens,))
        with tracker:
            # per-module stats cover one forward only (the tracker refuses a second one); the peak is kept
            step(after_micro=tracker.reset_mod_stats)
        peaks = tracker.get_tracker_snapshot("peak")
        snap = peaks.get(device, next(iter(peaks.values()), {}))
    step()  # one more warm-up, outside the tracker
    sync()
    t0 = time.perf_counter()
    for _ in range(timed_steps):
        step()
    sync()
    step_s = (time.perf_counter() - t0) / timed_steps
    allocated = torch.cuda.max_memory_allocated(device) if cuda else None
    if profile:
        write_profile(profile, step, cuda)
    return snap, step_s, allocated


def finish_report(what: str, device: torch.device, snap: dict, allocated: int | None, n_params: int, n_shard: int,
                  largest: int, step_s: float, **kw) -> Report:
    """The Report of a measured run: the tracker's breakdown (eager) or the parameter and moment shards (compiled),
    and the allocator's peak beyond them (CUDA)."""
    if snap:
        breakdown, rest = tracker_breakdown(snap), "allocator peak beyond the tracked tensors (temporaries, cache)"
    else:  # compiled: what the layout fixes, and the rest as measured
        breakdown = {"parameters (fp32 shards)": 4 * n_shard, "optimizer state": 8 * n_shard}
        rest = "activations, gradients and buffers (allocator peak minus the above)"
    where = "CUDA, allocator peak" if device.type == "cuda" else "CPU, tracker peak (no allocator statistics on CPU)"
    report = Report(f"{what} ({where})", n_params, n_shard, largest, breakdown, step_s=step_s, device=device.type,
                    **kw)
    if allocated is not None:
        report.overhead, report.overhead_label = allocated - sum(breakdown.values()), rest
    return report


def measure_stock(cfg, plan: Plan, device: torch.device, timed_steps: int, profile: str | None = None) -> Report:
    """The baseline dettrain's deterministic tiers are measured against: the fastest setup a user could pick
    instead of dettrain's engine, played as rank 0 under the same fake group on the same model.  Stock FSDP2
    (``fully_shard`` per block and at the root by ``shard_model``, bf16 compute with fp32 master weights and
    reduce as the plan says), the blocks compiled as the trainer compiles them, torch's attention (cuDNN's SDPA on
    an H100/H200), torch's ``clip_grad_norm_`` and fused AdamW (``make_optimizer``), tier 0's settings whatever
    ``det.tier`` says (no deterministic algorithms, timed kernel choice allowed); FSDP2 sums the gradients itself.
    The same ``drive`` sequence as ``measure``; no engine extras are added (``plan_memory``)."""
    import dataclasses

    from dettrain.determinism import apply_tier
    from dettrain.kernels import batch_invariant as bi
    from dettrain.loop.compile import compile_model
    from dettrain.models import attention as attention_route
    from dettrain.models.llama import build_model, num_params
    from dettrain.sync.fsdp import shard_model

    det0 = dataclasses.replace(cfg.det, tier=0, attention="torch", batch_invariant=False)
    cfg0 = dataclasses.replace(cfg, det=det0)
    with process_settings(), fake_group(plan.world, device.type) as mesh:
        apply_tier(det0)
        bi.set_enabled(False)
        attention_route.uninstall()  # torch's SDPA
        model = build_model(cfg.model, cfg.seed, device)
        n_params = num_params(model)
        # FSDP2 casts to bf16 itself (its MixedPrecisionPolicy): the blocks are probed without autocast
        compile_model(model, cfg0, device, enabled=plan.compile, autocast=contextlib.nullcontext())
        units = shard_model(model, mesh, mixed_precision=plan.mixed_precision,
                            reshard_after_forward=plan.reshard_after_forward)
        opt = make_optimizer(model, cfg, device)
        g = torch.Generator(device=device).manual_seed(cfg.seed)
        tokens = torch.randint(0, cfg.model.vocab_size, (plan.micro_batch, plan.seq_len + 1), device=device,
                               generator=g)
        step = functools.partial(one_step, model, opt, tokens, plan.micro_per_rank_run, scale=1.0 / plan.micro_per_step,
                                 max_norm=cfg.optim.clip_grad_norm)
        snap, step_s, allocated = drive(step, model, opt, tokens, plan, device, timed_steps, profile)
        n_shard, largest = shard_elements(model, plan.world), group_elements(units)
        del model, opt, tokens, step
    return finish_report("measured: real steps of rank 0 of stock FSDP2 (torch fused AdamW, clip_grad_norm_, "
                         "torch's attention, tier-0 settings) under a fake process group", device, snap, allocated,
                         n_params, n_shard, largest, step_s, variant="stock")


# ---- output -------------------------------------------------------------------------------------------------------
def row(name: str, nbytes: int | float) -> str:
    return f"  {name:<70}{nbytes / GIB:>8.2f}{nbytes / 2**20:>11.1f}"


def on_off(flag: bool) -> str:
    return "on" if flag else "off"


def render(plan: Plan, report: Report, argv_overrides: list[str]) -> str:
    from dettrain.tiers import TIERS

    mp = "bf16 compute, fp32 master weights and reduce" if plan.mixed_precision else "fp32 compute and reduce"
    from dettrain.sync.engines import FSDP2Engine  # the engine this tool plans, whatever dist.engine resolves to

    planned = FSDP2Engine.name
    engine = plan.engine if plan.engine == planned else f"{planned} (dist.engine is {plan.engine} here)"
    if report.variant == "stock":
        what_runs = (f"none: stock FSDP2, the baseline (tier-0 settings; the config's det.tier={plan.tier} is not "
                     f"applied); {mp}")
    else:
        what_runs = f"{engine}; tier {plan.tier} ({TIERS.get(plan.tier, '?')}); {mp}"
    lines = [
        f"dettrain.memory: {plan.exp_name} ({' '.join(argv_overrides) or 'no overrides'}), {plan.world} ranks",
        f"method: {report.method}",
        f"model: {plan.model_name}, {report.params:,} parameters; rank shard {report.n_shard:,} elements",
        f"engine: {what_runs}",
        f"micro-batch {plan.micro_batch} x {plan.seq_len} tokens; {plan.micro_per_step} micro-batches per step, "
        f"{plan.rounds} per rank ({plan.micro_per_rank_run} run per step here)",
        f"activation checkpointing {on_off(plan.activation_checkpointing)}; "
        f"reshard after forward {on_off(plan.reshard_after_forward)}"
        + ("; compiled blocks" if plan.compile else ""),
        "",
        f"{'per-rank peak breakdown':<72}{'GiB':>8}{'MiB':>11}",
    ]
    lines += [row(name, b) for name, b in report.breakdown.items()]
    if report.overhead_label:
        lines.append(row(report.overhead_label, report.overhead))
    what = "FSDP2 + the canonical reduce-scatter" if report.canonical_rs_measured else "stock FSDP2"
    lines.append(row(f"= FSDP2 step peak ({what}, this micro-batch)", sum(report.breakdown.values())
                     + report.overhead))
    lines += [row(f"+ {name}", b) for name, b in report.extras.items()]
    if report.host:
        head = "pinned host memory per rank (dist.offload_partials; not in the peak)"
        lines += ["", f"{head:<72}{'GiB':>8}{'MiB':>11}"]
        lines += [row(name, b) for name, b in report.host.items()]
    if report.step_s is not None:
        m = summary(plan, report, argv_overrides)
        what = ("the trainer's step: " if report.variant == "engine" else "stock FSDP2: ")
        lines += ["", f"measured step of rank 0 ({what}{plan.micro_per_rank_run} micro-batch forward/backward + AdamW; "
                      f"communication excluded: the fake group sends nothing): {m['step_ms']:.1f} ms, "
                      f"{m['tokens_per_s']:,.0f} tokens/s per {'GPU' if report.device == 'cuda' else 'process'}"]
        if m["mfu"] is not None:
            lines[-1] += (f", MFU {100 * m['mfu']:.1f} % (6 N tokens / time / {m['peak_tflops']:.0f} TFLOP/s, "
                          f"the dense bf16 peak of the {m['gpu']})")
    lines += ["", f"peak per rank: {report.peak / GIB:.2f} GiB"]
    return "\n".join(lines)


def plan_memory(overrides: list[str], nproc: int, device: str = "auto", mode: str = "auto",
                timed_steps: int = 5, profile: str | None = None, stock: bool = False,
                rounds: str | None = None) -> tuple[Plan, Report]:
    """Compose, resolve and play rank 0; the library entry point behind ``main``.  ``stock``: measure the stock
    FSDP2 baseline (``measure_stock``) instead of dettrain's engine.  ``rounds``: micro-batches per rank the
    measured step runs (``--rounds``: a number, or ``all`` for the plan's M / W)."""
    if nproc < 1:
        raise UserError(f"--nproc={nproc}: the number of ranks must be at least 1")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device=cuda needs a visible GPU; use --device=cpu (estimate) or --device=auto")
    if mode == "estimate" and device == "cuda":
        raise UserError("--mode=estimate runs on CPU (FakeTensorMode); use --device=cpu, or --mode=measure on CUDA")
    cfg = compose_config(overrides, nproc)
    from dettrain.determinism import set_env_before_cuda

    set_env_before_cuda(cfg.det.tier)  # CUBLAS_WORKSPACE_CONFIG before the first CUDA call
    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    plan = resolve_plan(cfg, nproc, dev)
    from dettrain.sync.engines import FSDP2Engine

    if plan.engine != FSDP2Engine.name and not stock:
        print(f"dettrain.memory: note: dist.engine resolves to {plan.engine} here; this is the plan of the FSDP2 "
              f"engine (add dist.engine={FSDP2Engine.name} to train with it)", file=sys.stderr)
    if mode == "auto":
        mode = "measure" if device == "cuda" else "estimate"
    if rounds is not None and mode != "measure":
        raise UserError(f"--rounds={rounds} sets the measured step's micro-batches; the estimate plays two and adds "
                        "the rest: drop --rounds, or add --mode=measure (CUDA, or CPU for a small model)")
    if stock and mode != "measure":
        raise UserError("--stock measures stock FSDP2's steps; add --mode=measure (CUDA, or CPU for a small model). "
                        "The CPU estimate is stock FSDP2 already: its '= FSDP2 step peak' line")
    if profile and mode != "measure":
        raise UserError(f"--profile={profile}: profiles the measured step; add --mode=measure (CUDA, or CPU for a "
                        "small model), the estimate runs no kernels")
    if profile and not os.path.isdir(os.path.dirname(os.path.abspath(profile))):
        raise UserError(f"--profile={profile}: the folder {os.path.dirname(os.path.abspath(profile))} does not "
                        "exist; create it or name a file in an existing folder")
    if rounds is not None:
        plan.run_rounds = parse_rounds(rounds, plan)
    if stock:
        return plan, measure_stock(cfg, plan, dev, timed_steps, profile)  # no engine, no engine extras
    report = measure(cfg, plan, dev, timed_steps, profile) if mode == "measure" else estimate_cpu(cfg, plan)
    add_engine_extras(report, plan)
    return plan, report


def parse_rounds(value: str, plan: Plan) -> int:
    """``--rounds``: ``all`` (the plan's M / W micro-batches per rank), or a number from 1 to M / W; a power of two
    at tier 4, as training needs."""
    n = plan.rounds if str(value) == "all" else int(value) if str(value).isdigit() else 0
    if not 1 <= n <= plan.rounds:
        raise UserError(f"--rounds={value}: the measured step runs 1 to M/W = {plan.micro_per_step}/{plan.world} = "
                        f"{plan.rounds} micro-batches per rank here; give a number in that range or 'all'")
    if policy(plan.tier).world_invariant and n & (n - 1):
        raise UserError(f"--rounds={value}: det.tier={plan.tier} sums a power-of-two number of micro-batches per "
                        "rank; give 1, 2, 4, ... or 'all'")
    return n


def summary(plan: Plan, report: Report, overrides: list[str]) -> dict:
    """One JSON-able line of a run (``--json``): what ran (the overrides, and the DETTRAIN_* experiment switches
    in the environment, which change the engine's kernels but not the config) and its measured step, tokens/s,
    MFU and peak."""
    env = {k: v for k, v in sorted(os.environ.items()) if k.startswith("DETTRAIN_")}
    out = {"variant": report.variant, "tier": 0 if report.variant == "stock" else plan.tier, "world": plan.world,
           "device": report.device, "overrides": list(overrides), "env": env, "peak_gib": round(report.peak / GIB, 4),
           "step_ms": None, "tokens_per_s": None, "mfu": None,
           "micro_per_rank": plan.micro_per_rank_run, "host_gib": round(sum(report.host.values()) / GIB, 4)}
    if report.step_s is not None:
        tokens = plan.micro_per_rank_run * plan.micro_batch * plan.seq_len
        out.update(step_ms=report.step_s * 1e3, tokens_per_s=tokens / report.step_s)
        if report.device == "cuda":  # the MFU over this GPU's own datasheet peak (none for a GPU not in the table)
            from dettrain.record.wandb_io import peak_flops

            out["gpu"] = torch.cuda.get_device_name()
            peak = peak_flops(out["gpu"])
            if peak is not None:
                out.update(mfu=6 * report.params * tokens / report.step_s / peak, peak_tflops=peak / 1e12)
    return out


def compare_stock(rounds: int, child_args: list[str], json_path: str | None) -> int:
    """``--compare-stock R``: R rounds of stock FSDP2 and dettrain's engine, each run in a fresh process (no
    setting, compiled graph or allocator state carries over from one to the other), interleaved (stock first in
    odd rounds, the engine first in even ones, so a drift of the machine favours neither); then the ratio of
    tokens/s per round, its median and spread."""
    import json
    import statistics
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = json_path or os.path.join(tmp, "runs.jsonl")
        start = _count_lines(path)
        for r in range(rounds):
            for stock in ((True, False) if r % 2 == 0 else (False, True)):
                name = "stock FSDP2" if stock else "dettrain's FSDP2 engine"
                print(f"== round {r + 1} of {rounds}: {name}", flush=True)
                cmd = [sys.executable, "-m", "dettrain.memory", *child_args, "--json", path,
                       *(["--stock"] if stock else [])]
                p = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
                print(p.stdout.rstrip(), flush=True)
                if p.returncode != 0:
                    print(f"dettrain.memory: error: the {name} run of round {r + 1} exited {p.returncode} "
                          f"(command: {' '.join(cmd)})", file=sys.stderr)
                    return p.returncode
        with open(path) as f:
            runs = [json.loads(line) for line in f.read().splitlines()[start:]]
    stock_runs = [x for x in runs if x["variant"] == "stock"]
    engine_runs = [x for x in runs if x["variant"] == "engine"]
    ratios = [e["tokens_per_s"] / s["tokens_per_s"] for s, e in zip(stock_runs, engine_runs, strict=True)]
    tier = engine_runs[0]["tier"]
    lines = ["", f"dettrain's FSDP2 engine at tier {tier} against stock FSDP2, {rounds} interleaved round(s), one "
                 f"process each (tokens/s per {'GPU' if runs[0]['device'] == 'cuda' else 'process'}, rank 0 of "
                 f"{runs[0]['world']}; communication excluded):"]
    for r, (s, e, q) in enumerate(zip(stock_runs, engine_runs, ratios, strict=True), 1):
        lines.append(f"  round {r}: stock {s['tokens_per_s']:,.0f} ({s['step_ms']:.1f} ms), engine "
                     f"{e['tokens_per_s']:,.0f} ({e['step_ms']:.1f} ms): {q:.3f}x")
    lines.append(f"engine / stock: median {statistics.median(ratios):.3f}x, spread {min(ratios):.3f}-"
                 f"{max(ratios):.3f}x over {rounds} round(s)")
    print("\n".join(lines), flush=True)
    return 0


def _count_lines(path: str) -> int:
    if not os.path.exists(path):
        return 0
    with open(path) as f:
        return sum(1 for _ in f)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m dettrain.memory",
        description="Per-rank peak memory of an N-rank FSDP2 run, played as rank 0 of a fake process group: real "
                    "steps on CUDA, a FakeTensorMode estimate on CPU.  Ends with 'peak per rank: X GiB'.")
    ap.add_argument("--nproc", type=int, default=1, help="ranks of the planned run (world size W)")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                    help="auto: measure on CUDA when a GPU is visible, else estimate on CPU")
    ap.add_argument("--mode", choices=("auto", "measure", "estimate"), default="auto",
                    help="measure: real steps (CUDA, or CPU for a small model); estimate: FakeTensorMode on CPU; "
                         "auto: measure on CUDA, estimate on CPU")
    ap.add_argument("--steps", type=int, default=5, help="timed steps when measuring (after 3 warm-up steps)")
    ap.add_argument("--profile", metavar="FILE", default=None,
                    help="measure mode: after the timed steps, profile one more step and write its op table, "
                         "slowest first, to FILE (and a Chrome trace to FILE.trace.json)")
    ap.add_argument("--stock", action="store_true",
                    help="measure mode: run the stock FSDP2 baseline instead of dettrain's engine (torch fused AdamW, "
                         "clip_grad_norm_, torch's attention, tier-0 settings), on the same model and fake group")
    ap.add_argument("--compare-stock", type=int, metavar="R", default=0,
                    help="measure mode: R rounds of stock FSDP2 and dettrain's engine at the config's tier, one "
                         "process each, interleaved; prints each run and the tokens/s ratio (median, spread)")
    ap.add_argument("--json", metavar="FILE", default=None,
                    help="append one JSON line per run to FILE: variant, tier, world, step_ms, tokens_per_s, mfu, "
                         "peak_gib")
    ap.add_argument("--rounds", metavar="N", default=None,
                    help="measure mode: micro-batches per rank the measured step runs (default 2, or 1 when a rank "
                         "runs one); 'all': the config's M / W, so tier 4's whole counter is measured, not added")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides, as for training: +exp=NAME key=value ...")
    try:
        args = ap.parse_intermixed_args(argv)
    except SystemExit as e:  # argparse has printed the usage
        return int(e.code or 0)
    try:
        if args.compare_stock:
            if args.stock or args.profile or args.mode == "estimate":
                raise UserError(f"--compare-stock={args.compare_stock} runs both variants' measured steps; drop "
                                "--stock, --profile and --mode=estimate")
            if args.compare_stock < 0:
                raise UserError(f"--compare-stock={args.compare_stock}: the number of rounds must be at least 1")
            if args.json and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
                raise UserError(f"--json={args.json}: the folder does not exist; create it or name another file")
            compose_config(args.overrides, args.nproc)  # a bad override fails here, before any run starts
            child = ["--nproc", str(args.nproc), "--device", args.device, "--mode", "measure",
                     "--steps", str(max(1, args.steps)), *(["--rounds", args.rounds] if args.rounds else []),
                     *args.overrides]
            return compare_stock(args.compare_stock, child, args.json)
        plan, report = plan_memory(args.overrides, args.nproc, args.device, args.mode, max(1, args.steps),
                                   args.profile, stock=args.stock, rounds=args.rounds)
        print(render(plan, report, args.overrides), flush=True)
        if args.json:
            append_json(args.json, summary(plan, report, args.overrides))
    except UserError as e:
        print(f"dettrain.memory: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    return 0


def append_json(path: str, line: dict) -> None:
    """One JSON line appended to ``path`` (``--json``); UserError when it cannot be written."""
    import json

    try:
        with open(path, "a") as f:
            f.write(json.dumps(line) + "\n")
    except OSError as e:
        raise UserError(f"--json={path}: {e.strerror}; name a writable file") from None


if __name__ == "__main__":
    sys.exit(main())
