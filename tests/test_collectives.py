"""Tiers 3-4: the canonical reducer, its invariances, and the control that shows DDP's bits move with world size."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import REPO, step_fields, train

from dettrain.sync.accumulate import BinaryCounter
from dettrain.sync.collectives import tree_sum_rows, tree_sum_rows_into
from dettrain.sync.offload import HostCounter, HostLevels

sys.path.insert(0, str(REPO / "tests"))
from reducer_worker import Toy, known_grad  # noqa: E402


# ---- an independent plain-Python/numpy implementation of the same trees ------------------------------------
def py_tree(xs: list[np.ndarray]) -> np.ndarray:
    """Balanced binary tree by recursive halving (for power-of-two counts); fp32 elementwise adds in numpy."""
    if len(xs) == 1:
        return xs[0]
    h = len(xs) // 2
    return (py_tree(xs[:h]) + py_tree(xs[h:])).astype(np.float32)


def py_fold(xs: list[np.ndarray]) -> np.ndarray:
    acc = xs[0]
    for x in xs[1:]:
        acc = (acc + x).astype(np.float32)
    return acc


def test_tree_sum_rows_is_the_balanced_tree():
    g = torch.Generator().manual_seed(0)
    for n in (1, 2, 4, 8, 16):
        x = torch.randn(n, 1000, generator=g) * torch.logspace(-3, 3, n).unsqueeze(1)
        want = py_tree([r.numpy().copy() for r in x])
        got = tree_sum_rows(x.clone())
        assert np.array_equal(got.numpy(), want)
        # zero rows appended (padding) never change it
        padded = torch.cat([x, torch.zeros(3, 1000)])
        assert torch.equal(tree_sum_rows(padded), got)
    # the variant that writes the last addition into another tensor: the same bits for every row count
    for n in range(1, 10):
        x = torch.randn(n, 1000, generator=g) * torch.logspace(-3, 3, n).unsqueeze(1)
        out = torch.empty(1000)
        assert tree_sum_rows_into(x.clone(), out) is out
        assert np.array_equal(out.numpy(), tree_sum_rows(x.clone()).numpy()), n


def test_rowsum_groups_of_eight_are_the_same_tree():
    """kernels/rowsum.py's plan (each aligned group of eight rows by the small tree, then the tree over the group
    results) equals the level-by-level tree for every row count; on CPU it runs its torch path, the GPU test checks
    the Triton kernel against that path."""
    from dettrain.kernels import rowsum
    from dettrain.sync.collectives import tree_sum_rows_torch

    g = torch.Generator().manual_seed(2)
    differs = 0
    for n in (*range(1, 20), 24, 31, 63, 64, 65, 72, 100):
        x = torch.randn(n, 37, generator=g) * torch.logspace(-4, 4, n).unsqueeze(1)[torch.randperm(n, generator=g)]
        want = tree_sum_rows_torch(x.clone()).clone()
        out = torch.empty(37)
        assert rowsum.tree_sum_rows_into(x.clone(), out) is out
        assert torch.equal(out, want), n
        inplace = x.clone()
        rowsum.tree_sum_rows_into(inplace, inplace[0])
        assert torch.equal(inplace[0], want), n
        differs += not torch.equal(want, torch.from_numpy(np.stack(list(x.numpy())).cumsum(0, dtype=np.float32)[-1]))
    assert differs > 10  # the data tells the tree from a left fold, so an order slip would be seen


def test_binary_counter_builds_the_same_tree():
    g = torch.Generator().manual_seed(1)
    leaves = [torch.randn(513, generator=g) * 10**i for i in range(8)]
    want = py_tree([x.numpy() for x in leaves])
    c = BinaryCounter()
    released = []
    for x in leaves[:-1]:
        c.push(x.clone(), release=released.append)
    out = leaves[-1].clone()
    c.finish_(out, slice(0, 200))
    c.finish_(out, slice(200, 513))  # slices finish independently
    assert np.array_equal(out.numpy(), want)
    assert len(released) == 4 and len(c.stack) == 3  # 7 leaves = subtrees of 4, 2 and 1 after 4 merges
    # subtrees pushed at level 1 (pairs already summed) give the same tree
    c = BinaryCounter()
    pairs = [leaves[i] + leaves[i + 1] for i in range(0, 8, 2)]
    for x in pairs[:-1]:
        c.push(x.clone(), level=1)
    out = pairs[-1].clone()
    c.finish_(out, slice(None))
    assert np.array_equal(out.numpy(), want)


@pytest.mark.parametrize(("rounds", "level"), [(2, 0), (8, 0), (16, 0), (8, 1)])
def test_host_counter_builds_the_same_tree(rounds, level):
    """The FSDP2 engine's counters with every entry in host memory (``HostCounter``, dist.offload_partials): per
    parameter shard, the balanced tree over the rounds, as the numpy tree computes it; the host holds one entry per
    level, and every push reads back exactly the entries it merges with (what ``expect`` stages ahead)."""
    g = torch.Generator().manual_seed(2)
    sizes = [513, 0, 37, 1000]  # a rank may hold no rows of a small parameter
    leaves = [[torch.randn(n, generator=g) * 10 ** (r % 7 - 3) for n in sizes] for r in range(rounds)]
    host = HostLevels(sizes, torch.device("cpu"))
    counters = [HostCounter(host, i) for i in range(len(sizes))]
    for r in range(rounds - 1):
        wanted = [(i, lv) for i, c in enumerate(counters) for lv in c.reads(level)]
        before = host.copied_in
        host.expect(wanted)
        for i, c in enumerate(counters):
            c.push(leaves[r][i].clone().view(-1, 1) if sizes[i] else leaves[r][i].clone(), level)
        assert host.copied_in - before == 4 * sum(sizes[i] for i, _ in wanted)  # nothing read twice or unasked
    # rounds - 1 pushes leave one entry per set bit of rounds - 1 = 0b11..1: levels level ... level + log2(rounds) - 1
    used = list(range(level, level + (rounds - 1).bit_length()))
    assert sorted(host.levels) == used and host.host_bytes == len(used) * 4 * sum(sizes)
    for i, c in enumerate(counters):
        assert c.reads(None) == used  # the finish reads every entry, innermost (the latest, lowest) first
        out = leaves[-1][i].clone()
        c.finish_(out)
        want = py_tree([leaves[r][i].numpy() for r in range(rounds)]) if sizes[i] else np.zeros(0, np.float32)
        assert np.array_equal(out.numpy(), want), i
        assert c.levels == []
    if rounds > 2:  # the data tells the tree from a left fold
        assert not np.array_equal(py_tree([leaves[r][0].numpy() for r in range(rounds)]),
                                  py_fold([leaves[r][0].numpy() for r in range(rounds)]))


def test_offload_streams_setting_is_checked(monkeypatch):
    """DETTRAIN_OFFLOAD_STREAMS picks one side stream for the host copies (1) or one per direction (unset, 2); any
    other value is refused when the host levels are built, naming the variable and the values it takes."""
    from dettrain.errors import UserError

    cpu = torch.device("cpu")
    monkeypatch.delenv("DETTRAIN_OFFLOAD_STREAMS", raising=False)
    assert HostLevels([4], cpu).copies.streams == 2
    monkeypatch.setenv("DETTRAIN_OFFLOAD_STREAMS", "1")
    assert HostLevels([4], cpu).copies.streams == 1
    assert HostLevels([4], cpu, streams=2).copies.streams == 2  # an explicit argument wins
    for bad in ("3", "two", ""):
        monkeypatch.setenv("DETTRAIN_OFFLOAD_STREAMS", bad)
        with pytest.raises(UserError, match=r"DETTRAIN_OFFLOAD_STREAMS=.* must be 1 .* or 2"):
            HostLevels([4], cpu)


def run_reducer(tmp_path, world: int, tier: int, M: int, bucket_mb: float, shard: bool, offload: bool = False,
                steps: int = 1) -> dict:
    out = tmp_path / f"red_{world}_{tier}_{M}_{bucket_mb}_{int(shard)}_{int(offload)}.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
           str(REPO / "tests" / "reducer_worker.py"), str(out), str(tier), str(M), str(bucket_mb), str(int(shard)),
           str(int(offload)), str(steps)]
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-4000:]
    return torch.load(out, weights_only=True)


@pytest.mark.parametrize("world,tier,M,bucket_mb,shard", [
    (4, 4, 8, 0.01, False),   # tier 4: 2 micro-batches per rank, several buckets, params straddling buckets
    (1, 4, 8, 0.01, False),   # tier 4: 8 micro-batches on one rank, pairs merged by the counter (spare buffers)
    (2, 4, 8, 25.0, True),    # tier 4: 4 micro-batches per rank
    (2, 4, 4, 25.0, True),    # tier 4, one bucket, sharded
    (2, 3, 4, 0.01, True),    # tier 3: left fold inside a rank, tree over ranks, sharded
])
def test_reducer_alone_equals_python_tree_and_fp64(tmp_path, world, tier, M, bucket_mb, shard):
    res = run_reducer(tmp_path, world, tier, M, bucket_mb, shard)
    if bucket_mb < 1:
        assert res["nbuckets"] > 1
    # sharded: each rank stores optimizer state for its 1/W of the flat buffer only (ZeRO-1)
    assert res["opt_numel"] == (res["padded"] // world if shard else res["padded"])
    L = M // world
    sq = 0.0
    for name, p in Toy().named_parameters():
        leaves = [known_grad(j, name, p.shape).reshape(-1).numpy() for j in range(M)]
        if tier >= 4:
            want = py_tree(leaves)
        else:
            want = py_tree([py_fold(leaves[r * L:(r + 1) * L]) for r in range(world)])
        want = (want * np.float32(1.0 / M)).astype(np.float32)
        got = res["grads"][name].numpy()
        assert np.array_equal(got, want), name  # bitwise: the same tree, written independently
        exact = np.sum([x.astype(np.float64) for x in leaves], axis=0) / M
        assert np.allclose(got, exact, rtol=1e-5, atol=1e-5 * np.abs(exact).max())  # within fp32 rounding
        sq += float((got.astype(np.float64) ** 2).sum())
    assert abs(res["norm"] - sq**0.5) <= 1e-9 * sq**0.5


@pytest.mark.parametrize("world,M,bucket_mb", [
    (1, 4, 0.01),    # one partial: the first pair, pushed bucket by bucket during its second backward
    (1, 16, 0.01),   # seven pushes, four of them merging with entries read back from the host; three at the end
    (2, 16, 25.0),   # 8 micro-batches a rank, one bucket, the tree's top levels over 2 ranks
])
def test_offloaded_partials_give_the_bits_of_the_device_ones(tmp_path, world, M, bucket_mb):
    # dist.offload_partials: every partial sum waits in host memory, each merge and the last pair's buckets read
    # them back; the gradients and norm must be the same bits as with every partial on the device, and the device
    # must hold no gradient buffer but the flat one (3 steps: the host levels are reused)
    kept = run_reducer(tmp_path, world, 4, M, bucket_mb, False)
    off = run_reducer(tmp_path, world, 4, M, bucket_mb, False, offload=True, steps=3)
    for name, g in kept["grads"].items():
        assert torch.equal(off["grads"][name], g), name
    assert off["norm"] == kept["norm"]
    L = M // world
    partials = (L // 2).bit_length() - 1  # log2(L/2): the tree's partials beside the last pair
    assert len(off["offloaded"]) == 3
    for step in off["offloaded"]:  # every pair but the last crossed to the host once, whole
        assert step == {"host_partials": partials, "device_spares": 0, "stack": 0,
                        "bytes": (L // 2 - 1) * 4 * off["padded"]}
    # every pair builds in the gradient buffer: no spare at all (tier 3's memory), where the device tree holds
    # log2(L/2)
    assert kept["spares_peak"] == partials
    assert off["spares_peak"] == 0


# ---- whole training runs -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tier3_base(tmp_path_factory):
    d = tmp_path_factory.mktemp("t3") / "base"
    train(d, "det.tier=3", nproc=2)
    return step_fields(d)


def test_tier3_rerun_on_2_ranks_is_identical(tmp_path, tier3_base):
    train(tmp_path / "r", "det.tier=3", nproc=2)
    assert step_fields(tmp_path / "r") == tier3_base and len(tier3_base) == 4


@pytest.mark.parametrize("extra", [["dist.bucket_mb=0.001"], ["dist.bucket_mb=0.05"],
                                   ["dist.shard_optimizer=true"],
                                   ["dist.shard_optimizer=true", "dist.bucket_mb=0.001"]],
                         ids=lambda e: ",".join(e))
def test_tier3_identical_across_buckets_and_sharding(tmp_path, tier3_base, extra):
    train(tmp_path / "r", "det.tier=3", *extra, nproc=2)
    assert step_fields(tmp_path / "r") == tier3_base


def test_tier4_identical_on_1_2_4_ranks(tmp_path):
    """The headline: same global batch (4 micro-batches), accumulation 4/2/1 on 1/2/4 ranks -> identical ledgers,
    with dropout on: its draws are keyed by (seed, step, global micro-batch index).  Keyed by the local index (or the
    rank), rank r's micro-batches would draw what rank 0's do and the runs would differ."""
    runs = {}
    for world in (1, 2, 4):
        d = tmp_path / f"w{world}"
        train(d, "det.tier=4", "model.dropout=0.2", nproc=world)
        runs[world] = step_fields(d)
    assert runs[1] == runs[2] == runs[4]
    d = tmp_path / "w4s"
    train(d, "det.tier=4", "model.dropout=0.2", "dist.shard_optimizer=true", "dist.bucket_mb=0.01", nproc=4)
    assert step_fields(d) == runs[1]
    # the partial of micro-batches 0-1 waits in host memory (dist.offload_partials): the same bits
    train(tmp_path / "w1off", "det.tier=4", "model.dropout=0.2", "dist.offload_partials=true", nproc=1)
    assert step_fields(tmp_path / "w1off") == runs[1]
    train(tmp_path / "nodrop", "det.tier=4", nproc=1)
    assert [s[1] for s in step_fields(tmp_path / "nodrop")] != [s[1] for s in runs[1]]  # dropout is really on


def test_control_ddp_tier2_bits_change_with_world_size(tmp_path):
    """Without the canonical tree, the same global batch on 1, 2 and 4 ranks gives different bits: the tier-4 test
    above could fail."""
    last = {}
    for world in (1, 2, 4):
        d = tmp_path / f"w{world}"
        train(d, "det.tier=2", nproc=world)
        f = step_fields(d)
        last[world] = f[-1]
    assert last[1][2] == last[2][2] == last[4][2]  # same data ...
    assert len({last[w][4] for w in last}) == 3  # ... three different parameter results


def test_tier4_refuses_3_ranks(tmp_path):
    p = train(tmp_path / "r", "det.tier=4", "train.global_batch=12", "train.micro_batch=2", nproc=3, check=False)
    assert p.returncode != 0
    assert "det.tier=4 needs a power-of-two world size, got 3" in p.stderr


def test_tier4_refuses_6_micro_batches(tmp_path):
    p = train(tmp_path / "r", "det.tier=4", "train.global_batch=12", "train.micro_batch=2", nproc=1, check=False)
    assert p.returncode == 2
    assert "power-of-two number of micro-batches" in p.stderr and "=6" in p.stderr


# ---- 4 ranks: every cross-rank sum has 4 operands, so any order that depends on the bucket or the source rank
# ---- (a rotation, a ring) changes bits; with 2 ranks a+b == b+a would hide it --------------------------------
@pytest.fixture(scope="module")
def tier3_base4(tmp_path_factory):
    d = tmp_path_factory.mktemp("t3w4") / "base"
    train(d, "det.tier=3", nproc=4)
    return step_fields(d)


@pytest.mark.parametrize("extra", [[], ["dist.bucket_mb=0.001"], ["dist.bucket_mb=0.05", "dist.shard_optimizer=true"]],
                         ids=lambda e: ",".join(e) or "rerun")
def test_tier3_on_4_ranks_identical_across_buckets_and_sharding(tmp_path, tier3_base4, extra):
    train(tmp_path / "r", "det.tier=3", *extra, nproc=4)
    assert step_fields(tmp_path / "r") == tier3_base4 and len(tier3_base4) == 4  # whole step lines




def test_bf16_rows_sum_as_their_fp32_widening():
    """tree_sum_rows_into with bf16 rows and an fp32 output (FSDP2's bf16_rows on the CPU path): the tree over the rows
    widened to fp32, bit for bit, and not a 16-bit sum."""
    from dettrain.sync.collectives import tree_sum_rows_into, tree_sum_rows_torch

    g = torch.Generator().manual_seed(3)
    for n in (1, 2, 3, 8, 9, 17):
        x = (torch.randn(n, 999, generator=g) * torch.logspace(-6, 6, n).unsqueeze(1)).bfloat16()
        want = tree_sum_rows_torch(x.float()).clone()
        out = torch.empty(999)
        assert tree_sum_rows_into(x.clone(), out) is out
        assert torch.equal(out.view(torch.int32), want.view(torch.int32))
        if n >= 2:  # rows of one magnitude: their sums need more bits than bf16 holds, and must keep them
            y = torch.randn(n, 999, generator=g).bfloat16()
            tree_sum_rows_into(y, out)
            assert bool((out != out.bfloat16().float()).any())


def test_local_max_is_the_max_of_abs():
    """kernels.norm.local_max (each part read once, the canonical norm's starting point) equals torch's max of |x|,
    infinities and NaN included; finish_'s torch path gives +0.0 for -0.0 and the scaled values."""
    from dettrain.kernels.norm import finish_, local_max

    g = torch.Generator().manual_seed(4)
    parts = [torch.randn(n, generator=g) * 10 for n in (1, 17, 5000)]
    assert torch.equal(local_max(parts), torch.stack([p.abs().max() for p in parts]).max().reshape(1))
    parts[1][3] = -float("inf")
    assert float(local_max(parts)) == float("inf")
    parts[0][0] = float("nan")
    assert local_max(parts).isnan().all()
    z = [torch.tensor([-0.0, 0.0, -2.0, 3.0])]
    m = finish_(z, 0.5)
    assert torch.equal(z[0], torch.tensor([0.0, 0.0, -1.0, 1.5])) and not z[0][0].signbit() and float(m) == 1.5
