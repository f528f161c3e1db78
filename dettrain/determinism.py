"""Determinism tiers, the seed derivation, and the settings audit.

Tiers (``det.tier``; docs/determinism.md):
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

import copy
import functools
import hashlib
import os
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dettrain.tiers import TIERS, policy  # noqa: F401 - TIERS: re-exported (the tier names)

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
    batch_invariant: bool | None = None
    """Batch-invariant kernels (a sample's result does not depend on the batch it is in): the matmuls and RMSNorm
    of dettrain's LLaMA, the loss of every model, and attention (det.attention then resolves to dettrain's kernel).
    On CUDA (Triton): None (default) is on at det.tier=4 when train.compile resolves to off, off otherwise
    (compiled, Inductor cannot fuse across them, so they are slower; tier 4 keeps its promise without them); true
    is on also when compiled and needs model.dropout=0 for dettrain's LLaMA (the attention kernel has no dropout).
    On CPU, true runs dettrain's LLaMA through the row-wise CPU ops of dettrain/kernels/rowwise.py (slow; what
    generation with training-equal logits needs, docs/generate.md); None is off.  Decided once per run
    (dettrain/loop/resolve.py)."""
    attention: str = "auto"
    """Which attention runs, for dettrain's LLaMA, Hugging Face models (attn_implementation "dettrain") and any
    model that looks up torch.nn.functional.scaled_dot_product_attention at call time, while the run is open
    (dettrain/models/attention.py, docs/determinism.md).  auto: on CUDA with Triton, dettrain's deterministic kernel
    (no atomics; batch-invariant in batch-invariant mode) for every call it serves, at det.tier>=2 or with
    det.batch_invariant on, and torch's SDPA for the calls it cannot serve (a mask, dropout, a short sliding
    window, an unsupported head size); torch's SDPA everywhere else (CPU, no Triton, tiers 0-1).  dettrain: the
    kernel for every call (on CPU its exact fp32 reference, slow); a call it cannot serve is an error naming the
    reason.  torch: never the kernel, even in batch-invariant mode (refused with det.batch_invariant=true on CUDA).  The
    resolved choice is in the ledger header (``attention``)."""


def resolve_batch_invariant(cfg: DetConfig, device: torch.device, compiled: bool = False) -> bool:
    """Whether batch-invariant kernels run: det.batch_invariant, or by default tier 4 on CUDA when eager (compiled
    runs: off; CPU: only when asked, kernels/rowwise.py).

    The default is a speed decision, not a correctness one.  Tier 4's world-size invariance needs every rank to
    run the same micro-batch shapes (train.micro_batch is fixed, the binary tree does the rest), not kernels whose
    result is the same for every batch size: with det.batch_invariant=false tier 4 keeps its promise (tested on
    CPU without them, and on the H200).  Measured on one H200 (BENCHMARKS.md, "torch.compile"):
    eager, they are faster and lighter (125m tier 4 -7.5 % step time against tier 0, -33 % memory); compiled, they
    are slower, because Inductor cannot fuse across them (125m tier 4: 342.7 ms with, 264.1 ms without; 1b: 687.4
    vs 571.9 ms).  So the default follows train.compile.  det.batch_invariant=true adds the guarantee that a
    sample's loss does not depend on its batch neighbours."""
    if device.type != "cuda":
        return bool(cfg.batch_invariant)  # CPU: only when asked (kernels/rowwise.py, slow)
    if cfg.batch_invariant is None:
        return policy(cfg.tier).world_invariant and not compiled
    return bool(cfg.batch_invariant)


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
    if policy(tier).deterministic_ops:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink SHARP reduces in the switch: not ours to order


def apply_tier(cfg: DetConfig) -> None:
    """Apply the torch settings of ``cfg.tier`` to this process."""
    pol = policy(cfg.tier)
    if pol.pin_threads or cfg.threads > 0:
        torch.set_num_threads(max(cfg.threads, 1))
    fast = pol.fast_math
    # the precision API sets cuBLAS *and* oneDNN (CPU) fp32 matmuls; the legacy allow_tf32 flag leaves oneDNN alone,
    # and mixing the two APIs makes torch.get_float32_matmul_precision() raise, so matmuls go through this one only
    torch.set_float32_matmul_precision("high" if fast else "highest")
    torch.backends.cudnn.allow_tf32 = fast
    torch.backends.cudnn.benchmark = fast
    torch.backends.cudnn.deterministic = pol.deterministic_ops
    torch.use_deterministic_algorithms(pol.deterministic_ops, warn_only=False)
    if pol.deterministic_ops and hasattr(torch.utils, "deterministic"):
        # deterministic mode otherwise fills every fresh allocation with NaN: +1.5 ms/step on an H200
        # (docs/determinism.md) for no gain, since we never read uninitialised memory.
        torch.utils.deterministic.fill_uninitialized_memory = False
    apply_inductor(cfg.tier)


