"""Determinism tiers, the seed derivation, and the settings audit.

Tiers (``det.tier``; DESIGN.md section 1):
  0 fast         nothing promised; TF32 and cudnn.benchmark on, torch's default CPU threads
  1 seeded       every random stream seeded from ``derive_seed``; numerics may still drift
  2 ops          + deterministic kernels, CUBLAS_WORKSPACE_CONFIG, TF32 off, NVLS off, pinned CPU threads
  3 collectives  + gradient sync by dettrain's canonical reducer: same bits for any backend choice or bucket size
  4 invariant    + same bits on any power-of-two world size (fixed binary tree over micro-batches)

Seed derivation: every stream gets ``derive_seed(seed, purpose, *indices)``: the first 8 bytes of
sha256("dettrain|<seed>|<purpose>|<i1>|<i2>...") as an unsigned integer, masked to 63 bits.  Purposes:

  python  (rank)            Python's ``random``
  numpy   (rank)            numpy's global generator
  torch   (rank)            torch CPU generator (default stream for anything not covered below)
  cuda    (rank)            torch CUDA generators
  data    (epoch)           the global sample permutation of one epoch
  worker  (rank, worker)    DataLoader worker processes
  dropout (step, micro)     every random draw inside one micro-batch (keyed by global micro-batch index)
  init    (parameter name)  parameter initialisation (see model.init_parameters)

Never ``seed + rank``: neighbouring seeds of the same generator are correlated and two runs with seeds s and s+1
would share streams.
"""

from __future__ import annotations

import hashlib
import os
import random
from dataclasses import dataclass

import numpy as np
import torch

TIERS = {0: "fast", 1: "seeded", 2: "ops", 3: "collectives", 4: "invariant"}
CUBLAS_WORKSPACE = ":4096:8"


@dataclass
class DetConfig:
    """Determinism settings (``det.*``)."""

    tier: int = 3
    """0 fast, 1 seeded, 2 ops, 3 collectives (default), 4 invariant; see the README's tier table."""
    threads: int = 1
    """CPU threads per rank (torch.set_num_threads); pinned at tier >= 2 because CPU reductions depend on it.
    0 leaves torch's default (tiers 0-1 only)."""
    reference: str | None = None
    """Run dir or ledger of an earlier run to compare against live, step by step (None: no live check)."""
    on_divergence: str = "warn"
    """What the live check does at the first mismatch: warn (log and continue) or stop (all ranks stop cleanly)."""
    batch_invariant: bool = False
    """Batch-invariant kernels on GPU (no effect on CPU, where the default kernels are used)."""


def derive_seed(seed: int, purpose: str, *indices: int | str) -> int:
    """The one derivation from ``seed`` to every random stream (see the module docstring)."""
    key = "|".join(["dettrain", str(int(seed)), purpose, *(str(i) for i in indices)])
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") & ((1 << 63) - 1)


def seed_process(seed: int, rank: int) -> None:
    """Seed the process-wide streams of this rank (python, numpy, torch CPU and CUDA)."""
    random.seed(derive_seed(seed, "python", rank))
    np.random.seed(derive_seed(seed, "numpy", rank) % (1 << 32))
    torch.manual_seed(derive_seed(seed, "torch", rank))
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(derive_seed(seed, "cuda", rank))


def seed_micro_batch(seed: int, step: int, micro: int) -> None:
    """Key every random draw of one micro-batch (dropout, ...) by (seed, step, global micro-batch index).

    Keyed by the global index, never by rank, so the draw is the same whichever rank computes the micro-batch."""
    s = derive_seed(seed, "dropout", step, micro)
    torch.manual_seed(s)
    if torch.cuda.is_available():
        torch.cuda.manual_seed(s)


def set_env_before_cuda(tier: int) -> None:
    """Environment that must be in place before CUDA or NCCL initialise (called first thing in main)."""
    if tier >= 2:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink SHARP reduces in the switch: not ours to order


