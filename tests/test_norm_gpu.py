"""The one-pass Triton kernel of the canonical gradient norm (kernels/norm.py) gives exactly the torch path's value
(GPU only; skipped on CI, which has none).  The torch path is checked against an fp64 reference and for split
invariance in test_engines.py on every CI run."""

from __future__ import annotations

import pytest
import torch
from conftest import GradParts, gpu

pytestmark = gpu


def _both(parts: list[torch.Tensor], monkeypatch) -> tuple[float, float]:
    pytest.importorskip("triton", reason="the kernel needs Triton (installed with CUDA builds of torch)")
    from dettrain.sync.collectives import _limb_kernel, exact_sumsq

    assert _limb_kernel(parts) is not None
    fast = exact_sumsq(parts, 1)
    monkeypatch.setenv("DETTRAIN_NORM_TORCH", "1")
    assert _limb_kernel(parts) is None
    slow = exact_sumsq(parts, 1)
    monkeypatch.delenv("DETTRAIN_NORM_TORCH")
    return fast, slow


def test_kernel_equals_torch_path_bitwise(monkeypatch) -> None:
    g = torch.Generator().manual_seed(0)
    parts = [torch.randn(n, generator=g) * torch.logspace(-9, 3, n) for n in (1, 4095, 4096, 4097, 70_001)]
    parts += [torch.randn((1 << 24) + 5, generator=g), torch.zeros(9), torch.randn(300, 7, generator=g)[:, ::2]]
    parts = [p.cuda() for p in parts]
    fast, slow = _both(parts, monkeypatch)
    assert fast == slow and fast > 0
    # many small tensors (per-parameter gradients, as the DDP and FSDP2 engines hand over) and one of them alone
    many = [torch.randn(int(s), generator=g).cuda() for s in torch.randint(1, 9000, (111,), generator=g)]
    assert _both(many, monkeypatch)[0] == _both(many, monkeypatch)[1]
    assert _both(many[:1], monkeypatch)[0] == _both(many[:1], monkeypatch)[1]


def test_round_half_to_even_and_tiny_values(monkeypatch) -> None:
    """Squares that land exactly halfway between two integers after scaling round to even, as torch.round does;
    squares far below the largest one round to 0 in both paths."""
    # largest 2^25: its square 2^50 sets the unit to 2^-1, so 1.5^2 = 2.25 -> 4.5 units (-> 4), 2.5^2 -> 12.5 (-> 12),
    # 3.5^2 -> 24.5 (-> 24), 0.5^2 -> 0.5 (-> 0), 7.25^2 -> 105.125 (-> 105); 1e-30 and 2^-60 -> 0
    small = [1.5, 2.5, 0.5, 3.5, -7.25, 1e-30, 2.0**-60]
    for big in (2.0**25, 2.0**25 * 1.25, 3.0):
        x = torch.tensor([big, *small], dtype=torch.float32).cuda()
        fast, slow = _both([x], monkeypatch)
        assert fast == slow
    halves = torch.tensor([2.0**25, 1.5, 2.5, 3.5, 0.5], dtype=torch.float32).cuda()
    # exactly: (2^51 + 4 + 12 + 24 + 0) units of 2^-1
    assert _both([halves], monkeypatch)[0] == (2.0**51 + 40) / 2


def test_norm_and_clip_queue_without_a_host_sync() -> None:
    """The canonical norm and the clip run on the device without a host sync (torch's sync debug mode raises on
    one), and the device clip leaves the bits of the host decision."""
    pytest.importorskip("triton", reason="the kernel needs Triton (installed with CUDA builds of torch)")
    from dettrain.sync.collectives import _limb_kernel, canonical_norm

    g = torch.Generator().manual_seed(4)
    grads = [(torch.randn(n, generator=g) * 10).cuda() for n in (4097, 1 << 20, 333)]
    assert _limb_kernel(grads) is not None
    host = GradParts([t.clone() for t in grads])
    host.clip_(1.0, float(canonical_norm(host.parts, 1)))  # the first call also fills the launch caches
    dev = GradParts([t.clone() for t in grads])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        norm = canonical_norm(dev.parts, 1)
        dev.clip_(1.0, norm)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert float(norm) > 1.0
    assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(host.parts, dev.parts))


def test_finish_kernel_equals_the_torch_passes_bitwise(monkeypatch) -> None:
    """kernels.norm.finish_ (-0.0 -> +0.0, times 1/M, and the local max, one launch) gives the bits of torch's two
    in-place passes and the max of |x|, for scales that are and are not powers of two, signed zeros, subnormals,
    products that underflow, infinities and NaN, and queues without a host sync."""
    pytest.importorskip("triton", reason="the kernel needs Triton (installed with CUDA builds of torch)")
    from dettrain.kernels import norm

    g = torch.Generator().manual_seed(5)
    parts = [torch.randn(n, generator=g) * torch.logspace(-30, 30, n) for n in (1, 4095, 4096, 4097, 70_001)]
    parts[2][:7] = torch.tensor([-0.0, 0.0, -1e-45, 1e-45, -3e-39, 2.0**-126, -(2.0**-127)])
    parts.append(torch.full((9,), -0.0))
    for scale in (1.0, 0.25, 1 / 3, 1 / 6, 2.0**-20):
        for extra in (None, float("inf"), float("nan")):
            data = [p.clone() for p in parts]
            if extra is not None:
                data[3][100] = extra
            fast = [p.cuda() for p in data]
            slow = [p.cuda() for p in data]
            assert norm.available()
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                m_fast = norm.finish_(fast, scale)
            finally:
                torch.cuda.set_sync_debug_mode(0)
            monkeypatch.setenv("DETTRAIN_NORM_TORCH", "1")
            m_slow = norm.finish_(slow, scale)
            monkeypatch.delenv("DETTRAIN_NORM_TORCH")
            for a, b, x in zip(fast, slow, data):
                if extra is None or extra == float("inf"):
                    assert torch.equal(a.view(torch.int32), b.view(torch.int32)), (scale, extra)
                else:  # NaN: the same values elsewhere, a NaN at the same place
                    assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a[~a.isnan()], b[~b.isnan()])
                # every zero became +0.0 (a negative product that underflows is -0.0 in both paths, as in torch)
                assert not bool(a[(x == 0).cuda()].signbit().any())
            if extra is not None and extra != extra:
                assert m_fast.isnan().all() and m_slow.isnan().all()
            else:
                assert torch.equal(m_fast, m_slow) and float(m_fast) > 0, (scale, extra)