# Inductor settings that choose kernels by timing them; a choice made by timing can differ between runs, and
# some of those choices (a reduction's block size or split, a GEMM template) change the order of a sum
INDUCTOR_TIMED = ("max_autotune", "max_autotune_gemm", "coordinate_descent_tuning")


def apply_inductor(tier: int) -> None:
    """torch.compile's Inductor at ``tier``: deterministic mode and no timing-based tuning at tier >= 2.

    torch 2.11 and 2.13 both set ``torch._inductor.config.deterministic`` inside ``use_deterministic_algorithms``
    (checked in their sources); it is set here as well so that the promise does not rest on that coupling.  In
    that mode Inductor keeps only the reduction configurations that give the same bits whatever it picks, and skips
    benchmarking that changes numerics (pad_mm, GEMM autotuning, mix-order reduction splits).  Below tier 2
    Inductor keeps its defaults (nothing is promised)."""
    import torch._inductor.config as inductor

    if not policy(tier).deterministic_ops:
        return
    if hasattr(inductor, "deterministic"):
        inductor.deterministic = True
    for name in INDUCTOR_TIMED:
        if hasattr(inductor, name):
            setattr(inductor, name, False)


def inductor_flags() -> dict:
    """Inductor's determinism-relevant settings as they are now (recorded in the ledger header)."""
    import torch._inductor.config as inductor

    names = ("deterministic", "batch_invariant", *INDUCTOR_TIMED, "fallback_random")
    return {n: getattr(inductor, n) for n in names if hasattr(inductor, n)}


# cuBLAS workspace settings torch documents as deterministic (torch checks for exactly these two)
CUBLAS_DETERMINISTIC = (":4096:8", ":16:8")


def _has_cuda() -> bool:
    return torch.version.cuda is not None and torch.cuda.is_available()


