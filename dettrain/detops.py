"""Deterministic substitutes for PyTorch ops whose floating-point sums go through atomics.

``scatter_add`` / ``index_add`` / ``bincount(weights=...)`` on CUDA add colliding values with ``atomicAdd``: the
order of the additions is whatever order the threads reach memory in, so the rounded result changes from run to run
(on an H200, 1e6 values into 100 bins differed in 20 of 20 reruns, docs/determinism.md).  The same atomics sit in
the backward of ``index_select`` and ``gather`` (their gradient is an index_add / scatter_add).  torch's
deterministic mode fixes some of these and refuses others (``bincount`` with weights, ``histc``, ``put_`` ...
raise RuntimeError on CUDA).

The substitutes here never let two threads add into one element.  Every colliding sum is computed as::

    1. stable sort of the target indices            -> equal targets become one contiguous run (a segment),
                                                       in their original order (stable = a unique permutation)
    2. segmented suffix scan, offsets 1, 2, 4, ...  -> after k passes element i holds the sum of the next 2^k
                                                       elements of its own segment (Hillis-Steele, masked at
                                                       segment ends): a fixed balanced binary tree per segment
    3. the first element of each segment is its sum -> written to its (unique) target: no collisions left

Only elementwise ops, slices and collision-free gathers/writes are used, so the result is the same on every run,
for every thread count, and the sum of one target depends only on the values that land in it, in input order (not
on the other targets or on how many there are).  The tree has depth ceil(log2(longest segment)), so the rounding
error is that of pairwise summation: closer to the exact sum than a sequential loop, and not bitwise equal to
torch's result (which has no defined order on CUDA).  Cost: one sort plus ceil(log2(max count)) passes over the
values.  Autograd works through every function (their backward uses only gathers and collision-free writes).

Routing: each function takes ``deterministic: bool | None``.  None (the default) follows
``torch.are_deterministic_algorithms_enabled()``, which dettrain turns on exactly at ``det.tier >= 2``
(``determinism.apply_tier``).  So code written against ``dettrain.detops`` runs torch's fast kernels at tiers 0-1
and the sorted, fixed-order sums at tiers >= 2, with no change of code.

Where dettrain uses them: its own model (models/llama.py) needs none.  ``nn.Embedding``'s CUDA backward already avoids
atomics (a warp-serialised kernel for <= 3072 indices, sort + segment reduction above; torch does not list it among
the nondeterministic ops), grouped-query attention's ``repeat_interleave`` with an integer repeat count is an
expand + copy whose backward is a plain sum, and ``cross_entropy`` on (N, C) logits has no atomics.  These are for
users' counting and routing code: token counts per expert (``bincount``), combining expert outputs (``index_add``),
gathering tokens for experts (``index_select``, whose backward is an index_add), scatter-based losses.
"""

from __future__ import annotations

import math

import torch

__all__ = ["segment_sum", "index_add", "scatter_add", "bincount", "index_select", "embedding", "enabled"]


def enabled(deterministic: bool | None = None) -> bool:
    """Whether the sorted fixed-order path is used: ``deterministic`` if given, else torch's deterministic mode."""
    return torch.are_deterministic_algorithms_enabled() if deterministic is None else bool(deterministic)


