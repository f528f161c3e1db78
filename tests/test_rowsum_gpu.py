"""The canonical reduce-scatter's row sum in one pass per eight rows (kernels/rowsum.py) gives exactly the
level-by-level torch tree (GPU only; skipped on CI, which has none).  The kernel's plan (groups of eight, then the
tree over the group results) is checked on the CPU on every CI run (test_collectives.py)."""

from __future__ import annotations

import pytest
import torch
from conftest import gpu

pytestmark = gpu


def _data(n: int, ncols: int, g: torch.Generator) -> torch.Tensor:
    # magnitudes over 16 decades, rows shuffled, so the order of additions shows in the low bits; subnormals and
    # signed zeros in the first columns
    x = torch.randn(n, ncols, generator=g) * torch.logspace(-8, 8, n).unsqueeze(1)[torch.randperm(n, generator=g)]
    if ncols >= 4:
        x[:, 0] = 1e-40 * torch.arange(1, n + 1)
        x[:, 1] = -0.0
        x[: n // 2, 2] = 0.0
        x[n // 2 :, 2] = -0.0
        # column 3: the tree gives (1 + 2^24) + (1 - 2^24) = 1, a left fold ((1 + 2^24) + 1) - 2^24 = 0
        x[:, 3] = 0.0
        if n >= 4:
            x[:4, 3] = torch.tensor([1.0, 2.0**24, 1.0, -(2.0**24)])
    return x.cuda()


def test_kernel_equals_the_torch_tree_bitwise() -> None:
    pytest.importorskip("triton", reason="the kernel needs Triton (installed with CUDA builds of torch)")
    from dettrain.kernels import rowsum
    from dettrain.sync.collectives import tree_sum_rows, tree_sum_rows_into, tree_sum_rows_torch

    g = torch.Generator().manual_seed(0)
    for n in (*range(1, 18), 24, 31, 63, 64, 65, 129):
        for ncols in (1, 1023, 1024, 1025, 70_001):
            x = _data(n, ncols, g)
            assert rowsum.available(x)
            want = tree_sum_rows_torch(x.clone()).clone()
            out = torch.empty(ncols, device="cuda")
            assert tree_sum_rows_into(x.clone(), out) is out
            assert torch.equal(out.view(torch.int32), want.view(torch.int32)), (n, ncols)
            got = tree_sum_rows(x.clone())
            assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (n, ncols)
            if n >= 4 and ncols >= 4:  # the data tells this tree from a left fold: an order slip would be seen
                fold = x[0, 3].clone()
                for r in x[1:, 3]:
                    fold += r
                assert want[3].item() == 1.0 and fold.item() == 0.0
    # rows that are a column slice of a wider tensor (row stride != row length), and a large shard
    for n in (8, 11, 20):
        wide = _data(n, 5000, g)
        x = wide[:, 7:4103]  # the view itself goes in (a clone would be contiguous)
        assert x.stride(0) == 5000 and rowsum.available(x)
        want = tree_sum_rows_torch(x.clone()).clone()
        out = torch.empty(4096, device="cuda")
        assert torch.equal(tree_sum_rows_into(x, out).view(torch.int32), want.view(torch.int32)), n
    big = torch.randn(8, (1 << 25) + 3, device="cuda")
    want = tree_sum_rows_torch(big.clone()).clone()
    assert torch.equal(tree_sum_rows_into(big, torch.empty_like(want)), want)


def test_bf16_rows_are_summed_in_fp32_bitwise() -> None:
    """bf16 rows (FSDP2's reduce-scatter input with ``bf16_rows``) into an fp32 output: the bits of the same tree over
    the rows widened to fp32, for every row count (past eight rows the first pass writes fp32 rows of its own)."""
    pytest.importorskip("triton", reason="the kernel needs Triton (installed with CUDA builds of torch)")
    from dettrain.kernels import rowsum
    from dettrain.sync.collectives import tree_sum_rows_into, tree_sum_rows_torch

    g = torch.Generator().manual_seed(1)
    for n in (1, 2, 3, 5, 7, 8, 9, 15, 16, 17, 64, 65, 129):
        for ncols in (1, 1023, 1025, 70_001):
            x = _data(n, ncols, g).bfloat16()
            assert rowsum.available(x)
            want = tree_sum_rows_torch(x.float()).clone()  # fp32 rows holding the same values
            out = torch.empty(ncols, device="cuda")
            assert tree_sum_rows_into(x.clone(), out) is out
            assert torch.equal(out.view(torch.int32), want.view(torch.int32)), (n, ncols)
            if n >= 2 and ncols >= 1023:  # rows of one magnitude: their sums need more bits than bf16 holds
                y = torch.randn(n, ncols, generator=g).bfloat16().cuda()
                tree_sum_rows_into(y, out)
                assert bool((out != out.bfloat16().float()).any()), (n, ncols)
    # a view with a row stride, as the all_to_all's receive buffer is viewed
    wide = _data(8, 5000, g).bfloat16()
    x = wide[:, 3:4099]
    want = tree_sum_rows_torch(x.float()).clone()
    assert torch.equal(tree_sum_rows_into(x, torch.empty(4096, device="cuda")).view(torch.int32),
                       want.view(torch.int32))
