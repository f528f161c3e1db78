"""Run under torchrun: FSDP2 with bf16 compute and the canonical reduce-scatter, its rows moved in fp32 (FSDP2's
reduce dtype fp32) and in bf16 (``bf16_rows``: reduce dtype bf16, summed in fp32); rank 0 saves both variants'
gradient rows of every rank and the dtypes the ``all_to_all`` moved.
usage: torchrun --nproc-per-node=W tests/fsdp_rows_worker.py OUT.pt
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from dettrain.sync.engines import use_canonical_reduce_scatter
from dettrain.sync.fsdp import shard_model

MOVED: list[torch.dtype] = []  # the dtype of every all_to_all input, in call order


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(48, 99)  # 99 rows: FSDP2 pads the last rank's shard
        self.down = nn.Linear(99, 48)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(48, 37)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.layers:
            x = b(x)
        return self.head(x)


def gradients(bf16: bool, rank: int, world: int) -> dict[str, torch.Tensor]:
    """This rank's rows of every parameter's gradient after two micro-batches of rank-keyed data."""
    torch.manual_seed(0)
    model = Toy()
    mesh = init_device_mesh("cpu", (world,))
    units = shard_model(model, mesh, mixed_precision=True, bf16_rows=bf16)
    use_canonical_reduce_scatter(units, world, bf16=bf16)
    g = torch.Generator().manual_seed(10 + rank)
    for _ in range(2):
        # magnitudes over several decades, so a sum rounded to bf16 anywhere would show
        x = (torch.randn(5, 48, generator=g) * torch.exp(torch.empty(5, 1).uniform_(-6, 6, generator=g)))
        model(x.bfloat16()).float().square().sum().backward()
    return {name: p.grad._local_tensor.clone() for name, p in model.named_parameters()}


def main() -> None:
    out = sys.argv[1]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    real = dist.all_to_all_single

    def recording(output, input, *args, **kwargs):  # noqa: A002 (torch's own parameter names)
        MOVED.append(input.dtype)
        return real(output, input, *args, **kwargs)

    dist.all_to_all_single = recording
    result = {}
    for bf16 in (False, True):
        MOVED.clear()
        grads = gradients(bf16, rank, world)
        result["bf16" if bf16 else "fp32"] = {"grads": grads, "moved": [str(d) for d in MOVED]}
    every = [None] * world
    dist.all_gather_object(every, result)  # the shards differ in size (padding): gathered as objects
    if rank == 0:
        torch.save(every, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
