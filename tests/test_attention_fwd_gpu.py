"""The attention forward through cuDNN (kernels/attention.py ``cudnn_forward``: outside batch-invariant mode, head
size 64 or 128, Hopper; GQA included) on the GPU: its output is the bits of torch's own cuDNN attention, it reruns
bitwise under torch's deterministic mode, also in a fresh process, dettrain's backward on its output and
log-sum-exp is as accurate as on the Triton forward's, and every other call keeps the Triton forward."""

from __future__ import annotations

import hashlib
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import REPO, gpu

from dettrain.kernels import attention as kernel
from dettrain.kernels import batch_invariant

pytestmark = gpu

# (B, H, HKV, T, D): MHA and GQA (the 1b model's 32/4 among them); 300: no block divides it
SHAPES = [(2, 8, 8, 512, 64), (1, 4, 4, 1024, 128), (3, 12, 12, 300, 64), (2, 32, 4, 512, 64), (1, 8, 2, 300, 128)]


def _qkv(B: int, H: int, HKV: int, T: int, D: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(B, n, T, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
               for n in (H, HKV, HKV))
    do = torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16, generator=g)
    return q, k, v, do


def _cudnn_here() -> None:
    if not kernel._cudnn_fwd_device(torch.cuda.current_device()):
        pytest.skip("cuDNN's forward is used on Hopper GPUs with cuDNN >= 9 only")


def _run(q, k, v, do, scale=None):
    o = kernel.attention(q, k, v, scale)
    return [o.detach(), *torch.autograd.grad(o, (q, k, v), do)]


@pytest.mark.parametrize("B,H,HKV,T,D", SHAPES)
def test_the_forward_is_torchs_cudnn_attention_bitwise(B, H, HKV, T, D):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    _cudnn_here()
    q, k, v, _ = _qkv(B, H, HKV, T, D)
    assert kernel.cudnn_forward(q, k)
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        want = F.scaled_dot_product_attention(q.detach(), k.detach(), v.detach(), is_causal=True,
                                              enable_gqa=H != HKV)
    assert torch.equal(kernel.attention(q, k, v).detach(), want)
    # HF's scaling=D**-0.5 gives the bits of the default 1/sqrt(D)
    assert torch.equal(kernel.attention(q, k, v, D ** -0.5).detach(), want)


@pytest.mark.parametrize("B,H,HKV,T,D", SHAPES)
def test_reruns_bitwise_and_the_backward_is_as_accurate(B, H, HKV, T, D, monkeypatch):
    _cudnn_here()
    q, k, v, do = _qkv(B, H, HKV, T, D, seed=1)
    torch.use_deterministic_algorithms(True)
    try:
        runs = [_run(q, k, v, do) for _ in range(5)]
    finally:
        torch.use_deterministic_algorithms(False)
    for r in runs[1:]:
        for a, b in zip(runs[0], r):
            assert torch.equal(a, b)
    q64, k64, v64, do64 = (t.detach().double() for t in (q, k, v, do))
    o64, lse64 = kernel._attn_fwd_ref(q64, k64, v64)
    ref = kernel._attn_bwd_ref(q64, k64, v64, o64, lse64, do64)
    monkeypatch.setenv("DETTRAIN_ATTN_FWD", "triton")
    assert not kernel.cudnn_forward(q, k)
    triton_fwd = _run(q, k, v, do)
    o_err, o_err_base = (float((t.double() - o64).norm() / o64.norm()) for t in (runs[0][0], triton_fwd[0]))
    assert o_err < 1e-2 and o_err < 1.1 * o_err_base + 1e-4, (o_err, o_err_base)
    for got, base, r in zip(runs[0][1:], triton_fwd[1:], ref):
        err, err_base = (float((t.double() - r).norm() / r.norm()) for t in (got, base))
        assert err < 1e-2 and err < 1.1 * err_base + 1e-4, (err, err_base)


_FRESH = r"""
import hashlib, torch
from dettrain.kernels import attention as kernel
g = torch.Generator(device="cuda").manual_seed(2)
q, k, v, do = (torch.randn(2, 8, 777, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
q, k, v = (t.requires_grad_() for t in (q, k, v))
assert kernel.cudnn_forward(q, k)
torch.use_deterministic_algorithms(True)
o = kernel.attention(q, k, v)
outs = [o.detach(), *torch.autograd.grad(o, (q, k, v), do)]
print(hashlib.sha256(b"".join(t.float().cpu().numpy().tobytes() for t in outs)).hexdigest())
"""


def test_a_fresh_process_gives_the_same_bits():
    """cuDNN chooses its plan per process: two processes must compute the same output and gradients."""
    _cudnn_here()
    digests = []
    for _ in range(2):
        p = subprocess.run([sys.executable, "-c", _FRESH], cwd=REPO, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr[-2000:]
        digests.append(p.stdout.split()[-1])
    assert digests[0] == digests[1] and len(digests[0]) == len(hashlib.sha256().hexdigest())


def test_every_other_call_keeps_the_triton_forward(monkeypatch):
    q, k, v, _ = _qkv(1, 8, 8, 128, 64)
    _cudnn_here()
    assert kernel.cudnn_forward(q, k)
    s32, k32, _, _ = _qkv(1, 8, 8, 128, 32)
    assert not kernel.cudnn_forward(s32, k32)  # head size 32
    assert not kernel.cudnn_forward(q.float(), k.float())  # fp32
    batch_invariant.set_enabled(True)
    try:
        assert not kernel.cudnn_forward(q, k)  # batch invariance is the Triton forward's promise
    finally:
        batch_invariant.set_enabled(False)
    monkeypatch.setenv("DETTRAIN_ATTN_FWD", "triton")
    assert not kernel.cudnn_forward(q, k)
