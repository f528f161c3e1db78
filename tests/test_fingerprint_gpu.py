"""The Triton fingerprint kernel gives exactly the torch path's values (GPU only; skipped on CI, which has none).

The torch path is the reference: it is checked against the pure-Python definition in test_fingerprint.py on every
CI run, so equality here ties the kernel to the definition too."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import gpu

pytestmark = gpu

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.int16,
          torch.uint8, torch.bool]
# around the kernel's block size (4096), tiny, and large enough for many programs
SIZES = [1, 3, 4095, 4096, 4097, 3 * 4096 + 17, (1 << 20) + 5]
OFFSETS = [0, 1, 4096, 123_456_789, (1 << 40) + 7]


def _fp():
    from dettrain.record import fingerprint as fp

    pytest.importorskip("triton", reason="the Triton kernel needs Triton (installed with CUDA builds of torch)")
    from dettrain.kernels import fingerprint as kernel

    assert kernel.available()
    return fp, kernel


def _rand(dtype: torch.dtype, n: int, gen: torch.Generator) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.rand(n, generator=gen) > 0.5
    if dtype.is_floating_point:
        x = torch.randn(n, generator=gen).to(dtype)
        x[:: max(1, n // 7)] = -0.0  # signed zeros and NaN hash by their bits
        if n > 3:
            x[1] = float("nan")
        return x
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, (n,), generator=gen, dtype=torch.int64).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_equals_torch_path(dtype: torch.dtype) -> None:
    fp, ft = _fp()
    gen = torch.Generator().manual_seed(1)
    for n in SIZES:
        x = _rand(dtype, n, gen)
        xc = x.cuda()
        for off in OFFSETS:
            want = fp.fingerprint_torch(x, off)  # on the CPU
            assert ft.fingerprint(xc, off) == want, (dtype, n, off)
            assert fp.fingerprint(xc, off) == want  # the dispatching entry point takes the kernel
        assert fp.fingerprint_torch(xc, 5) == fp.fingerprint_torch(x, 5)  # torch path: same on both devices


def test_unaligned_and_strided_views() -> None:
    fp, ft = _fp()
    gen = torch.Generator().manual_seed(2)
    base = torch.randn(3 * 4096 + 11, generator=gen)
    bc = base.cuda()
    for a in (1, 2, 3, 5, 4096 + 1):  # data pointers not 16-byte aligned
        assert ft.fingerprint(bc[a:], 77) == fp.fingerprint_torch(base[a:], 77)
    m = torch.randn(300, 70, generator=gen)
    assert ft.fingerprint(m.cuda().t(), 9) == fp.fingerprint_torch(m.t(), 9)  # flattened row-major like torch


def test_segments_one_launch_equal_per_segment_and_shard_sums() -> None:
    fp, ft = _fp()
    gen = torch.Generator().manual_seed(3)
    flat = torch.randn(50_000, generator=gen)
    cuts = sorted(random.Random(0).sample(range(1, 50_000), 40))
    bounds = [0, *cuts, 50_000]
    segs = [(f"t{i}", a, b) for i, (a, b) in enumerate(zip(bounds, bounds[1:]))]
    offset = 1000  # the buffer holds global indices [1000, 51000): segments before/after are partial or absent
    segs_g = [(n, a + offset - 37, b + offset - 37) for n, a, b in segs]
    got = ft.segment_fingerprints(flat.cuda(), offset, segs_g)
    want = fp.segment_fingerprints_torch(flat, offset, segs_g)
    assert got == want and len(got) >= 40
    # shards of the buffer hashed separately combine to the whole (the property the reducer's shards rely on)
    shards = [(0, 12_288), (12_288, 30_000), (30_000, 50_000)]
    parts: dict[str, int] = {}
    for a, b in shards:
        for name, v in ft.segment_fingerprints(flat[a:b].cuda(), offset + a, segs_g).items():
            parts[name] = fp.combine([parts.get(name, 0), v])
    assert parts == want
    # the segments cover global [963, 50963) and the buffer [1000, 51000): together, the overlap's fingerprint
    assert fp.combine(want.values()) == fp.fingerprint_torch(flat[: 50_963 - offset], offset)


def test_fingerprint_many_mixed_widths_one_sync() -> None:
    fp, ft = _fp()
    gen = torch.Generator().manual_seed(4)
    parts = [(_rand(dt, n, gen), off) for dt, n, off in
             [(torch.float32, 5000, 0), (torch.bfloat16, 777, 5000), (torch.float32, 1, 9), (torch.int64, 4097, 3),
              (torch.uint8, 100, 1 << 33), (torch.float32, 0, 4)]]
    want = [fp.fingerprint_torch(t, off) for t, off in parts]
    assert ft.fingerprint_many([(t.cuda(), off) for t, off in parts]) == want
    assert fp.fingerprint_many([(t.cuda(), off) for t, off in parts]) == want


def test_one_flipped_bit_changes_the_value() -> None:
    _, ft = _fp()
    x = torch.randn(1 << 16, device="cuda")
    v0 = ft.fingerprint(x)
    for i, bit in ((0, 0), (12345, 31), ((1 << 16) - 1, 7)):
        y = x.clone().view(torch.int32)
        y[i] ^= 1 << bit if bit < 31 else -(1 << 31)
        assert ft.fingerprint(y.view(torch.float32)) != v0


def test_deferred_values_and_cached_launch_metadata() -> None:
    """fingerprint_many_deferred + resolve_all give the torch path's values; the launch metadata cached by address
    follows in-place updates of the same tensors (a step's parameters), survives tensors freed and reallocated
    at the same address with other contents, and non-contiguous parts still go through a copy."""
    fp, ft = _fp()
    gen = torch.Generator().manual_seed(5)
    base = [(_rand(dt, n, gen), off) for dt, n, off in
            [(torch.float32, 5000, 0), (torch.bfloat16, 777, 5000), (torch.int64, 4097, 3)]]
    dev = [(t.cuda(), off) for t, off in base]
    d1 = fp.fingerprint_many_deferred(dev)
    for t, _ in dev:  # queued before these writes: the values are of the old contents
        t.zero_()
    d2 = fp.fingerprint_many_deferred(dev)  # same addresses: the cached metadata, the new (zeroed) contents
    strided = torch.randn(64, 33, generator=gen)[:, 1:]
    d3 = fp.fingerprint_many_deferred([(strided.cuda().t(), 7)])
    v1, v2, v3 = fp.resolve_all([d1, d2, d3])
    assert v1 == [fp.fingerprint_torch(t, off) for t, off in base]
    assert v2 == [fp.fingerprint_torch(t.cpu(), off) for t, off in dev]
    assert v3 == [fp.fingerprint_torch(strided.t(), 7)]
    assert v1 != v2
    # free and reallocate: a new tensor of the same size at (usually) the same address, other contents
    x = torch.randn(1 << 16, device="cuda")
    a = fp.fingerprint_many_deferred([(x, 11)]).values()
    ptr = x.data_ptr()
    del x
    y = torch.randn(1 << 16, device="cuda") + 1.0
    b = fp.fingerprint_many_deferred([(y, 11)]).values()
    assert b == [fp.fingerprint_torch(y.cpu(), 11)] and (y.data_ptr() != ptr or a != b)
