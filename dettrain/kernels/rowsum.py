"""``collectives.tree_sum_rows_into`` in one pass per eight rows (Triton): the canonical reduce-scatter's sum.

The tree (``collectives.tree_sum_rows``): level s = 1, 2, 4, ... adds row i+s into row i for every i that is a
multiple of 2s with i+s < n.  Its first three levels only ever pair rows of one aligned group of eight,
[8g, 8g+8), and within a group they are the same tree over that group's rows; after them row 8g holds the group's
node.  The levels s >= 8 are then the same tree again over the group nodes (rows 0, 8, 16, ...): j + s/8 < ceil(n/8)
exactly when 8j + s < n.  So the tree over n rows is: sum each group of eight by the small tree, then the tree over
the ceil(n/8) results, and so on until one row is left.

``sum_groups`` is that small tree for every group at once, reading each element once and writing one row per group:
for the 8 rows of FSDP2's reduce-scatter on 8 ranks it reads the input once and writes the output once, where the
level-by-level torch path reads and writes 2.6x as many bytes.  The additions are the same fp32 additions of the
same operands (IEEE addition is commutative and rounds to nearest even in both), so the result is the same bits.
The torch path of ``sum_groups`` runs the level-by-level tree (``tree_sum_rows_torch``, here) on each group:
the decomposition is checked on the CPU against the level-by-level tree, the kernel against the torch path on the
GPU (``tests/test_rowsum_gpu.py``).

bf16 rows (FSDP2's reduce-scatter input when it computes in bf16, engines/fsdp2.py) are summed in fp32 into an fp32
output: every element is widened to fp32 as it is loaded (exact: every bf16 value is an fp32 value), so the
additions are those of the fp32 rows the widened input would be, bit for bit, and the input is read at half the
bytes.  Group results are never written back into bf16 rows: past eight rows the first pass writes fp32 rows.
"""

from __future__ import annotations

import torch

from dettrain.kernels._triton import HAVE_TRITON, tl, triton

GROUP = 8  # rows one program sums (the tree's first three levels)
BLOCK = 1024  # elements of a row per program
NUM_WARPS = 4


ROW_DTYPES = (torch.float32, torch.bfloat16)  # what the kernel reads; it always adds and writes fp32


def available(x: torch.Tensor) -> bool:
    """True when the kernel can take ``x`` (CUDA fp32 or bf16 rows with unit column stride) and Triton is
    importable."""
    return (HAVE_TRITON and x.is_cuda and x.dtype in ROW_DTYPES and x.dim() == 2 and x.stride(1) == 1
            and x.shape[1] > 0)


if HAVE_TRITON:

    @triton.jit
    def _group_tree_kernel(x_ptr, x_row_stride, first_row, out_ptr, out_row_stride, first_out, ncols,
                           R: tl.constexpr, BLOCK: tl.constexpr):
        # program (b, g): columns [b*BLOCK, (b+1)*BLOCK) of rows first_row + R*g + [0, R), summed by the tree's
        # levels 1, 2, 4 in their order, stored to row first_out + g of out (fp32).  Every load is widened to fp32
        # first (a no-op for fp32 rows, exact for bf16 ones), so the additions are always fp32 additions
        b = tl.program_id(0).to(tl.int64)
        g = tl.program_id(1).to(tl.int64)
        cols = b * BLOCK + tl.arange(0, BLOCK)
        m = cols < ncols
        base = x_ptr + (first_row + R * g) * x_row_stride + cols
        s0 = tl.load(base, mask=m).to(tl.float32)
        if R > 1:
            s0 = s0 + tl.load(base + x_row_stride, mask=m).to(tl.float32)  # level 1: row 0 += row 1
        if R > 2:
            s2 = tl.load(base + 2 * x_row_stride, mask=m).to(tl.float32)
            if R > 3:
                s2 = s2 + tl.load(base + 3 * x_row_stride, mask=m).to(tl.float32)  # level 1: row 2 += row 3
            s0 = s0 + s2  # level 2: row 0 += row 2
        if R > 4:
            s4 = tl.load(base + 4 * x_row_stride, mask=m).to(tl.float32)
            if R > 5:
                s4 = s4 + tl.load(base + 5 * x_row_stride, mask=m).to(tl.float32)  # level 1: row 4 += row 5
            if R > 6:
                s6 = tl.load(base + 6 * x_row_stride, mask=m).to(tl.float32)
                if R > 7:
                    s6 = s6 + tl.load(base + 7 * x_row_stride, mask=m).to(tl.float32)  # level 1: row 6 += row 7
                s4 = s4 + s6  # level 2: row 4 += row 6
            s0 = s0 + s4  # level 3: row 0 += row 4
        tl.store(out_ptr + (first_out + g) * out_row_stride + cols, s0, mask=m)


def tree_sum_rows_torch(x: torch.Tensor) -> torch.Tensor:
    """``collectives.tree_sum_rows`` level by level with torch's in-place additions, on any device (the
    definition, which the kernel reproduces); sums the rows of ``x`` in place and returns ``x[0]``."""
    n, s = x.shape[0], 1
    while s < n:
        x[0 : n - s : 2 * s].add_(x[s:n : 2 * s])
        s *= 2
    return x[0]


def _launch(x: torch.Tensor, first: int, rows: int, groups: int, out: torch.Tensor, first_out: int) -> None:
    ncols = x.shape[1]
    grid = (triton.cdiv(ncols, BLOCK), groups)
    with torch.cuda.device(x.device):
        _group_tree_kernel[grid](x, x.stride(0), first, out, out.stride(0), first_out, ncols, R=rows, BLOCK=BLOCK,
                                 num_warps=NUM_WARPS)


def sum_groups(x: torch.Tensor, out: torch.Tensor) -> None:
    """Row g of ``out`` (fp32) = the tree over rows [8g, 8g+8) of ``x`` (the last group may be shorter), added in
    fp32; ``x`` may be clobbered.  ``out`` may be a view of ``x``'s rows 0, 8, 16, ... when both are fp32 (each
    group's result goes to its own first row)."""
    n = x.shape[0]
    full, rest = divmod(n, GROUP)
    if available(x) and available(out) and out.dtype == torch.float32:
        if full:
            _launch(x, 0, GROUP, full, out, 0)
        if rest:
            _launch(x, full * GROUP, rest, 1, out, full)
        return
    for g in range(full + (rest > 0)):
        out[g].copy_(tree_sum_rows_torch(x[g * GROUP : (g + 1) * GROUP].to(torch.float32)))


def tree_sum_rows_into(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out`` (fp32, shape ``x.shape[1:]``) = ``collectives.tree_sum_rows`` of ``x`` widened to fp32, bit for bit,
    for a 2-D ``x`` (fp32 or bf16); ``x`` is clobbered.  Groups of eight rows are summed into their first rows in
    place until eight or fewer are left (bf16 rows: the first pass writes fp32 rows of its own); the last pass
    writes into ``out``."""
    if x.shape[0] == 1 and out.data_ptr() == x.data_ptr():
        return out  # one row, already in place
    if x.dtype != torch.float32 and x.shape[0] > GROUP:  # group sums are fp32: never rounded back into x's rows
        heads = torch.empty(-(-x.shape[0] // GROUP), x.shape[1], dtype=torch.float32, device=x.device)
        sum_groups(x, heads)
        x = heads
    while x.shape[0] > GROUP:
        heads = x[::GROUP]
        sum_groups(x, heads)
        x = heads
    sum_groups(x, out.view(1, -1))
    return out
