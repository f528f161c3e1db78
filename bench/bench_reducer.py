"""Canonical reducer throughput vs dist.all_reduce on the same buffers (run under torchrun).

    torchrun --standalone --nproc-per-node=2 bench/bench_reducer.py --sizes-mb 1 4 16 64 256

For each size: one flat fp32 gradient of that many MiB; the reducer's full path (copy into the flat buffer, bucketed
all_to_all, fixed-order tree sum, all_gather; dist.bucket_mb=25 as default) against one dist.all_reduce of a buffer
of the same size. Reports the median of --iters timings as algorithm bandwidth (bytes / time, nccl-tests' algbw)
and the ratio reducer/all_reduce.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dettrain.sync.collectives import CanonicalReducer  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes-mb", type=float, nargs="+", default=[1, 4, 16, 64, 256])
    ap.add_argument("--iters", type=int, default=7)
    ap.add_argument("--bucket-mb", type=float, default=25.0)
    ap.add_argument("--backend", default="gloo", choices=["gloo", "nccl"], help="nccl: one GPU per rank")
    args = ap.parse_args()
    torch.set_num_threads(1)
    dev = torch.device("cpu")
    if args.backend == "nccl":
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(dev)
    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    rows = []
    for mb in args.sizes_mb:
        n = int(mb * 2**20) // 4
        model = nn.Linear(1, 1, bias=False)
        model.weight = nn.Parameter(torch.zeros(n, device=dev))
        red = CanonicalReducer(model, rank, world, args.bucket_mb, 3, False, dev)
        g = torch.randn(n, generator=torch.Generator().manual_seed(rank)).to(dev)
        buf = g.clone()
        t_ar, t_red = [], []
        for _ in range(args.iters + 1):
            buf.copy_(g)
            sync()
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(buf)
            sync()
            t_ar.append(time.perf_counter() - t0)
            grad = g.clone()  # as autograd would leave it; end_micro moves it into the flat buffer
            sync()
            dist.barrier()
            t0 = time.perf_counter()
            red.begin_step(1)
            red.begin_micro(0)
            model.weight.grad = grad
            red.end_micro(0)
            red.finish(scale=1.0)
            sync()
            t_red.append(time.perf_counter() - t0)
        ar, rd = statistics.median(t_ar[1:]), statistics.median(t_red[1:])
        nbytes = n * 4
        rows.append((mb, nbytes / ar / 1e9, nbytes / rd / 1e9, ar / rd, len(red.layout.buckets)))
        del red, model
    if rank == 0:
        print(f"world {world}, {args.backend}, bucket {args.bucket_mb} MiB, median of {args.iters}")
        print("| size MiB | all_reduce algbw GB/s | reducer algbw GB/s | reducer / all_reduce | buckets |")
        print("|---|---|---|---|---|")
        for mb, a, r, ratio, nb in rows:
            print(f"| {mb:g} | {a:.2f} | {r:.2f} | {ratio:.2f} | {nb} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
