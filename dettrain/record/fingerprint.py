"""Order-independent 64-bit tensor fingerprints.

    fp(T) = sum_i mix64(bits(x_i) XOR (i * GOLDEN))  mod 2^64

``bits(x_i)`` is the raw bit pattern of element ``i`` zero-extended to 64 bits (16 bits for bf16/fp16, 32 for
fp32/int32, 64 for fp64/int64, 8 for uint8/bool), ``i`` is the element's *global* index (its position in the
concatenation the caller defines, e.g. the canonical flat parameter layout) and ``mix64`` is the splitmix64
finaliser, a bijection of 64-bit integers.  Because the outer combination is integer addition modulo 2^64, which is
associative and commutative, any split of a tensor into shards, buckets or chunks can be hashed separately and the
partial sums added: the value does not depend on sharding, bucketing or world size.  Because ``mix64`` is a
bijection, flipping any bit of any element changes that element's term and so the sum.

Fingerprints are written as 16 hex digits (``format_fp``).  The computation runs where the tensor lives (CPU or
CUDA) with plain int64 torch ops, in chunks to bound temporary memory (``fingerprint_torch``, the reference); for CUDA
tensors ``fingerprint`` dispatches to ``dettrain.kernels.fingerprint``, a single-pass Triton kernel with the same
values, when Triton is importable.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable, Sequence

import torch

from dettrain.kernels import fingerprint as kernel
from dettrain.kernels.blocks import BITS_VIEW as _BITS_VIEW  # bit width and integer view of every hashed dtype
from dettrain.kernels.fingerprint import GOLDEN, MASK64, MIX1, MIX2  # the definition's constants, one copy

CHUNK = 1 << 22  # elements per pass of the torch path: bounds the int64 temporaries to ~100 MB


def _signed(u: int) -> int:
    """A u64 constant as the int64 with the same bits (torch has no uint64 arithmetic)."""
    return u - (1 << 64) if u >= 1 << 63 else u


_GOLDEN_S, _MIX1_S, _MIX2_S = _signed(GOLDEN), _signed(MIX1), _signed(MIX2)


def _mix64_(z: torch.Tensor) -> torch.Tensor:
    """splitmix64 finaliser, in place (one scratch buffer; allocation dominates this op's cost on the CPU)."""
    t = torch.empty_like(z)
    for shift, mul in ((30, _MIX1_S), (27, _MIX2_S), (31, None)):
        torch.bitwise_right_shift(z, shift, out=t)
        t &= (1 << (64 - shift)) - 1  # torch's >> is arithmetic: keep it logical
        z ^= t
        if mul is not None:
            z *= mul  # int64 multiplication wraps modulo 2^64, as the definition needs
    return z


def _bits64(x: torch.Tensor) -> torch.Tensor:
    """Zero-extended bit patterns of a 1-D tensor as int64."""
    if x.dtype not in _BITS_VIEW:
        raise TypeError(f"fingerprint: unsupported dtype {x.dtype}; supported: {sorted(map(str, _BITS_VIEW))}")
    width, view = _BITS_VIEW[x.dtype]
    if x.dtype == torch.bool:
        x = x.to(torch.uint8)
    b = x.view(view).to(torch.int64, copy=True)  # always a fresh buffer: the caller mutates it in place
    if width < 64:
        b &= (1 << width) - 1
    return b


@functools.lru_cache(maxsize=1)
def _triton_path():
    """dettrain.kernels.fingerprint when Triton and CUDA are there, else None (the torch path is used)."""
    if os.environ.get("DETTRAIN_FP_TORCH", "") == "1":  # force the reference path (benchmarks, debugging)
        return None
    return kernel if kernel.available() else None


def _use_triton(x: torch.Tensor):
    return _triton_path() if x.is_cuda else None


def fingerprint(x: torch.Tensor, offset: int = 0) -> int:
    """fp of ``x`` (flattened, row-major) whose first element has global index ``offset``; an int in [0, 2^64).

    CUDA tensors go through the single-pass Triton kernel when Triton is importable, else the torch path."""
    fast = _use_triton(x)
    if fast is not None:
        return fast.fingerprint(x, offset)
    return fingerprint_torch(x, offset)


def fingerprint_many(parts: Sequence[tuple[torch.Tensor, int]]) -> list[int]:
    """fp of each (tensor, offset); on CUDA one launch per bit width and one host sync for all of them."""
    if parts and all(_use_triton(t) is not None for t, _ in parts):
        return _triton_path().fingerprint_many(parts)
    return [fingerprint(t, off) for t, off in parts]


class Deferred:
    """Fingerprints of a list of parts, possibly still being computed on a CUDA device.

    ``fingerprint_many_deferred`` launches the work and returns at once; ``resolve_all`` reads any number of them
    with one device-to-host copy, so a training step hashes its gradients, parameters, optimizer state and batch
    with no host sync until the step's end.  Off CUDA (or without Triton) the values are computed at creation."""

    __slots__ = ("_dev", "_order", "_vals")

    def __init__(self, dev: torch.Tensor | None, order: list[int], vals: list[int] | None = None) -> None:
        self._dev, self._order, self._vals = dev, order, vals

    def values(self) -> list[int]:
        return resolve_all([self])[0]


def fingerprint_many_deferred(parts: Sequence[tuple[torch.Tensor, int]]) -> Deferred:
    """``fingerprint_many`` without the host sync: the values are read later by ``resolve_all`` (or ``values``).
    The tensors may change after the call: the kernels that read them are queued before anything later."""
    if parts and all(_use_triton(t) is not None for t, _ in parts):
        dev, order = _triton_path().fingerprint_many_async(parts)
        return Deferred(dev, order)
    return Deferred(None, list(range(len(parts))), [fingerprint(t, off) for t, off in parts])


def resolve_all(ds: Sequence[Deferred]) -> list[list[int]]:
    """The values of every Deferred, in part order, reading all device values in one copy."""
    on_dev = [d for d in ds if d._vals is None and d._dev is not None]
    if on_dev:
        flat = on_dev[0]._dev if len(on_dev) == 1 else torch.cat([d._dev.to(on_dev[0]._dev.device) for d in on_dev])
        host = [v & MASK64 for v in flat.cpu().tolist()]
        k = 0
        for d in on_dev:
            n = d._dev.numel()
            vals = [0] * len(d._order)
            for i, v in zip(d._order, host[k : k + n]):
                vals[i] = v
            d._vals, d._dev = vals, None
            k += n
    return [d._vals if d._vals is not None else [] for d in ds]


def fingerprint_torch(x: torch.Tensor, offset: int = 0) -> int:
    """The reference implementation: plain int64 torch ops, in chunks, wherever ``x`` lives."""
    flat = x.detach().reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    total = 0
    n = flat.numel()
    for start in range(0, n, CHUNK):
        part = flat[start : start + CHUNK]
        idx = torch.arange(offset + start, offset + start + part.numel(), device=part.device, dtype=torch.int64)
        idx *= _GOLDEN_S
        terms = _bits64(part)
        terms ^= idx
        _mix64_(terms)
        # int64 sums wrap modulo 2^64 exactly like the definition; the order of the sum cannot matter
        total += int(terms.sum().item())
    return total & MASK64


def fingerprint_parts(parts: Iterable[tuple[torch.Tensor, int]]) -> int:
    """Sum of the fingerprints of (tensor, global offset) parts, i.e. the fingerprint of their concatenation."""
    return combine(fingerprint(t, off) for t, off in parts)


def combine(values: Iterable[int]) -> int:
    """Combine partial fingerprints of disjoint index ranges (sum modulo 2^64)."""
    return sum(values) & MASK64


def format_fp(v: int) -> str:
    return f"{v & MASK64:016x}"


def segment_fingerprints(
    flat: torch.Tensor, flat_offset: int, segments: Sequence[tuple[str, int, int]]
) -> dict[str, int]:
    """Partial fingerprints of named segments of a global index space, restricted to the part held in ``flat``.

    ``flat`` holds global indices [flat_offset, flat_offset + flat.numel()); each segment is (name, start, end) in
    global indices.  Returns {name: partial fp} for segments that intersect ``flat``; summing the results of every
    holder of every part (e.g. all ranks' shards) gives each segment's full fingerprint.  On CUDA (with Triton) all
    segments are hashed in one launch.
    """
    fast = _use_triton(flat)
    if fast is not None:
        return fast.segment_fingerprints(flat, flat_offset, segments)
    return segment_fingerprints_torch(flat, flat_offset, segments)


def segment_fingerprints_torch(
    flat: torch.Tensor, flat_offset: int, segments: Sequence[tuple[str, int, int]]
) -> dict[str, int]:
    """Reference path of ``segment_fingerprints``: one torch fingerprint per segment."""
    out: dict[str, int] = {}
    lo, hi = flat_offset, flat_offset + flat.numel()
    for name, start, end in segments:
        a, b = max(start, lo), min(end, hi)
        if a < b:
            out[name] = fingerprint_torch(flat[a - lo : b - lo], a)
    return out


# ---- combining partials over ranks --------------------------------------------------------------------------
def sum_u64(values: list[int], info) -> list[int]:
    """Element-wise sum mod 2^64 of every rank's integer partials (one all_gather; a collective)."""
    values = [v & MASK64 for v in values]
    if info.world == 1:
        return values
    from dettrain.dist import all_gather_flat

    t = torch.tensor([_signed(v) for v in values], dtype=torch.int64, device=info.device)
    out = torch.empty(info.world * len(values), dtype=torch.int64, device=info.device)
    all_gather_flat(out, t)
    rows = out.view(info.world, -1).cpu().tolist()
    return [combine(r[i] for r in rows) for i in range(len(values))]


def sum_dicts(d: dict[str, int], info) -> dict[str, int]:
    """Per-name sums mod 2^64 of every rank's partials (names any rank has)."""
    from dettrain import dist as D

    allp = D.all_gather_objects(d, info)
    keys = sorted({k for x in allp for k in x})
    return {k: combine(x.get(k, 0) for x in allp) for k in keys}


def combine_over_ranks(part, per_tensor: bool, info) -> tuple[dict[str, int], dict[str, dict[str, str]]]:
    """(step fingerprints, per-tensor hex fingerprints) from every rank's ``engines.Partials`` (a collective).
    Values still on the device are read first, in one copy (``Partials.resolve``)."""
    part = part.resolve()
    names = sorted(part.totals)
    summed = dict(zip(names, sum_u64([part.totals[k] for k in names], info)))
    out: dict[str, dict[str, str]] = {}
    if per_tensor:
        for key in ("grad", "param"):
            if key in part.totals:
                out[key] = {n: format_fp(v) for n, v in sum_dicts(part.tensors.get(key, {}), info).items()}
    return summed, out