def apply_tier(cfg: DetConfig) -> None:
    """Apply the torch settings of ``cfg.tier`` to this process."""
    tier = cfg.tier
    if tier >= 2 or cfg.threads > 0:
        torch.set_num_threads(max(cfg.threads, 1))
    fast = tier == 0
    torch.backends.cuda.matmul.allow_tf32 = fast
    torch.backends.cudnn.allow_tf32 = fast
    torch.backends.cudnn.benchmark = fast
    torch.backends.cudnn.deterministic = tier >= 2
    torch.use_deterministic_algorithms(tier >= 2, warn_only=False)
    if tier >= 2 and hasattr(torch.utils, "deterministic"):
        # deterministic mode otherwise fills every fresh allocation with NaN: +1.5 ms/step on an H200 (FACTS.md)
        # for no gain, since we never read uninitialised memory.
        torch.utils.deterministic.fill_uninitialized_memory = False


def audit(tier: int) -> list[dict]:
    """Check the live process against ``tier``: one row per setting with keys name, value, want, ok, fix."""
    rows: list[dict] = []

    def row(name: str, value, want, ok: bool, fix: str) -> None:
        rows.append({"name": name, "value": value, "want": want, "ok": bool(ok), "fix": "" if ok else fix})

    det = torch.are_deterministic_algorithms_enabled()
    row("torch.use_deterministic_algorithms", det, tier >= 2, det == (tier >= 2) or tier < 2,
        "torch.use_deterministic_algorithms(True) (dettrain does this at det.tier>=2)")
    ws = os.environ.get("CUBLAS_WORKSPACE_CONFIG", "")
    row("CUBLAS_WORKSPACE_CONFIG", ws, CUBLAS_WORKSPACE if tier >= 2 else "any",
        tier < 2 or ws in (":4096:8", ":16:8", ":65536:2"),
        f"export CUBLAS_WORKSPACE_CONFIG={CUBLAS_WORKSPACE} before CUDA initialises")
    tf32 = bool(torch.backends.cuda.matmul.allow_tf32 or torch.backends.cudnn.allow_tf32)
    row("TF32", tf32, False if tier >= 2 else "any", tier < 2 or not tf32,
        "torch.backends.cuda.matmul.allow_tf32 = False; torch.backends.cudnn.allow_tf32 = False")
    bench = torch.backends.cudnn.benchmark
    row("cudnn.benchmark", bench, False if tier >= 2 else "any", tier < 2 or not bench,
        "torch.backends.cudnn.benchmark = False")
    cdet = torch.backends.cudnn.deterministic
    row("cudnn.deterministic", cdet, True if tier >= 2 else "any", tier < 2 or cdet,
        "torch.backends.cudnn.deterministic = True")
    nvls = os.environ.get("NCCL_NVLS_ENABLE", "")
    row("NCCL_NVLS_ENABLE", nvls, "0" if tier >= 2 else "any", tier < 2 or nvls == "0",
        "export NCCL_NVLS_ENABLE=0 (in-switch reductions have an order we cannot fix)")
    for var in ("NCCL_ALGO", "NCCL_PROTO"):
        v = os.environ.get(var, "")
        # at tier 3-4 no floating-point sum happens inside NCCL, so its algorithm choice is free
        row(var, v, "any" if tier >= 3 else ("fixed" if tier == 2 else "any"), True, "")
    threads = torch.get_num_threads()
    omp = os.environ.get("OMP_NUM_THREADS", "")
    row("torch threads", threads, "pinned" if tier >= 2 else "any", True, "")
    phs = os.environ.get("PYTHONHASHSEED", "")
    row("PYTHONHASHSEED", phs, "any (dettrain never iterates hash-ordered sets for numerics)", True, "")
    row("OMP_NUM_THREADS", omp, "any", True, "")
    return rows


def versions() -> dict:
    """Library, driver and device versions for ledger headers."""
    v: dict = {"torch": torch.__version__, "python": ".".join(map(str, __import__("sys").version_info[:3])),
               "numpy": np.__version__, "cuda": torch.version.cuda, "cudnn": None, "nccl": None,
               "driver": None, "devices": []}
    if torch.cuda.is_available():
        v["cudnn"] = torch.backends.cudnn.version()
        try:
            v["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # noqa: BLE001 - NCCL may be absent in the build
            pass
        v["devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        try:
            import subprocess

            v["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                         capture_output=True, text=True, timeout=10).stdout.strip().split("\n")[0]
        except Exception:  # noqa: BLE001
            pass
    else:
        import platform

        v["devices"] = [platform.processor() or platform.machine()]
    return v
