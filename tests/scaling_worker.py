"""Run under torchrun: scaling_sim.two_level_reduce_scatter on real Gloo groups against the engines'
CanonicalReduceScatter on the same input; rank 0 saves every rank's input and both results.
usage: torchrun --nproc-per-node=W tests/scaling_worker.py OUT.pt RANKS_PER_NODE
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from scaling_sim import two_level_groups, two_level_reduce_scatter

from dettrain.dist import all_gather_flat
from dettrain.sync.engines import CanonicalReduceScatter

SHARD = 4096  # elements per rank's shard


def main() -> None:
    out, ranks_per_node = sys.argv[1], int(sys.argv[2])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    node_group, rail_group = two_level_groups(ranks_per_node)
    # each rank's buffer keyed by its rank, magnitudes over eight decades so that any other grouping changes bits
    g = torch.Generator().manual_seed(100 + rank)
    inp = torch.randn(world * SHARD, generator=g) * torch.exp(torch.empty(world * SHARD).uniform_(-9, 9, generator=g))
    flat = torch.empty(SHARD)
    CanonicalReduceScatter()(flat, inp.clone())
    two = torch.empty(SHARD)
    two_level_reduce_scatter(two, inp.clone(), node_group, rail_group)
    parts = {}
    for name, t in (("input", inp), ("flat", flat), ("two_level", two)):
        full = torch.empty(world * t.numel())
        all_gather_flat(full, t)
        parts[name] = full.view(world, -1)
    if rank == 0:
        torch.save(parts, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
