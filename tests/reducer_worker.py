"""Run under torchrun: the canonical reducer alone on known per-micro-batch gradients; rank 0 saves the result.

Gradient of global micro-batch j for parameter `name` is G(j, name) = randn keyed by (j, name), produced through a
real backward (loss = sum(p * G)), so the hooks, buckets, all_to_all, tree and all_gather all run.
usage: torchrun --nproc-per-node=W tests/reducer_worker.py OUT.pt TIER M BUCKET_MB SHARD [OFFLOAD [STEPS]]
(OFFLOAD 1: dist.offload_partials; STEPS: that many steps on the same gradients, to reuse the pooled buffers)
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch import nn

from dettrain.sync.collectives import CanonicalReducer
from dettrain.sync.optim import FlatAdamW, OptimConfig


def known_grad(j: int, name: str, shape) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * j + sum(map(ord, name)))
    return torch.randn(shape, generator=g) * (1 + j)


class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.zeros(3000))
        self.b = nn.Parameter(torch.zeros(37, 41))
        self.c = nn.Parameter(torch.zeros(5000))
        self.d = nn.Parameter(torch.zeros(7))


def main() -> None:
    out, tier, M, bucket_mb, shard = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), \
        sys.argv[5] == "1"
    offload = len(sys.argv) > 6 and sys.argv[6] == "1"
    steps = int(sys.argv[7]) if len(sys.argv) > 7 else 1
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = Toy()
    red = CanonicalReducer(model, rank, world, bucket_mb, tier, shard, torch.device("cpu"), offload=offload)
    L = M // world
    offloaded = []
    for _ in range(steps):
        red.begin_step(L)
        for k in range(L):
            j = rank * L + k
            red.begin_micro(k)
            loss = sum((p * known_grad(j, n, p.shape)).sum() for n, p in model.named_parameters())
            loss.backward()
            red.end_micro(k)
            if k == L - 2 and red.host is not None:  # the last pair starts next: what is still on the device
                offloaded.append({"host_partials": len(red.local.on_host), "device_spares": len(red.local.spares),
                                  "stack": len(red.local.counter.stack), "bytes": red.host.copied_out})
        red.finish(scale=1.0 / M)
    # gather the owned shards to rank 0 through the flat buffer (sharded: all_gather the grads for the check)
    if shard and world > 1:
        full = torch.zeros_like(red.grad)
        for b, (a, e) in enumerate(red.layout.buckets):
            lo, hi = red.layout.shard(b, rank)
            parts = [torch.empty(hi - lo) for _ in range(world)]
            dist.all_gather(parts, red.grad[lo:hi].clone())
            full[a:e] = torch.cat(parts)
        grad = full
    else:
        grad = red.grad
    if rank == 0:
        named = {n: grad[o : o + k].clone() for n, _, o, k in red.layout.entries}
        opt = FlatAdamW(red.param, red.grad, red.owned(), OptimConfig())  # moments only for what this rank owns
        torch.save({"grads": named, "norm": red.grad_norm(), "nbuckets": len(red.layout.buckets),
                    "opt_numel": opt.exp_avg.numel(), "padded": red.layout.padded, "offloaded": offloaded,
                    "spares_peak": red.spares_peak}, out)
    else:
        red.grad_norm()  # collective in sharded mode: every rank joins
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
