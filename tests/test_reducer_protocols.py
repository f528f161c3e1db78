"""The reducer's three local-sum protocols (sync/accumulate.py) against a plain reference order written here: a
Python loop over float32 numbers, element by element, on 1 process and on real Gloo ranks, bit for bit."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import REPO

sys.path.insert(0, str(REPO / "tests"))
from protocols_worker import tiny  # noqa: E402
from reducer_worker import known_grad  # noqa: E402

f32 = np.float32


def left_fold(xs: list) -> np.float32:
    """x_0 + x_1 + ... + x_{n-1}, left to right, each sum rounded to float32."""
    acc = f32(0)
    for x in xs:
        acc = f32(acc + x)
    return acc


def pairwise(xs: list) -> np.float32:
    """Neighbours added in pairs (x_0 + x_1, x_2 + x_3, ...; an odd last one waits), then the pairs the same way,
    until one number is left: the balanced binary tree for a power-of-two count."""
    while len(xs) > 1:
        xs = [f32(xs[i] + xs[i + 1]) if i + 1 < len(xs) else xs[i] for i in range(0, len(xs), 2)]
    return xs[0]


def reference(protocol: str, leaves: list[np.ndarray], world: int) -> np.ndarray:
    """The documented order: the fold inside each rank's block of micro-batches, then pairwise over the ranks
    (tier 3); pairwise over every micro-batch of the step in index order, whatever the world size (tier 4, with or
    without the offload)."""
    M, n = len(leaves), leaves[0].size
    L = M // world
    out = np.empty(n, dtype=np.float32)
    for e in range(n):
        xs = [f32(g[e]) for g in leaves]
        if protocol == "fold":
            out[e] = pairwise([left_fold(xs[r * L : (r + 1) * L]) for r in range(world)])
        else:
            out[e] = pairwise(xs)
    return out


def run_protocols(tmp_path, world: int, M: int) -> dict:
    out = tmp_path / f"protocols_{world}_{M}.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
           str(REPO / "tests" / "protocols_worker.py"), str(out), str(M)]
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-4000:]
    return torch.load(out, weights_only=True)


@pytest.mark.parametrize("world,M,protocols", [
    (1, 8, {"fold": "FoldSum", "counter": "CounterSum", "offload": "OffloadedCounterSum"}),
    (2, 8, {"fold": "FoldSum", "counter": "CounterSum", "offload": "OffloadedCounterSum"}),
    (3, 6, {"fold": "FoldSum"}),  # tier 4 needs a power-of-two world: the fold alone, 3 operands over ranks
    (4, 8, {"fold": "FoldSum", "counter": "CounterSum", "offload": "OffloadedCounterSum"}),
])
def test_each_protocol_sums_in_its_documented_order(tmp_path, world, M, protocols):
    res = run_protocols(tmp_path, world, M)
    assert {k: v["protocol"] for k, v in res.items()} == protocols
    differ = False
    for name, p in tiny().named_parameters():
        leaves = [known_grad(j, name, p.shape).reshape(-1).numpy() for j in range(M)]
        want = {proto: reference(proto, leaves, world) for proto in protocols}
        for proto in protocols:
            got = res[proto]["grads"][name].numpy()
            assert np.array_equal(got.view(np.int32), want[proto].view(np.int32)), (proto, name)
        if "counter" in want:  # the data tells the fold from the tree: an order change would show
            differ |= not np.array_equal(want["fold"], want["counter"])
    L = M // world
    assert differ or L <= 2  # with 2 micro-batches a rank the fold of a pair is the tree's lowest level
    if "offload" in protocols:  # partials waited in host memory: log2(L/2) of them (none when L < 4)
        assert res["offload"]["on_host"] == ((L // 2).bit_length() - 1 if L >= 4 else 0)
