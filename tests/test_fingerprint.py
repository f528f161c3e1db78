"""fp(T): one flipped bit changes it; shards combine exactly; equals an independent pure-Python reference."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

from dettrain.record.fingerprint import combine, fingerprint, format_fp, segment_fingerprints

M64 = (1 << 64) - 1


def py_fp(raw: list[int], width: int, offset: int = 0) -> int:
    """Pure-Python fingerprint of raw bit patterns, written from the definition in dettrain/record/fingerprint.py."""
    total = 0
    for i, v in enumerate(raw):
        z = (v & ((1 << width) - 1)) ^ (((offset + i) * 0x9E3779B97F4A7C15) & M64)
        z ^= z >> 30
        z = (z * 0xBF58476D1CE4E5B9) & M64
        z ^= z >> 27
        z = (z * 0x94D049BB133111EB) & M64
        z ^= z >> 31
        total = (total + z) & M64
    return total


def raw_bits(t: torch.Tensor) -> tuple[list[int], int]:
    """Bit patterns via struct/Python ints (not torch views), and the width."""
    vals = t.reshape(-1).tolist()
    if t.dtype == torch.float32:
        return [struct.unpack("<I", struct.pack("<f", v))[0] for v in vals], 32
    if t.dtype == torch.float64:
        return [struct.unpack("<Q", struct.pack("<d", v))[0] for v in vals], 64
    if t.dtype == torch.float16:
        return [struct.unpack("<H", struct.pack("<e", v))[0] for v in vals], 16
    if t.dtype == torch.bfloat16:  # bf16 = top 16 bits of the fp32 with the same value (exactly representable)
        return [struct.unpack("<I", struct.pack("<f", v))[0] >> 16 for v in vals], 16
    if t.dtype in (torch.int64, torch.int32, torch.int16):
        width = {torch.int64: 64, torch.int32: 32, torch.int16: 16}[t.dtype]
        return [v & ((1 << width) - 1) for v in vals], width
    if t.dtype in (torch.uint8, torch.bool):
        return [int(v) for v in vals], 8
    raise TypeError(t.dtype)


def sample(dtype: torch.dtype, n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        x = torch.randn(n, generator=g, dtype=torch.float64) * 3
        x[::7] = -x[::7]
        return x.to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    hi = {torch.uint8: 256, torch.int16: 2**15, torch.int32: 2**31, torch.int64: 2**62}[dtype]
    return torch.randint(-hi if dtype != torch.uint8 else 0, hi, (n,), generator=g, dtype=torch.int64).to(dtype)


DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.int16,
          torch.uint8, torch.bool]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_pure_python_reference(dtype):
    x = sample(dtype, 257)
    raw, width = raw_bits(x)
    for off in (0, 1, 12345, 2**40 + 3):
        assert fingerprint(x, off) == py_fp(raw, width, off)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64], ids=str)
def test_any_single_bit_flip_changes_it(dtype):
    x = sample(dtype, 64, seed=1)
    base = fingerprint(x)
    width = x.element_size() * 8
    iview = {8: torch.uint8, 16: torch.int16, 32: torch.int32, 64: torch.int64}[width]
    seen = set()
    for i in range(x.numel()):
        for bit in range(width):
            y = x.clone()
            yi = y.view(iview)
            mask = torch.tensor(1 << bit if bit < width - 1 else -(1 << bit), dtype=torch.int64).to(iview)
            yi[i] ^= mask
            f = fingerprint(y)
            assert f != base, (i, bit)
            seen.add(f)
    assert len(seen) == x.numel() * width  # and no two flips collide


def test_shards_of_any_split_combine_to_the_whole():
    x = sample(torch.float32, 10_000, seed=2)
    whole = fingerprint(x, 77)
    g = torch.Generator().manual_seed(3)
    for _ in range(20):
        cuts = sorted(torch.randint(0, x.numel(), (int(torch.randint(1, 8, (1,), generator=g)),),
                                    generator=g).tolist())
        bounds = [0, *cuts, x.numel()]
        parts = [fingerprint(x[a:b], 77 + a) for a, b in zip(bounds, bounds[1:])]
        assert combine(parts) == whole
    # the shape does not matter, only the flat order
    assert fingerprint(x.view(100, 100), 77) == whole


def test_order_and_position_matter():
    x = sample(torch.float32, 100, seed=4)
    y = x.clone()
    y[[3, 40]] = y[[40, 3]]
    assert fingerprint(x) != fingerprint(y)
    assert fingerprint(x, 0) != fingerprint(x, 1)


def test_segments_partition_the_total():
    x = sample(torch.float32, 5000, seed=5)
    segs = [("a", 0, 1000), ("b", 1000, 3500), ("c", 3500, 5000)]
    # a holder of [800, 4000) sees parts of every segment
    held = segment_fingerprints(x[800:4000], 800, segs)
    rest = segment_fingerprints(x[:800], 0, segs), segment_fingerprints(x[4000:], 4000, segs)
    for name, a, b in segs:
        total = combine([held.get(name, 0), rest[0].get(name, 0), rest[1].get(name, 0)])
        assert total == fingerprint(x[a:b], a)
    assert format_fp(fingerprint(x)) == format_fp(combine(fingerprint(x[a:b], a) for _, a, b in segs))


def test_does_not_modify_input():
    x = torch.arange(100, dtype=torch.int64)
    fingerprint(x)
    assert torch.equal(x, torch.arange(100, dtype=torch.int64))


# ---- the multi-chunk path: tensors longer than one pass of the loop, split anywhere -----------------------------
def np_fp(raw: np.ndarray, offset: int = 0) -> int:
    """The definition again, vectorised in numpy uint64 (wrapping arithmetic), for inputs too long for py_fp."""
    u = np.uint64
    z = raw.astype(np.uint64) ^ (np.arange(offset, offset + raw.size, dtype=np.uint64) * u(0x9E3779B97F4A7C15))
    z ^= z >> u(30)
    z *= u(0xBF58476D1CE4E5B9)
    z ^= z >> u(27)
    z *= u(0x94D049BB133111EB)
    z ^= z >> u(31)
    return int(z.sum(dtype=np.uint64))


def random_cuts(n: int, k: int, g: torch.Generator, must: tuple[int, ...] = ()) -> list[int]:
    cuts = set(torch.randint(1, n, (k,), generator=g).tolist()) | {c for c in must if 0 < c < n}
    return [0, *sorted(cuts), n]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_many_chunks_match_the_pure_python_reference(monkeypatch, dtype):
    """With the loop's chunk cut to 61 elements, a 1000-element tensor takes 17 passes (the last one partial): the
    result equals the pure-Python definition at several offsets, and any split combines to it."""
    import dettrain.record.fingerprint as fpm

    monkeypatch.setattr(fpm, "CHUNK", 61)
    x = sample(dtype, 1000, seed=6)
    raw, width = raw_bits(x)
    g = torch.Generator().manual_seed(7)
    for off in (0, 5, 2**33 + 1):
        whole = py_fp(raw, width, off)
        assert fpm.fingerprint(x, off) == whole
        for _ in range(5):
            b = random_cuts(x.numel(), 4, g, must=(61, 122, 60))
            assert combine(fpm.fingerprint(x[p:q], off + p) for p, q in zip(b, b[1:])) == whole
    # segments that span chunks, held in two pieces split inside a chunk
    segs = [("a", 0, 200), ("b", 200, 777), ("c", 777, 1000)]
    held = [fpm.segment_fingerprints(x[:333], 0, segs), fpm.segment_fingerprints(x[333:], 333, segs)]
    for name, a, b in segs:
        assert combine(h.get(name, 0) for h in held) == py_fp(raw[a:b], width, a)


def test_tensors_longer_than_the_real_chunk():
    """The real chunk size (2^22 elements): a tensor of 2 chunks and a bit, against the numpy form of the
    definition (itself checked against the pure-Python one), and split at random points and at chunk edges."""
    from dettrain.record.fingerprint import CHUNK

    small = sample(torch.float32, 300, seed=8)
    raw, width = raw_bits(small)
    assert np_fp(small.numpy().view(np.uint32), 99) == py_fp(raw, width, 99)  # the two references agree
    n = 2 * CHUNK + 12345
    x = sample(torch.float32, n, seed=9)
    whole = np_fp(x.numpy().view(np.uint32), 7)
    assert fingerprint(x, 7) == whole
    g = torch.Generator().manual_seed(10)
    for _ in range(3):
        b = random_cuts(n, 3, g, must=(CHUNK - 1, CHUNK + 1, 2 * CHUNK))
        assert combine(fingerprint(x[p:q], 7 + p) for p, q in zip(b, b[1:])) == whole
    y = x.clone()
    y[CHUNK + 3] = -y[CHUNK + 3]  # one sign bit in the second chunk
    assert fingerprint(y, 7) != whole
