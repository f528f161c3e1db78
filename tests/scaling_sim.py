"""Past one node: the canonical reduce-scatter played by W simulated ranks in one process, and its cost model.

A study the engines do not use, so it lives with the tests that check it, not in the library: docs/scaling.md is
the prose, ``tests/test_scaling_sim.py`` checks both halves, and ``python tests/scaling_sim.py`` prints the tables.

**Simulated ranks.**  W ranks are the rows of one tensor: row r is what rank r holds.  Every operation is
elementwise or ``collectives.tree_sum_rows`` (the reducer's own tree) over a leading dimension, and the binary
counter is ``accumulate.BinaryCounter`` itself, so each rank's bits are the IEEE additions the real engines do,
in the same order; an ``all_to_all`` is a transpose of (source rank, destination shard) and moves no bit.

- ``flat_engine_step``: the flat engine at tier 4 (rank r owns the aligned block of M/W micro-batches, pairs
  accumulate in place into a zeroed buffer as autograd does, a binary counter merges the pairs, then the
  reduce-scatter and all_gather over ranks);
- ``round_robin_step``: the FSDP2 engine at tier 4 (round k: rank r runs micro-batch kW + r, each round
  reduce-scattered, a binary counter over rounds on the shards);
- three reduce-scatters with the same tree: ``reduce_scatter_flat`` (one ``all_to_all`` over all W ranks, as
  ``CanonicalReducer`` and ``CanonicalReduceScatter`` do now), ``reduce_scatter_two_level`` (an ``all_to_all``
  inside each node and a tree over its 8 ranks, then an ``all_to_all`` across nodes and a tree over the node
  partials) and ``reduce_scatter_halving`` (the same first stage, then recursive halving across nodes at
  distances 1, 2, 4, ...).  All three give the balanced binary tree over the W ranks in rank order when the ranks
  of a node are consecutive and the counts are powers of two.

**On real process groups** (not used by the engines yet): ``two_level_groups`` builds each rank's node and rail
groups, ``two_level_reduce_scatter`` runs the two stages with FSDP2's input layout and gives the bits of
``engines.CanonicalReduceScatter`` (checked on 4 Gloo processes as 2 nodes of 2 ranks).

**Cost model** (``Fabric``, ``reduce_scatter_times``, ``cost_table``): modelled seconds of one reduce-scatter of
B bytes per rank on 8-GPU nodes, NCCL's ring against the three canonical designs.  Nothing here is measured; every
constant is named in ``Fabric`` with where it comes from.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from dettrain.sync.accumulate import BinaryCounter
from dettrain.sync.collectives import FlatLayout, tree_sum_rows, tree_sum_rows_into

GPUS_PER_NODE = 8


# ---- simulated ranks ---------------------------------------------------------------------------------------
def _check_pow2(name: str, v: int) -> None:
    if v < 1 or v & (v - 1):
        raise ValueError(f"{name}={v}: the tier-4 tree needs a power of two")


def reduce_scatter_flat(bufs: torch.Tensor) -> torch.Tensor:
    """bufs (W, n): rank i's buffer in row i.  Returns (W, n/W): row j is shard j summed over the W ranks.

    ``all_to_all``: rank j receives shard j of every rank, row i from rank i, i.e. the (source, shard) grid
    ``bufs.view(W, W, S)`` read along its first axis; then ``tree_sum_rows`` over the sources in rank order."""
    W, n = bufs.shape
    return tree_sum_rows(bufs.reshape(W, W, n // W).clone()).clone()


def reduce_scatter_two_level(bufs: torch.Tensor, ranks_per_node: int = GPUS_PER_NODE,
                             placement: Callable[[int, int], int] | None = None) -> torch.Tensor:
    """The same result as ``reduce_scatter_flat`` in two stages, the first inside a node, the second across nodes.

    Global rank j = node * R + local rank l (``placement(node, l)`` overrides that, to show what a strided
    placement breaks).  Stage 1 (NVLink): rank (node, l) receives from each rank of its node the shards
    {n' * R + l}, sums the R rows with ``tree_sum_rows`` in local-rank order: the node's partial for those shards.
    Stage 2 (one NIC rail, the ranks with the same l): rank (n', l) receives every node's partial for its shard
    n' * R + l and sums the N rows in node order.  When R and N are powers of two and a node's ranks are
    consecutive, stage 1 is the lower log2(R) levels of the tree over all W ranks and stage 2 its upper levels."""
    W, n = bufs.shape
    R = min(ranks_per_node, W)
    N, S = W // R, n // W
    order = [placement(nd, loc) if placement else nd * R + loc for nd in range(N) for loc in range(R)]
    x = bufs[order].reshape(N, R, N, R, S)  # (node, local source, destination node, destination local, shard)
    partial = tree_sum_rows(x.transpose(0, 1).clone())  # stage 1: over the R local sources -> (node, n', l, S)
    return tree_sum_rows(partial.clone()).reshape(W, S).clone()  # stage 2: over the N nodes -> (n', l, S)


def reduce_scatter_halving(bufs: torch.Tensor, ranks_per_node: int = GPUS_PER_NODE) -> torch.Tensor:
    """``reduce_scatter_two_level`` with stage 2 done by recursive halving at distances 1, 2, 4, ... N/2.

    At step s node a exchanges with node a ^ 2^s: it keeps the destinations that agree with a on bit s, sends
    the others, and adds the partner's partial for the kept ones.  After step s, node a's partial for a kept
    destination is the sum over the aligned block of 2^(s+1) source nodes that contains a: each step is one
    level of the balanced tree over nodes (IEEE addition is commutative, so mine + theirs has the bits of
    lower + upper).  log2(N) messages per rank instead of N - 1, halving in size; the same bytes."""
    W, n = bufs.shape
    R = min(ranks_per_node, W)
    N, S = W // R, n // W
    x = bufs.reshape(N, R, N, R, S)
    held = tree_sum_rows(x.transpose(0, 1).clone()).clone()  # stage 1 as above: (source node a, dest n', l, S)
    node = torch.arange(N)
    s = 0
    while (1 << s) < N:
        partner = held[node ^ (1 << s)]
        # destinations node a still holds after step s: those agreeing with a on bits 0..s
        low = (1 << (s + 1)) - 1
        keep = ((node.view(N, 1) ^ node.view(1, N)) & low) == 0  # (a, n')
        held = torch.where(keep.view(N, N, 1, 1), held + partner, held)
        s += 1
    return held[node, node].reshape(W, S).clone()  # node a ends holding destination a


# ---- the two-level reduce-scatter on real process groups ---------------------------------------------------
def two_level_groups(ranks_per_node: int = GPUS_PER_NODE) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """(this rank's node group, its rail group) for ranks numbered node by node (rank = node * R + local rank).

    Every rank creates every group, in the same order (torch's rule for ``new_group``); a group's ranks are
    sorted, so rank order inside the node group is local-rank order and inside the rail group node order."""
    W, rank, R = dist.get_world_size(), dist.get_rank(), ranks_per_node
    if W % R:
        raise ValueError(f"world size {W} is not a multiple of {R} ranks per node")
    mine = [None, None]
    for node in range(W // R):
        g = dist.new_group(list(range(node * R, (node + 1) * R)))
        if rank // R == node:
            mine[0] = g
    for loc in range(R):
        g = dist.new_group(list(range(loc, W, R)))
        if rank % R == loc:
            mine[1] = g
    return mine[0], mine[1]


def two_level_reduce_scatter(output: torch.Tensor, input_tensor: torch.Tensor, node_group: dist.ProcessGroup,
                             rail_group: dist.ProcessGroup) -> torch.Tensor:
    """``engines.CanonicalReduceScatter``'s result, bit for bit, in two stages (docs/scaling.md); not used by the
    engines yet.  FSDP2's layout: ``input_tensor`` holds W shards rank by rank, ``output`` gets this rank's sum.

    Stage 1 (node group): local rank l receives, from every rank of its node, the shards n' * R + l of all nodes
    n' (a strided pick, so one copy of the input first), and sums the R rows in local-rank order: its node's
    partial for those shards.  Stage 2 (rail group): it receives every node's partial for its own shard and sums
    them in node order.  With ranks numbered node by node both stages are levels of the tree over all W rows."""
    R, N = dist.get_world_size(node_group), dist.get_world_size(rail_group)
    S = input_tensor.numel() // (R * N)
    send = input_tensor.reshape(N, R, S).transpose(0, 1).contiguous()  # piece l: shards n' * R + l, n' = 0..N-1
    recv = torch.empty_like(send)  # (local source, n', S)
    dist.all_to_all_single(recv, send, group=node_group)
    partial = tree_sum_rows(recv.view(R, N * S)).reshape(N, S).contiguous()  # row n': shard n' * R + l
    recv2 = torch.empty_like(partial)  # (source node, S)
    dist.all_to_all_single(recv2, partial, group=rail_group)
    return tree_sum_rows_into(recv2, output.view(-1))


ReduceScatter = Callable[[torch.Tensor], torch.Tensor]


def flat_engine_step(leaves: torch.Tensor, world: int, reduce_scatter: ReduceScatter = reduce_scatter_flat
                     ) -> torch.Tensor:
    """The flat engine's tier-4 step gradient (the sum, before the 1/M scale) with ``world`` simulated ranks.

    leaves (M, n): micro-batch gradients in global index order.  Rank r runs micro-batches [r*M/W, (r+1)*M/W);
    like ``CanonicalReducer``, each pair (2j, 2j+1) accumulates in place into a zeroed buffer (autograd's
    ``+=``), a ``BinaryCounter`` merges the pairs (level 1), the last pair is finished into place, and the
    buffers are reduce-scattered and all-gathered (a concatenation: no arithmetic)."""
    M, n = leaves.shape
    _check_pow2("world", world)
    _check_pow2("micro-batches per rank", M // world)
    L = M // world
    blocks = leaves.reshape(world, L, n)  # row r: rank r's block
    counter = BinaryCounter()
    last = None
    for k in range(0, L, 2):
        buf = torch.zeros(world, n)  # begin_micro of an even k: the pair's buffer is zeroed
        buf.add_(blocks[:, k])  # autograd accumulates each micro-batch in place
        if k + 1 < L:
            buf.add_(blocks[:, k + 1])
        if k + 2 < L:
            counter.push(buf, level=1)  # a complete pair that is not the last one
        else:
            last = buf
    counter.finish_(last, slice(None))
    return reduce_scatter(last).reshape(-1)


def round_robin_step(leaves: torch.Tensor, world: int, reduce_scatter: ReduceScatter = reduce_scatter_flat
                     ) -> torch.Tensor:
    """The FSDP2 engine's tier-4 step gradient (before the 1/M scale) with ``world`` simulated ranks.

    Round k: rank r holds micro-batch kW + r's unsharded gradient, an aligned block of W leaves; its reduce-scatter
    is that block's tree node on each rank's shard, and a ``BinaryCounter`` over the rounds (level 0) builds the
    upper levels on shards.  On one rank FSDP2 reduces every pair (g_2j + g_2j+1, the tree's lowest node) and
    the counter starts at level 1.  The shards are concatenated (the all_gather) to compare with the flat engine."""
    M, n = leaves.shape
    _check_pow2("world", world)
    _check_pow2("rounds", M // world)
    if world == 1 and M > 1:
        nodes, level = leaves[0::2] + leaves[1::2], 1  # FSDP2 on one rank: the pair's unsharded g_2j += g_2j+1
    else:
        nodes, level = None, 0
    counter = BinaryCounter()
    count = len(nodes) if nodes is not None else M // world
    for k in range(count):
        if nodes is not None:
            shard = nodes[k].view(1, n).clone()
        else:
            shard = reduce_scatter(leaves[k * world:(k + 1) * world])
        if k < count - 1:
            counter.push(shard, level=level)
        else:
            counter.finish_(shard, slice(None))
    shard.add_(0.0)  # FSDP2 maps -0.0 to +0.0 before the scale (FSDP2Engine.reduce)
    return shard.reshape(-1)


def balanced_tree(rows: list[torch.Tensor]) -> torch.Tensor:
    """The definition, by recursive halving of the index range: tree(a..b) = tree(lower half) + tree(upper half)."""
    if len(rows) == 1:
        return rows[0]
    h = len(rows) // 2
    return balanced_tree(rows[:h]) + balanced_tree(rows[h:])


# ---- cost model -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Fabric:
    """Link speeds and per-message costs of an 8-GPU H100/H200 SXM node and its network (assumed, not measured).

    Bandwidths are per direction, in bytes/s; latencies in seconds."""

    nvlink: float = 450e9
    """NVLink 4 through NVSwitch: 900 GB/s bidirectional per GPU (NVIDIA's H100/H200 SXM spec), 450 GB/s each way,
    to any other GPU of the node."""
    nic: float = 50e9
    """One ConnectX-7 400 Gb/s NIC per GPU (8 per node, a rail-optimised non-blocking fabric): 50 GB/s each way."""
    hbm: float = 4.3e12
    """Device memory traffic (read + write) of the tree sum on an H200: the measured 0.21 ms for one 7B block's
    8-row tree (docs/engines.md) moves 0.81 GB in and 0.10 GB out, 4.3e12 bytes/s."""
    call: float = 8.4e-6
    """Fixed cost of one NCCL call: NCCL's tuning model, base latency of Ring/Simple."""
    nvlink_step: float = 3.4e-6
    """One dependent step over NVLink: NCCL's tuning model, hardware latency NVLink Ring/Simple."""
    net_step: float = 14e-6
    """One dependent step over the network: NCCL's tuning model, hardware latency NET Ring/Simple."""
    net_post: float = 1e-6
    """Posting one network message: NCCL's network overhead on x86 Intel hosts (2 us on AMD)."""


def tree_sum_bytes(rows: int, row_bytes: float) -> float:
    """Memory traffic of ``tree_sum_rows`` over ``rows`` rows on CUDA (kernels/rowsum.py): each pass reads every
    row and writes one row per aligned group of eight, until one row is left."""
    total = 0.0
    while rows > 1:
        groups = -(-rows // 8)
        total += (rows + groups) * row_bytes
        rows = groups
    return total


def reduce_scatter_stages(B: float, W: int, f: Fabric = Fabric()) -> dict[str, tuple[float, ...]]:
    """Modelled seconds of one reduce-scatter of ``B`` bytes per rank over ``W`` ranks (8 per node, consecutive),
    per design, split into its stages (one stage, or the NVLink stage and the network stage).

    ring: NCCL's ring (its own latency model; bandwidth: each node's data crosses the network once per channel,
    so the 8 NICs of a node carry (W-1)/W x B at 8 x nic).  a2a: dettrain's flat canonical reduce-scatter, W - 1
    messages of B/W per rank, W - 8 of them through the rank's NIC, each posted and then sent, plus the tree.
    two_level: an NVLink all_to_all of B/8 per peer and the 8-row tree, then N - 1 messages of B/W on the rail
    and the N-row tree.  halving: the same first stage, then log2(N) dependent steps of B/16, B/32, ... B/W."""
    R = min(GPUS_PER_NODE, W)
    N = W // R
    m = B / W
    if N == 1:
        ring = f.call + (W - 1) * f.nvlink_step + (W - 1) / W * B / f.nvlink
    else:
        ring = (f.call + (W - N) * max(f.nvlink_step, 3 * f.net_post) + (N - 1) * f.net_step
                + (W - 1) / W * B / (GPUS_PER_NODE * f.nic))
    intra = f.nvlink_step + (R - 1) * m / f.nvlink
    inter = f.net_step + (W - R) * (f.net_post + m / f.nic) if N > 1 else 0.0
    a2a = f.call + max(intra, inter) + tree_sum_bytes(W, m) / f.hbm
    if N == 1:
        return {"ring": (ring,), "a2a": (a2a,), "two_level": (a2a,), "halving": (a2a,)}
    stage1 = f.call + f.nvlink_step + (R - 1) * (B / R) / f.nvlink + tree_sum_bytes(R, B / R) / f.hbm
    direct = f.call + f.net_step + (N - 1) * (f.net_post + m / f.nic) + tree_sum_bytes(N, m) / f.hbm
    halving, half = 0.0, B / R
    while half > m * 1.5:  # log2(N) steps: send half of what is held, add the partner's half
        half /= 2
        halving += f.call + f.net_step + f.net_post + half / f.nic + 3 * half / f.hbm
    return {"ring": (ring,), "a2a": (a2a,), "two_level": (stage1, direct), "halving": (stage1, halving)}


def reduce_scatter_times(B: float, W: int, f: Fabric = Fabric()) -> dict[str, float]:
    """``reduce_scatter_stages`` of one call, its stages one after the other."""
    return {k: sum(v) for k, v in reduce_scatter_stages(B, W, f).items()}


def pipelined(stages: tuple[float, ...], count: int) -> float:
    """Seconds for ``count`` equal calls when each stage runs on its own stream (the NVLink stage of call c+1
    during the network stage of call c, as two process groups allow): fill, then the slowest stage per call."""
    return sum(stages) + (count - 1) * max(stages)


def network_bytes_per_nic(B: float, W: int) -> dict[str, float]:
    """Bytes each NIC sends in one reduce-scatter of ``B`` bytes per rank (8 ranks and 8 NICs per node)."""
    R = min(GPUS_PER_NODE, W)
    N = W // R
    if N == 1:
        return {"ring": 0.0, "a2a": 0.0, "two_level": 0.0}
    return {"ring": (W - 1) / W * B / GPUS_PER_NODE, "a2a": (W - R) / W * B, "two_level": (N - 1) / N * B / R}


# the Llama-2-7B shape of conf/exp/llm_7b.yaml: 32 blocks of dim 4096, FFN 11008, vocabulary 32000
DIM, FFN, LAYERS, VOCAB = 4096, 11008, 32, 32000
BLOCK_PARAMS = 4 * DIM * DIM + 3 * DIM * FFN + 2 * DIM  # attention, SwiGLU, two norms: one FSDP2 unit
ROOT_PARAMS = 2 * VOCAB * DIM + DIM  # embedding, output, final norm: FSDP2's root unit
PARAMS_7B = LAYERS * BLOCK_PARAMS + ROOT_PARAMS


def flat_buckets(bucket_mb: float, world: int, params: int = PARAMS_7B) -> tuple[int, int]:
    """(bytes of one bucket, number of buckets) of the flat engine's fp32 gradient for a model of ``params``
    parameters at ``world`` ranks: ``FlatLayout``'s own rounding (buckets a multiple of world x CHUNK elements),
    from a layout over one parameter on the meta device (nothing is allocated)."""
    model = nn.Module()
    model.w = nn.Parameter(torch.empty(params, device="meta"))
    layout = FlatLayout(model, world, bucket_mb)
    return layout.bsize * 4, len(layout.buckets)


def _fmt_bytes(b: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= scale:
            return f"{b / scale:.3g} {unit}"
    return f"{b:.0f} B"


def _fmt_s(t: float) -> str:
    return f"{t * 1e3:.2f} ms" if t >= 1e-3 else f"{t * 1e6:.0f} us"


WORLDS = tuple(1 << k for k in range(3, 11))  # 8 ... 1024


def cost_table(f: Fabric = Fabric()) -> str:
    """The tables of docs/scaling.md, as markdown (the test checks that the doc holds exactly this text)."""
    out = ["| W | nodes | bucket (25 MiB asked) | per-peer message | network bytes per NIC: ring / a2a / two-level "
           "| messages per NIC: a2a / two-level / halving | ring | a2a | two-level | halving |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for W in WORLDS:
        B, _ = flat_buckets(25.0, W)
        N = W // GPUS_PER_NODE
        t = reduce_scatter_times(B, W, f)
        nb = network_bytes_per_nic(B, W)
        steps = int(math.log2(N))
        out.append(f"| {W} | {N} | {_fmt_bytes(B)} | {_fmt_bytes(B / W)} | "
                   + " / ".join(_fmt_bytes(nb[k]) if nb[k] else "0" for k in ("ring", "a2a", "two_level"))
                   + f" | {W - GPUS_PER_NODE} / {N - 1} / {steps} | "
                   + " | ".join(_fmt_s(t[k]) for k in ("ring", "a2a", "two_level", "halving")) + " |")
    out += ["", "| W | 7B flat engine, 25 MiB buckets: ring / a2a / two-level / halving | 7B FSDP2, 32 blocks + root: "
            "ring / a2a / two-level / halving | FSDP2 block per-peer message |", "|---|---|---|---|"]
    keys = ("ring", "a2a", "two_level", "halving")
    for W in WORLDS:
        B, buckets = flat_buckets(25.0, W)
        flat = reduce_scatter_stages(B, W, f)
        blk = reduce_scatter_stages(BLOCK_PARAMS * 4, W, f)
        root = reduce_scatter_times(ROOT_PARAMS * 4, W, f)
        out.append(f"| {W} | " + " / ".join(_fmt_s(pipelined(flat[k], buckets)) for k in keys) + " | "
                   + " / ".join(_fmt_s(pipelined(blk[k], LAYERS) + root[k]) for k in keys)
                   + f" | {_fmt_bytes(BLOCK_PARAMS * 4 / W)} |")
    return "\n".join(out)


if __name__ == "__main__":
    print(cost_table())
