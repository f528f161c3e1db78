"""Tier 4 past one node, in one process: W = 1, 2, 4 ... 1024 simulated ranks (tests/scaling_sim.py) give the same
step-gradient bits as one balanced tree over all M micro-batch gradients computed independently, for the flat
engine's blocks and FSDP2's round-robin rounds, with the flat, two-level and recursive-halving reduce-scatters.
And docs/scaling.md's tables are the cost model's output."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import scaling_sim as scaling
import torch
from conftest import REPO

from dettrain.sync.collectives import CHUNK

M = 1024  # micro-batches per step: W = 1024 is one micro-batch per rank
N_ELEMS = 2048  # two elements per shard at W = 1024
WORLDS = [1 << k for k in range(11)]


def numpy_tree(xs: np.ndarray) -> np.ndarray:
    """The balanced binary tree over the rows of ``xs`` by recursive halving, in numpy float32 (no dettrain or
    torch code): the definition the simulated ranks must reproduce bit for bit."""
    if len(xs) == 1:
        return xs[0]
    h = len(xs) // 2
    return (numpy_tree(xs[:h]) + numpy_tree(xs[h:])).astype(np.float32)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # speed only (every operation here is elementwise, so the bits do not depend on it): on a shared 2-core
    # machine torch's intra-op threads make these small tensor ops 10-100x slower
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def leaves() -> torch.Tensor:
    # magnitudes spread over eight decades (per micro-batch and per element) so that rounding depends on the
    # order: a left fold, or a tree over another grouping, gives other bits
    g = torch.Generator().manual_seed(26)
    x = torch.randn(M, N_ELEMS, generator=g)
    scale = torch.exp(torch.empty(M, N_ELEMS).uniform_(-9.0, 9.0, generator=g))
    return (x * scale).float()


@pytest.fixture(scope="module")
def reference(leaves) -> np.ndarray:
    return numpy_tree(leaves.numpy().copy())


def bits(t: torch.Tensor | np.ndarray) -> np.ndarray:
    return (t.numpy() if isinstance(t, torch.Tensor) else t).view(np.uint32)


def test_the_order_matters_for_these_leaves(leaves, reference):
    """The check below proves something: a left fold of the same leaves (a tier-3 accumulation), and the tree over
    the leaves taken in another order, differ from the tree in many elements."""
    fold = leaves[0].numpy().copy()
    for row in leaves[1:].numpy():
        fold = (fold + row).astype(np.float32)
    assert (bits(fold) != bits(reference)).sum() > N_ELEMS // 4
    swapped = numpy_tree(leaves.numpy()[np.r_[1:M, 0]].copy())  # one leaf moved: another tree
    assert (bits(swapped) != bits(reference)).sum() > N_ELEMS // 4
    # the torch definition in tests/scaling_sim.py agrees with numpy's
    assert np.array_equal(bits(scaling.balanced_tree(list(leaves))), bits(reference))


@pytest.mark.parametrize("engine", ["flat", "round_robin"])
@pytest.mark.parametrize("rs", ["flat", "two_level", "halving"])
def test_step_gradient_bits_are_the_same_for_every_world_size(leaves, reference, engine, rs):
    step = {"flat": scaling.flat_engine_step, "round_robin": scaling.round_robin_step}[engine]
    reduce_scatter = {"flat": scaling.reduce_scatter_flat, "two_level": scaling.reduce_scatter_two_level,
                      "halving": scaling.reduce_scatter_halving}[rs]
    for W in WORLDS:
        got = step(leaves, W, reduce_scatter)
        assert got.shape == (N_ELEMS,)
        diff = int((bits(got) != bits(reference)).sum())
        assert diff == 0, f"{engine} engine, {rs} reduce-scatter, W={W}: {diff} elements differ from the tree"


def test_reduce_scatters_agree_and_need_consecutive_node_ranks():
    """The two-level and halving reduce-scatters equal the flat one (the tree over W rows) on every power-of-two
    W and ranks per node; with the ranks of a node strided instead of consecutive, the intra-node sums group
    ranks the tree does not pair, and the bits change."""
    g = torch.Generator().manual_seed(1)
    for W in (2, 8, 16, 64, 256):
        bufs = torch.randn(W, W * 4, generator=g) * torch.logspace(-6, 6, W).unsqueeze(1)
        flat = scaling.reduce_scatter_flat(bufs)
        want = scaling.balanced_tree(list(bufs)).reshape(W, 4)
        assert torch.equal(flat.view(torch.int32), want.view(torch.int32)), W
        for R in (1, 2, 4, 8):
            if R <= W:
                for f in (scaling.reduce_scatter_two_level, scaling.reduce_scatter_halving):
                    assert torch.equal(f(bufs, R).view(torch.int32), flat.view(torch.int32)), (W, R, f.__name__)
    W, R = 64, 8
    bufs = torch.randn(W, W * 64, generator=g) * torch.logspace(-6, 6, W)[torch.randperm(W, generator=g)].unsqueeze(1)
    strided = scaling.reduce_scatter_two_level(bufs, R, placement=lambda node, loc: loc * (W // R) + node)
    assert (strided.view(torch.int32) != scaling.reduce_scatter_flat(bufs).view(torch.int32)).any()


def test_world_size_must_be_a_power_of_two(leaves):
    with pytest.raises(ValueError, match="power of two"):
        scaling.flat_engine_step(leaves[:12], 3)
    with pytest.raises(ValueError, match="power of two"):
        scaling.round_robin_step(leaves[:12], 4)


# ---- the cost model -------------------------------------------------------------------------------------------
def test_bucket_sizes_are_the_flat_engines():
    """The table's bucket sizes are FlatLayout's: at least dist.bucket_mb, a multiple of world x CHUNK elements."""
    for W in scaling.WORLDS:
        B, count = scaling.flat_buckets(25.0, W)
        assert B % (W * CHUNK * 4) == 0 and B >= 25 << 20 and B - (W * CHUNK * 4) < 25 << 20
        assert count == -(-scaling.PARAMS_7B // (B // 4))
    assert scaling.PARAMS_7B == 6_738_415_616  # the Llama-2-7B count docs/llm_7b.md states


def test_model_properties_the_doc_relies_on():
    """What docs/scaling.md concludes from the model: past one node the flat all_to_all puts 8(W-8)/(W-1) times
    the ring's bytes on each NIC and the two-level design at most the ring's; the tree is one memory pass."""
    for W in scaling.WORLDS[1:]:
        B, _ = scaling.flat_buckets(25.0, W)
        nb = scaling.network_bytes_per_nic(B, W)
        assert nb["a2a"] / nb["ring"] == pytest.approx(8 * (W - 8) / (W - 1))  # 4.3x at 2 nodes, 7.9x at 128
        assert nb["two_level"] <= nb["ring"]
        t = scaling.reduce_scatter_times(B, W)
        assert t["two_level"] < t["a2a"]
    assert scaling.tree_sum_bytes(8, 1.0) == 9.0  # one pass over eight rows: read 8, write 1
    assert scaling.tree_sum_bytes(64, 1.0) == 64 + 8 + 8 + 1


def test_doc_tables_are_the_models_output():
    doc = (REPO / "docs" / "scaling.md").read_text(encoding="utf-8")
    assert scaling.cost_table() in doc, "docs/scaling.md: paste the output of python tests/scaling_sim.py"


# ---- the two-level reduce-scatter on real processes ------------------------------------------------------------
def test_two_level_reduce_scatter_on_gloo_equals_the_canonical_one(tmp_path):
    """4 Gloo processes as 2 "nodes" of 2 ranks: scaling_sim.two_level_reduce_scatter (node group, then rail
    group) gives the bits of the engines' CanonicalReduceScatter and of the simulated flat reduce-scatter."""
    out = tmp_path / "rs.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
           str(REPO / "tests" / "scaling_worker.py"), str(out), "2"]
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-3000:]
    parts = torch.load(out)
    simulated = scaling.reduce_scatter_flat(parts["input"])
    assert torch.equal(parts["flat"].view(torch.int32), simulated.view(torch.int32))
    assert torch.equal(parts["two_level"].view(torch.int32), parts["flat"].view(torch.int32))
    # the inputs are such that another grouping of the ranks would show: (r0 + r2) + (r1 + r3) differs
    x = parts["input"].reshape(4, 4, -1)
    other = (x[0] + x[2]) + (x[1] + x[3])
    assert (other.view(torch.int32) != simulated.view(torch.int32)).any()
