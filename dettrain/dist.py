"""Process-group setup for a training run: reads torchrun's RANK/WORLD_SIZE/LOCAL_RANK and initialises
torch.distributed.  Elsewhere, determinism.audit and tools/audit.py read WORLD_SIZE only to default the world size
of a settings audit; sync/engines/fsdp2.py starts a one-rank group where FSDP2 runs without torchrun, and
tools/memory.py a fake group of N ranks."""

from __future__ import annotations

import datetime
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dettrain.errors import UserError


@dataclass
class DistConfig:
    """Distributed settings (``dist.*``)."""

    backend: str = "auto"
    """auto (nccl when CUDA is available, else gloo), nccl or gloo."""
    bucket_mb: float = 25.0
    """Gradient bucket size in MiB (DDP's bucket_cap_mb at tiers 0-2; the canonical reducer's bucket at 3-4)."""
    shard_optimizer: bool = False
    """Tiers 3-4: each rank keeps only its shard of the reduced gradient and the optimizer state (ZeRO-1/2) and
    parameters are all-gathered after the update."""
    offload_partials: bool = False
    """Tier 4: keep the tree's partial sums in host memory (pinned, copied on a side stream) instead of on the
    device.  dist.engine=flat: every entry of one counter per bucket (a rank with L >= 4 micro-batches a step holds
    log2(L/2) partials, a whole fp32 gradient each; offloaded, the device holds only tier 3's gradient buffer), each
    pair but the last copied out once and read back for its merges and the finish.  dist.engine=fsdp2: every
    entry of the per-shard counters (log2(R) shards for R rounds a rank), read back for each merge, so the device
    holds none.  The copies cost speed where a rank runs many small micro-batches (0.64-0.77x tier 0's tokens/s at
    125m micro-batch 4, 0.70x at 1b micro-batch 2, one H100, BENCHMARKS.md), so it is off by default.
    Never changes a bit (docs/engines.md, "What tier 4's tree costs in memory"), so it is left out of the config
    hash and a resume may change it."""
    timeout_s: int = 600
    """Collective timeout in seconds."""
    engine: str = "auto"
    """Gradient-sync engine: auto (ddp below tier 3, flat from tier 3), ddp (torch DDP, tiers 0-2), flat (dettrain's
    canonical reducer over one flat buffer, any tier) or fsdp2 (torch FSDP2, ZeRO-3, any tier; canonical
    reduce-scatter at tiers 3-4; torch >= 2.9).  At tier 4 flat and fsdp2 give the same bits.  Or an Engine
    subclass by import path, ``package.module:Class`` (a new engine in one file: docs/engines.md)."""
    reshard_after_forward: bool | str = "auto"
    """fsdp2: free each block's gathered parameters after its forward (all-gather again in backward): less memory,
    one more all-gather per block.  auto: true on several ranks, false on one (there the shard is the whole
    parameter, so resharding saves only the compute-dtype copy, and gathering twice cost +8.5 % step time compiled
    at 125m on an H200, BENCHMARKS.md).  Never changes a bit."""


@dataclass
class DistInfo:
    rank: int
    world: int
    local_rank: int
    device: torch.device
    backend: str | None  # None when single-process without a process group

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def env_world() -> tuple[int, int, int]:
    """(rank, world size, local rank) from the environment torchrun/Slurm set; (0, 1, 0) for a plain process."""
    return (int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)),
            int(os.environ.get("LOCAL_RANK", 0)))


def resolve_reshard(setting: bool | str, world: int) -> bool:
    """dist.reshard_after_forward: auto -> true on several ranks, false on one."""
    if isinstance(setting, bool):
        return setting
    if str(setting).lower() == "auto":
        return world > 1
    return str(setting).lower() == "true"


def resolve_backend(name: str) -> str:
    if name == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if name == "nccl" and not torch.cuda.is_available():
        raise UserError("dist.backend=nccl needs CUDA, and no GPU is visible; use dist.backend=gloo (or auto)")
    if name not in ("nccl", "gloo"):
        raise UserError(f"dist.backend={name!r} is not one of auto, nccl, gloo")
    return name


def init(cfg: DistConfig) -> DistInfo:
    """Initialise the process group (when WORLD_SIZE > 1) and pick this rank's device."""
    rank, world, local = env_world()
    backend = resolve_backend(cfg.backend)
    if backend == "nccl":
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        kw = {"device_id": device} if backend == "nccl" else {}
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=cfg.timeout_s), **kw)
    return DistInfo(rank, world, local, device, backend if world > 1 else None)


def broadcast_object(obj, info: DistInfo):
    """Rank 0's ``obj`` on every rank."""
    if info.world == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_gather_objects(obj, info: DistInfo) -> list:
    if info.world == 1:
        return [obj]
    out: list = [None] * info.world
    dist.all_gather_object(out, obj)
    return out


def all_gather_flat(out: torch.Tensor, inp: torch.Tensor, async_op: bool = False):
    """Concatenate every rank's ``inp`` into ``out`` (rank order); all_gather_single where torch has it."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, inp, async_op=async_op)


def barrier(info: DistInfo) -> None:
    if info.world > 1:
        dist.barrier()


# Gloo's worker threads free a finished collective's work objects, whose tensors Python owns (so they take the
# GIL), shortly after the collective completes.  If the last reference to the group goes meanwhile from Python, the
# group's destructor runs with the GIL held and waits for those threads: a deadlock (seen in about 1 of 30 two-rank
# DDP runs on 2 CPU cores, the DDP reducer dropping the group after the final barrier; py-spy: ~ProcessGroupGloo
# in pthread_mutex_lock, the worker in gil_scoped_acquire inside ~AsyncBarrierWork).  So the engines drop what holds
# the group first (Engine.close), and the threads get this long without the GIL before the group is destroyed.
SHUTDOWN_GRACE_S = 0.05


def shutdown() -> None:
    if dist.is_initialized():
        time.sleep(SHUTDOWN_GRACE_S)  # releases the GIL: the worker threads finish freeing completed work
        dist.destroy_process_group()
