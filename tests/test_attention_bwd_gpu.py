"""The attention backward that stores dS (kernels/attention.py: the dK/dV pass writes it, ``_attn_bwd_dq_ds_kernel``
sums dS K over the key blocks in order) on the GPU: the same bits on every rerun, dK and dV bitwise those of the
two-pass backward (the dK/dV pass's arithmetic is unchanged), dQ as close to a float64 reference as the two-pass
kernel's (its products are grouped differently, so its bits may differ), and a sample's gradients do not depend on
the rest of the batch."""

from __future__ import annotations

import pytest
import torch
from conftest import gpu

from dettrain.kernels import attention as kernel

pytestmark = gpu


@pytest.fixture(autouse=True)
def triton_forward(monkeypatch):
    """These tests are of the backward kernels, on the Triton forward's output (batch invariance among them, which
    is the Triton forward's promise; cuDNN's forward has tests of its own, test_attention_fwd_gpu.py)."""
    monkeypatch.setenv("DETTRAIN_ATTN_FWD", "triton")


def _inputs(B: int, H: int, HKV: int, T: int, D: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(B, n, T, D, device="cuda", dtype=torch.bfloat16, generator=g) for n in (H, HKV, HKV))
    do = torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16, generator=g)
    return q, k, v, do


def _backward(q, k, v, do, blocks: dict | None = None, scale: float | None = None):
    """dQ, dK, dV through the op's autograd (the kernel's own routing: padding, scale), with ``blocks`` as the
    block override (None: the library's choice)."""
    kernel.ATTN_BLOCK_OVERRIDE = blocks
    try:
        ins = [t.detach().requires_grad_() for t in (q, k, v)]
        o = kernel.attention(*ins, scale)
        return torch.autograd.grad(o, ins, do)
    finally:
        kernel.ATTN_BLOCK_OVERRIDE = None


def _ds_blocks(D: int, G: int) -> dict:
    """The library's blocks with dS stored (the default with GQA and at head size 128; forced here otherwise)."""
    return {**kernel._attn_blocks(kernel.padded_head_size(D), G), "ds": True}


def _two_pass_blocks(D: int, G: int) -> dict:
    """The backward as it was before dS was stored: dQ recomputes S, P and dP, with its own block sizes."""
    return kernel._attn_blocks_two_pass(kernel.padded_head_size(D), G)


def _rel_err(got, ref) -> list[float]:
    return [float((a.double() - r).norm() / r.norm()) for a, r in zip(got, ref)]


def _reference(q, k, v, do, scale: float | None):
    """float64 dQ, dK, dV: dettrain's reference math (kernels/attention.py ``_attn_bwd_ref``) on float64 copies."""
    q64, k64, v64, do64 = (t.double() for t in (q, k, v, do))
    s = None if scale is None else scale
    o, lse = kernel._attn_fwd_ref(q64, k64, v64, s)
    return kernel._attn_bwd_ref(q64, k64, v64, o, lse.double(), do64, s)


SHAPES = [
    (2, 4, 4, 256, 64, None),
    (2, 8, 2, 333, 64, None),      # GQA, a length that no block divides
    (1, 4, 1, 200, 128, 0.1),      # MQA, an explicit scale
    (2, 4, 4, 128, 16, None),
    (1, 4, 2, 96, 32, None),
    (2, 4, 2, 160, 80, None),      # padded to 128
]


@pytest.mark.parametrize("B,H,HKV,T,D,scale", SHAPES)
def test_ds_backward_reruns_bitwise_matches_two_pass_dk_dv_and_float64(B, H, HKV, T, D, scale):
    q, k, v, do = _inputs(B, H, HKV, T, D, seed=D + T)
    G = H // HKV
    runs = [_backward(q, k, v, do, _ds_blocks(D, G), scale) for _ in range(5)]
    for r in runs[1:]:
        for a, b in zip(runs[0], r):
            assert torch.equal(a, b)
    two = _backward(q, k, v, do, {**_ds_blocks(D, G), "ds": False}, scale)  # the same dK/dV blocks
    assert torch.equal(runs[0][1], two[1]) and torch.equal(runs[0][2], two[2])
    ref = _reference(q, k, v, do, scale)
    err, err_two = _rel_err(runs[0], ref), _rel_err(two, ref)
    assert err[0] < 1e-2 and err[0] <= 1.5 * err_two[0] + 1e-4, (err, err_two)


@pytest.mark.parametrize("B,H,HKV,T,D,scale", SHAPES)
def test_ds_backward_gives_the_bits_of_the_two_pass_backward(B, H, HKV, T, D, scale):
    # dS read back is the 16-bit value the two-pass dQ kernel recomputes, and dQ's products over the key blocks
    # chain in the same order, so the previous kernel's dQ, dK and dV come out (with its own block sizes)
    q, k, v, do = _inputs(B, H, HKV, T, D, seed=D + T + 1)
    G = H // HKV
    new, old = _backward(q, k, v, do, _ds_blocks(D, G), scale), _backward(q, k, v, do, _two_pass_blocks(D, G), scale)
    for a, b in zip(new, old):
        assert torch.equal(a, b)


