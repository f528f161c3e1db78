"""Run under torchrun: each of the reducer's local-sum protocols (fold, counter, offloaded counter) on known
per-micro-batch gradients of a tiny model; rank 0 saves the reduced (unscaled) gradients.

usage: torchrun --nproc-per-node=W tests/protocols_worker.py OUT.pt M
Micro-batch j's gradient is reducer_worker.known_grad(j, name, shape), through a real backward.  Tier 4's protocols
run only where the tier allows them (W and M/W powers of two).  Two steps each: the second reuses every buffer.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from reducer_worker import known_grad
from torch import nn

from dettrain.sync.collectives import CanonicalReducer


def tiny() -> nn.Module:
    m = nn.Module()
    m.a = nn.Parameter(torch.zeros(700))  # 700 + 650 elements: with 1024-element buckets, b straddles two
    m.b = nn.Parameter(torch.zeros(650))
    return m


def power_of_two(n: int) -> bool:
    return n & (n - 1) == 0


def main() -> None:
    out, M = sys.argv[1], int(sys.argv[2])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    L = M // world
    protocols = {"fold": (3, False)}
    if power_of_two(world) and power_of_two(L):
        protocols.update(counter=(4, False), offload=(4, True))
    saved = {}
    for name, (tier, offload) in protocols.items():
        model = tiny()
        red = CanonicalReducer(model, rank, world, 1e-9, tier, False, torch.device("cpu"), offload=offload)
        on_host = 0
        for _ in range(2):
            red.begin_step(L)
            for k in range(L):
                red.begin_micro(k)
                j = rank * L + k
                sum((p * known_grad(j, n, p.shape)).sum() for n, p in model.named_parameters()).backward()
                red.end_micro(k)
                if k == L - 2 and offload:
                    on_host = len(red.local.on_host)
            red.finish(scale=1.0)  # the sum itself, unscaled
        saved[name] = {"protocol": type(red.local).__name__, "on_host": on_host,
                       "grads": {n: red.grad[o : o + k].clone() for n, _, o, k in red.layout.entries}}
    if rank == 0:
        torch.save(saved, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