def segment_sum(keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum the rows of ``values`` (n, ...) that share a key of ``keys`` (n,) in a fixed order.

    Returns (unique keys ascending, their sums).  The order of additions inside one key is a balanced binary tree
    over that key's rows in input order (module docstring); nothing depends on thread scheduling."""
    if keys.dim() != 1 or keys.shape[0] != values.shape[0]:
        raise ValueError(f"segment_sum: keys must be 1-D with one key per row of values, got keys {tuple(keys.shape)}"
                         f" and values {tuple(values.shape)}")
    n = keys.shape[0]
    if n == 0:
        return keys.new_empty(0), values.new_empty((0, *values.shape[1:]))
    sorted_keys, perm = torch.sort(keys, stable=True)  # stable: ties keep input order, so the permutation is unique
    v = values.index_select(0, perm)  # a permutation: every source row is read once, no collisions in backward
    starts = torch.ones(n, dtype=torch.bool, device=keys.device)
    starts[1:] = sorted_keys[1:] != sorted_keys[:-1]
    # passes needed = ceil(log2(longest segment)); the segment lengths are integer counts (exact)
    start_pos = torch.nonzero(starts).squeeze(1)
    lengths = torch.diff(start_pos, append=torch.tensor([n], device=keys.device))
    longest = int(lengths.max().item())
    bshape = (-1,) + (1,) * (values.dim() - 1)  # broadcast the per-row mask over trailing dims
    s = 1
    while s < longest:
        same = (sorted_keys[s:] == sorted_keys[:-s]).view(bshape)
        head, tail = v[:-s], v[s:]
        # element i += element i+s when both lie in one segment; where() keeps x exactly (no x + 0.0 sign flip)
        v = torch.cat([torch.where(same, head + tail, head), v[-s:]], dim=0)
        s *= 2
    return sorted_keys[start_pos], v.index_select(0, start_pos)


def _add_into(base: torch.Tensor, uniq: torch.Tensor, sums: torch.Tensor) -> torch.Tensor:
    """``base`` with ``sums`` added at rows ``uniq`` (unique, so the write has no collisions)."""
    out = base.clone()
    out[uniq] = base[uniq] + sums.to(base.dtype)
    return out


def index_add(input: torch.Tensor, dim: int, index: torch.Tensor, source: torch.Tensor, *, alpha: float = 1,
              deterministic: bool | None = None) -> torch.Tensor:
    """``torch.index_add(input, dim, index, source, alpha=alpha)``, out of place, in a fixed order when enabled."""
    if not enabled(deterministic):
        return torch.index_add(input, dim, index, source, alpha=alpha)
    dim = dim % max(input.dim(), 1)
    src = source if alpha == 1 else source * alpha
    base = input.movedim(dim, 0)
    uniq, sums = segment_sum(index.reshape(-1).long(), src.movedim(dim, 0))
    return _add_into(base, uniq, sums).movedim(0, dim)


def scatter_add(input: torch.Tensor, dim: int, index: torch.Tensor, src: torch.Tensor, *,
                deterministic: bool | None = None) -> torch.Tensor:
    """``torch.scatter_add(input, dim, index, src)``, out of place, in a fixed order when enabled.

    As in torch, only the first ``index.shape`` elements of ``src`` are used; element ``index[i][j][k]`` of a dim-1
    scatter goes to ``input[i][index[i][j][k]][k]``."""
    if not enabled(deterministic):
        return torch.scatter_add(input, dim, index, src)
    if index.dim() != input.dim() or src.dim() != input.dim():
        raise ValueError("scatter_add: input, index and src must have the same number of dimensions")
    dim = dim % max(input.dim(), 1)
    src = src[tuple(slice(0, s) for s in index.shape)]
    # linear position in input of every scattered element: its own coordinates, with index[...] along ``dim``
    lin = torch.zeros(index.shape, dtype=torch.long, device=index.device)
    stride = 1
    for d in range(input.dim() - 1, -1, -1):
        if d == dim:
            coord = index.long()
        else:
            shape = [1] * input.dim()
            shape[d] = index.shape[d]
            coord = torch.arange(index.shape[d], device=index.device).view(shape)
        lin = lin + coord * stride
        stride *= input.shape[d]
    uniq, sums = segment_sum(lin.reshape(-1), src.reshape(-1))
    return _add_into(input.reshape(-1), uniq, sums).view(input.shape)


def bincount(input: torch.Tensor, weights: torch.Tensor | None = None, minlength: int = 0, *,
             deterministic: bool | None = None) -> torch.Tensor:
    """``torch.bincount``; with ``weights`` the per-bin sums are computed in a fixed order when enabled (torch's
    CUDA kernel adds them with atomics and raises RuntimeError in deterministic mode).  Integer counts (no weights)
    are exact in any order and go to torch directly."""
    if weights is None or not enabled(deterministic):
        return torch.bincount(input, weights, minlength)
    if input.dim() != 1 or weights.shape != input.shape:
        raise ValueError("bincount: input must be 1-D and weights must have its shape")
    size = max(int(input.max().item()) + 1 if input.numel() else 0, minlength)
    dtype = weights.dtype if weights.is_floating_point() else torch.float64
    return index_add(torch.zeros(size, dtype=dtype, device=weights.device), 0, input, weights.to(dtype),
                     deterministic=True)


class _IndexSelect(torch.autograd.Function):
    """index_select whose backward is the fixed-order index_add (torch's CUDA backward uses atomics)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, index: torch.Tensor) -> torch.Tensor:
        ctx.dim, ctx.shape = dim, x.shape
        ctx.save_for_backward(index)
        return x.index_select(dim, index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (index,) = ctx.saved_tensors
        zeros = grad.new_zeros(ctx.shape)
        return index_add(zeros, ctx.dim, index, grad, deterministic=True), None, None


def index_select(x: torch.Tensor, dim: int, index: torch.Tensor, *, deterministic: bool | None = None) -> torch.Tensor:
    """``x.index_select(dim, index)``; when enabled its gradient is summed in a fixed order (routing: gathering the
    tokens of each expert, where one token is picked by several experts)."""
    if not enabled(deterministic):
        return x.index_select(dim, index)
    return _IndexSelect.apply(x, dim % x.dim(), index.reshape(-1).long())


def embedding(indices: torch.Tensor, weight: torch.Tensor, *, deterministic: bool | None = None) -> torch.Tensor:
    """``F.embedding(indices, weight)`` with the fixed-order backward when enabled (nn.Embedding's own CUDA backward
    is already deterministic; this one also fixes the order of the sums across torch versions)."""
    if not enabled(deterministic):
        return torch.nn.functional.embedding(indices, weight)
    return index_select(weight, 0, indices.reshape(-1), deterministic=True).view(*indices.shape, weight.shape[1])


def tree_depth(n: int) -> int:
    """Additions on the longest path of the summation tree for a segment of ``n`` values (error-bound helper)."""
    return max(0, math.ceil(math.log2(max(n, 1))))