@pytest.mark.parametrize("H,HKV,D", [(8, 8, 64), (8, 2, 64), (4, 4, 128)])
def test_ds_backward_is_batch_invariant(H, HKV, D):
    q, k, v, do = _inputs(6, H, HKV, 320, D, seed=7)
    full = _backward(q, k, v, do, _ds_blocks(D, H // HKV))
    for lo, hi in ((0, 1), (2, 5)):
        part = _backward(q[lo:hi], k[lo:hi], v[lo:hi], do[lo:hi], _ds_blocks(D, H // HKV))
        for a, b in zip(part, full):
            assert torch.equal(a, b[lo:hi])


def test_ds_backward_reruns_bitwise_at_a_training_shape():
    # the 1b model's attention (GQA 16/4, T 2048) at batch 8: a 0.5 GiB dS buffer, 8 x 4 x 32 dK/dV programs and
    # 8 x 16 x 32 dQ programs; the library's blocks, default scale
    q, k, v, do = _inputs(8, 16, 4, 2048, 64, seed=11)
    runs = [_backward(q, k, v, do) for _ in range(3)]
    for r in runs[1:]:
        for a, b in zip(runs[0], r):
            assert torch.equal(a, b)
    ref = _reference(q[:1], k[:1], v[:1], do[:1], None)
    assert max(_rel_err([g[:1] for g in runs[0]], ref)) < 1e-2


def test_ds_backward_past_its_memory_cap_recomputes_with_the_same_bits(monkeypatch):
    # head size 128 stores dS by default; with the cap at 0 bytes the dQ pass recomputes it instead
    q, k, v, do = _inputs(2, 8, 4, 384, 128, seed=5)
    stored = _backward(q, k, v, do)
    monkeypatch.setattr(kernel, "DS_MAX_BYTES", 0)
    recomputed = _backward(q, k, v, do)
    for a, b in zip(stored, recomputed):
        assert torch.equal(a, b)


def test_ds_backward_in_slices_gives_the_bits_of_one_launch(monkeypatch):
    # past DS_MAX_BYTES the dS backward runs slice by slice (whole samples, or kv-head groups of one sample) with
    # one reused buffer; each program's arithmetic is its own (batch, head, block)'s, so the bits do not move
    B, H, HKV, T, D = 3, 8, 4, 384, 128
    q, k, v, do = _inputs(B, H, HKV, T, D, seed=9)
    whole = _backward(q, k, v, do)
    kv_bytes = (H // HKV) * kernel._ds_per_head(T, kernel._attn_blocks(D, H // HKV)["dkdv"][1]) * 2
    for cap in (2 * HKV * kv_bytes, HKV * kv_bytes - 1, kv_bytes, kv_bytes - 1):  # 2 samples, 3 / 1 kv heads, none
        monkeypatch.setattr(kernel, "DS_MAX_BYTES", cap)
        for a, b in zip(whole, _backward(q, k, v, do)):
            assert torch.equal(a, b), cap


@pytest.mark.parametrize("B,H,HKV,T,D,ds", [(3, 8, 2, 333, 64, False), (2, 4, 4, 256, 64, True),
                                             (2, 8, 8, 300, 128, True), (2, 8, 4, 256, 128, False)])
def test_launch_order_changes_no_bit(B, H, HKV, T, D, ds):
    # the grid puts the block on its slow axis by default (every head's longest program starts first); the order
    # before ("per-head": the block on the fast axis) must give the forward's output and log-sum-exp and all
    # three gradients bit for bit, with dS stored and recomputed; a second run of each order catches a kernel
    # that reads the wrong program ids only on some launches
    q, k, v, do = _inputs(B, H, HKV, T, D, seed=T + D)
    blocks = {**kernel._attn_blocks(D, H // HKV), "ds": ds}
    outs = {}
    for order in ("longest-first", "per-head", "longest-first"):
        cfg = {**blocks, "launch": order}
        kernel.ATTN_BLOCK_OVERRIDE = cfg
        try:
            o, lse = kernel._attn_fwd_cuda(q, k, v)
        finally:
            kernel.ATTN_BLOCK_OVERRIDE = None
        grads = _backward(q, k, v, do, cfg)
        outs.setdefault(order, []).append((o, lse, *grads))
    first = outs["longest-first"][0]
    for run in (outs["longest-first"][1], outs["per-head"][0]):
        for a, b in zip(first, run):
            assert torch.equal(a, b)


@pytest.mark.parametrize("B,H,HKV,T,D,scale", [x for x in SHAPES if x[1] > x[2]])  # the GQA shapes
def test_split_dk_dv_pass_reruns_bitwise_is_batch_invariant_and_as_accurate(B, H, HKV, T, D, scale):
    # the dK/dV pass with each GQA group's query heads split over programs (``kv_split``; partial sums in fp32,
    # added in group order by _attn_bwd_kv_sum_kernel): the same bits on every rerun, a sample's gradients those of
    # the sample alone, dK and dV as close to float64 as the unsplit pass's, dQ the unsplit pass's bits (its pass
    # does not change)
    q, k, v, do = _inputs(B, H, HKV, T, D, seed=T + D + 2)
    G = H // HKV
    lib = kernel._attn_blocks(kernel.padded_head_size(D), G)
    ref = _reference(q, k, v, do, scale)
    whole = _backward(q, k, v, do, {**lib, "split": 1}, scale)
    for split in sorted({2, G}):
        cfg = {**lib, "split": split}
        runs = [_backward(q, k, v, do, cfg, scale) for _ in range(3)]
        for r in runs[1:]:
            for a, b in zip(runs[0], r):
                assert torch.equal(a, b), split
        assert torch.equal(runs[0][0], whole[0]), split
        err, err_whole = _rel_err(runs[0], ref), _rel_err(whole, ref)
        for i in (1, 2):
            assert err[i] < 1e-2 and err[i] <= 1.5 * err_whole[i] + 1e-4, (split, err, err_whole)
        one = _backward(q[-1:], k[-1:], v[-1:], do[-1:], cfg, scale)
        for a, b in zip(one, runs[0]):
            assert torch.equal(a, b[-1:]), split