def audit(tier: int, threads: int | None = None, world: int | None = None,
          reference: dict | None = None, attention: dict | None = None) -> list[dict]:
    """Check the live process against ``tier``: one row per setting.

    Each row is ``{name, value, want, ok, fix, level}``: ``level`` is "required" (a failure can change the bits
    dettrain computes at this tier) or "advice" (worth fixing for code outside dettrain; never fails a run);
    ``fix`` is the line that repairs a failed row.  ``threads`` is det.threads (None: the DetConfig default),
    ``world`` the number of ranks (None: $WORLD_SIZE or 1), ``reference`` the header of another run's ledger whose
    versions and devices must match (the tier promise holds for the same software and hardware only),
    ``attention`` the run's resolved det.attention (``attention.AttentionChoice.header()``), recorded as a row."""
    threads = DetConfig.threads if threads is None else threads
    world = int(os.environ.get("WORLD_SIZE", 1)) if world is None else world
    cuda = _has_cuda()
    pol = policy(tier)
    det2 = pol.deterministic_ops
    rows: list[dict] = []

    def row(name: str, value, want, ok: bool, fix: str, level: str = "required") -> None:
        rows.append({"name": name, "value": value, "want": want, "ok": bool(ok), "fix": "" if ok else fix,
                     "level": level})

    # ---- kernels -------------------------------------------------------------------------------------------
    det = torch.are_deterministic_algorithms_enabled()
    row("torch.use_deterministic_algorithms", det, True if det2 else "any", det or not det2,
        "torch.use_deterministic_algorithms(True) (dettrain does this at det.tier>=2)")
    warn = torch.is_deterministic_algorithms_warn_only_enabled()
    row("deterministic warn_only", warn, False if det2 else "any", not (det2 and warn),
        "torch.use_deterministic_algorithms(True, warn_only=False): warn_only lets nondeterministic kernels run")
    ws = os.environ.get("CUBLAS_WORKSPACE_CONFIG", "")
    if cuda:
        row("CUBLAS_WORKSPACE_CONFIG", ws, " or ".join(CUBLAS_DETERMINISTIC) if det2 else "any",
            not det2 or ws in CUBLAS_DETERMINISTIC,
            f"export CUBLAS_WORKSPACE_CONFIG={CUBLAS_WORKSPACE} before CUDA initialises (dettrain sets it when unset)")
    else:
        row("CUBLAS_WORKSPACE_CONFIG", ws, "n/a (no CUDA device)", True, "")
    tf32_mm = bool(torch.backends.cuda.matmul.allow_tf32)
    row("TF32 matmul (cuBLAS)", tf32_mm, False if det2 else "any", not (det2 and tf32_mm),
        "torch.set_float32_matmul_precision('highest')")
    tf32_cd = bool(torch.backends.cudnn.allow_tf32)
    row("TF32 conv (cuDNN)", tf32_cd, False if det2 else "any", not (det2 and tf32_cd),
        "torch.backends.cudnn.allow_tf32 = False")
    mkl = getattr(getattr(getattr(torch.backends, "mkldnn", None), "matmul", None), "fp32_precision", None)
    if mkl is not None:  # torch >= 2.9: oneDNN may run fp32 CPU matmuls in bf16/tf32
        row("oneDNN fp32 matmul precision (CPU)", mkl, "none or ieee" if det2 else "any",
            not det2 or mkl in ("none", "ieee"), "torch.set_float32_matmul_precision('highest')")
    bench = torch.backends.cudnn.benchmark
    row("cudnn.benchmark", bench, False if det2 else "any", not (det2 and bench),
        "torch.backends.cudnn.benchmark = False (autotuning may pick a different kernel each run)")
    cdet = torch.backends.cudnn.deterministic
    row("cudnn.deterministic", cdet, True if det2 else "any", cdet or not det2,
        "torch.backends.cudnn.deterministic = True")
    fill = getattr(getattr(torch.utils, "deterministic", None), "fill_uninitialized_memory", None)
    if fill is not None:
        row("fill_uninitialized_memory", fill, False if det2 else "any", not (det2 and fill),
            "torch.utils.deterministic.fill_uninitialized_memory = False (saves a fill kernel per allocation; "
            "+1.5 ms/step on an H200)", level="advice")

    # ---- torch.compile (Inductor): only matters when train.compile is on, but cheap to hold at every tier ----
    flags = inductor_flags()
    if "deterministic" in flags:
        ind = bool(flags["deterministic"])
        row("inductor deterministic", ind, True if det2 else "any", ind or not det2,
            "torch._inductor.config.deterministic = True (dettrain's apply_tier does; torch.use_deterministic_"
            "algorithms(True) also sets it on torch 2.11-2.13)")
    for name in INDUCTOR_TIMED:
        if name in flags:
            v = bool(flags[name])
            row(f"inductor {name}", v, False if det2 else "any", not (det2 and v),
                f"torch._inductor.config.{name} = False (it picks kernels by timing them, which can change the "
                "order of a sum between runs)")
    if "batch_invariant" in flags:  # torch >= 2.13 only; dettrain's own kernels are batch-invariant instead
        row("inductor batch_invariant", bool(flags["batch_invariant"]), "recorded", True, "", level="info")

    # ---- attention: both routes are deterministic at tier >= 2 (the kernel by construction, torch's SDPA under
    # deterministic mode); which one ran is recorded, since their bits differ
    if attention is not None:
        kern = f" ({attention['kernel']})" if attention.get("kernel") else ""
        value = f"{attention.get('resolved')}{kern}"
    else:
        value = "n/a (no run's choice given)"
    row("attention (det.attention)", value, "recorded", True, "", level="info")

    # ---- CPU threads: CPU reductions split work by thread count, so the count is part of the result ----------
    n = torch.get_num_threads()
    row("torch threads (det.threads)", n, threads if det2 else "any", not det2 or n == threads,
        f"torch.set_num_threads({threads}) or set det.threads={n} (dettrain sets it at start-up)")
    omp = os.environ.get("OMP_NUM_THREADS", "")
    row("OMP_NUM_THREADS", omp, f"unset or {threads}" if det2 else "any",
        not det2 or omp in ("", str(threads)),
        f"export OMP_NUM_THREADS={threads} (torch.set_num_threads overrides it for torch; other OpenMP code "
        "in the process does not)", level="advice")

    # ---- collectives: at tier 2 DDP sums gradients inside NCCL, whose algorithm/protocol choice sets the order ----
    nccl_sums = pol.backend_sums and world > 1 and cuda
    if pol.canonical_sum:
        want_nccl = "any (tier>=3: no floating-point sum happens inside NCCL)"
    elif nccl_sums:
        want_nccl = "pinned, not NVLS/CollNet"
    else:
        want_nccl = "any (one rank or no NCCL)" if det2 else "any"
    fixes = {"NCCL_ALGO": "export NCCL_ALGO=Ring", "NCCL_PROTO": "export NCCL_PROTO=Simple"}
    for var in ("NCCL_ALGO", "NCCL_PROTO"):
        v = os.environ.get(var, "")
        bad = nccl_sums and (v == "" or any(x in v.lower() for x in ("nvls", "collnet", ",")))
        row(var, v, want_nccl, not bad,
            f"{fixes[var]} (tier 2 on several ranks sums in NCCL; or use det.tier=3, which never does)")
    nvls = os.environ.get("NCCL_NVLS_ENABLE", "")
    row("NCCL_NVLS_ENABLE", nvls, "0" if nccl_sums else want_nccl, not nccl_sums or nvls == "0",
        "export NCCL_NVLS_ENABLE=0 (NVLink SHARP reduces inside the switch, in an order we cannot fix)")

    # ---- Python ----------------------------------------------------------------------------------------------
    phs = os.environ.get("PYTHONHASHSEED", "")
    row("PYTHONHASHSEED", phs, "an integer" if pol.seeded else "any", not pol.seeded or phs.isdigit(),
        "export PYTHONHASHSEED=0 (str hashes are salted per process: set/dict-of-str iteration order in user data "
        "code changes between runs; dettrain's own code never depends on it)", level="advice")

    # ---- versions and devices: the promise holds for the same software and hardware ---------------------------
    v = versions()
    ref_v = (reference or {}).get("versions", {}) if reference is not None else None
    for key in ("dettrain", "torch", "python", "numpy", "cuda", "cudnn", "nccl", "driver", "devices"):
        val = v.get(key)
        if ref_v is None or key not in ref_v:
            row(f"version {key}", val, "recorded", True, "", level="info")
        else:
            row(f"version {key}", val, ref_v[key], val == ref_v[key],
                f"run with {key} {ref_v[key]} as the reference did (bits are promised only for the same versions "
                "and device type)")
    if reference is not None and "world_size" in reference and not pol.world_invariant:
        rw = reference["world_size"]
        row("world size", world, rw, world == rw,
            f"launch {rw} ranks as the reference did, or use det.tier=4 (same bits on any power-of-two world size)")
    return rows


