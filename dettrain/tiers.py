"""The determinism tiers as one policy: what each tier turns on, resolved once from ``det.tier``.

Every module asks the policy what to do (``policy(cfg.det.tier).canonical_sum``) instead of comparing tier numbers,
so what a tier means is written down here and nowhere else.  Each tier keeps every promise of the tiers below it:

  tier  name         what it adds (the field that says so)
  0     fast         nothing promised: TF32, cudnn.benchmark, Inductor's defaults (``fast_math``)
  1     seeded       every random stream from ``determinism.derive_seed`` (``seeded``)
  2     ops          deterministic kernels (torch, cuDNN, cuBLAS workspace, Inductor's deterministic mode, dettrain's
                     attention kernel on CUDA), TF32 off, NVLink SHARP off (``deterministic_ops``); the CPU thread
                     count pinned and recorded (``pin_threads``)
  3     collectives  gradients summed by dettrain in a canonical order that no backend, algorithm or bucket size
                     changes (``canonical_sum``): the flat reducer or FSDP2 with the canonical reduce-scatter
  4     invariant    the same bits on any power-of-two world size: micro-batches dealt round-robin and summed by
                     one binary tree over their global indices (``world_invariant``)
"""

from __future__ import annotations

from dataclasses import dataclass

from dettrain.errors import UserError

TIERS = {0: "fast", 1: "seeded", 2: "ops", 3: "collectives", 4: "invariant"}


@dataclass(frozen=True)
class TierPolicy:
    """What one tier does; the only place that maps tier numbers to behaviour."""

    tier: int
    name: str
    fast_math: bool
    """TF32 matmuls, cudnn.benchmark and torch's default float32 matmul precision (tier 0 only)."""
    seeded: bool
    """Every random stream seeded from the documented derivation (PYTHONHASHSEED expected fixed)."""
    deterministic_ops: bool
    """torch.use_deterministic_algorithms, cuDNN deterministic, CUBLAS_WORKSPACE_CONFIG, Inductor's deterministic
    mode with no timing-based tuning, NCCL_NVLS_ENABLE=0, dettrain's attention kernel on CUDA."""
    pin_threads: bool
    """The CPU thread count is pinned to det.threads and recorded (CPU reductions depend on it)."""
    canonical_sum: bool
    """Gradients are summed by dettrain's canonical reducer or reduce-scatter, never by a backend: DDP is refused,
    and each micro-batch's loss is backpropagated unscaled (the 1/M scale is applied once, after the sum)."""
    world_invariant: bool
    """The same bits on any power-of-two world size: a power-of-two number of micro-batches per step and per
    rank, dealt round-robin, each micro-batch's gradient a leaf of one binary tree over global indices."""
    cost: str
    """What the tier costs over the one below it (``dettrain advise`` prints it)."""

    @property
    def default_engine(self) -> str:
        """``dist.engine=auto``: torch DDP while the order of the gradient sum is not promised, else the flat
        canonical reducer."""
        return "flat" if self.canonical_sum else "ddp"

    @property
    def summing_tier(self) -> int:
        """The tier the canonical reducer runs at under this policy (the flat engine sums canonically at every
        tier): this one when it promises a canonical sum, else the lowest tier that does."""
        return self.tier if self.canonical_sum else lowest("canonical_sum").tier

    @property
    def backend_sums(self) -> bool:
        """Deterministic kernels but the gradient sum left to the backend (NCCL's all-reduce): stable only for a
        fixed world size, algorithm and channel count."""
        return self.deterministic_ops and not self.canonical_sum


_COSTS = {
    0: "nothing: torch's fastest settings, and no promise",
    1: "no kernel cost (seeding only)",
    2: "+6-8% step time for a 12-layer d768 model on one H200 (deterministic kernels + CUBLAS_WORKSPACE_CONFIG, "
       "docs/determinism.md); up to x2.8 if attention falls back to the math backend",
    3: "tier 2's kernel cost plus the canonical reducer (all_to_all + fixed-order sum + all_gather, the same bytes "
       "as a ring all-reduce); through the CLI on one H100 0.96-1.06x tier 0's tokens/s at tier 0's peak memory "
       "(125m, HF 125m, 1b; BENCHMARKS.md)",
    4: "tier 3's cost plus the tree over each rank's micro-batches: up to log2(L/2) spare fp32 gradients on the "
       "device (L: micro-batches a rank runs a step; +12.3 GiB at 1b with L = 16) and their zeroing and merging; on "
       "one H100 0.91-1.18x tier 0's tokens/s, its peak up to +72 % (BENCHMARKS.md)",
}


def _build(tier: int) -> TierPolicy:
    return TierPolicy(tier=tier, name=TIERS[tier], fast_math=tier == 0, seeded=tier >= 1,
                      deterministic_ops=tier >= 2, pin_threads=tier >= 2, canonical_sum=tier >= 3,
                      world_invariant=tier >= 4, cost=_COSTS[tier])


_POLICIES = {t: _build(t) for t in TIERS}


def is_tier(value: object) -> bool:
    """Whether ``value`` is a tier number (an int, not a bool, of ``TIERS``): the one range check of a tier."""
    return not isinstance(value, bool) and isinstance(value, int) and value in _POLICIES


def not_a_tier(value: object, key: str = "det.tier") -> str:
    """The one message for a value that is not a tier, naming ``key`` and the valid tiers."""
    return (f"{key}={value!r} is not a tier; use one of {sorted(TIERS)} "
            f"({', '.join(f'{k}={v}' for k, v in TIERS.items())})")


def policy(tier: int) -> TierPolicy:
    """The policy of ``det.tier``; a UserError (exit 2 at the command line) names the valid tiers."""
    if not is_tier(tier):
        raise UserError(not_a_tier(tier))
    return _POLICIES[tier]


def lowest(promise: str) -> TierPolicy:
    """The policy of the lowest tier that keeps ``promise`` (a boolean field of TierPolicy, e.g. "canonical_sum");
    ValueError for a name that is not one."""
    if not isinstance(getattr(_POLICIES[0], promise, None), bool):
        raise ValueError(f"{promise!r} is not a promise of TierPolicy")
    return next(p for p in _POLICIES.values() if getattr(p, promise))