def audit_failures(rows: list[dict]) -> list[dict]:
    """The required rows that failed."""
    return [r for r in rows if not r["ok"] and r.get("level", "required") == "required"]


def versions() -> dict:
    """Library, driver and device versions for ledger headers (queried once per process: nvidia-smi is slow)."""
    return copy.deepcopy(_versions())


def source_id(root: Path | None = None) -> str:
    """dettrain's version and a hash of its own sources (every ``.py`` under the package, by relative path and
    content; 12 hex digits): its kernels and reducers set the bits a run produces, so two runs are promised the same
    bits only on the same dettrain code, and the version string alone does not change with an edit or a checkout."""
    from dettrain import __version__

    root = Path(__file__).resolve().parent if root is None else root
    h = hashlib.sha256()
    for f in sorted(root.rglob("*.py")):
        if "__pycache__" in f.parts:
            continue
        h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return f"{__version__}+{h.hexdigest()[:12]}"


@functools.lru_cache(maxsize=1)
def _versions() -> dict:
    import platform
    import sys

    v: dict = {"dettrain": source_id(), "torch": torch.__version__, "python": ".".join(map(str, sys.version_info[:3])),
               "numpy": np.__version__, "cuda": torch.version.cuda, "cudnn": None, "nccl": None,
               "driver": None, "devices": []}
    if _has_cuda():
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
        except Exception:  # noqa: BLE001 - no nvidia-smi in the container: leave None
            pass
    else:
        v["devices"] = [platform.processor() or platform.machine()]
    return v
