"""Tier 4 with its final partial sums in host memory (``dist.offload_partials``, loop/offload.py) on the GPU, where
the copies really run on a side stream into pinned memory: the reduced gradients are bitwise those of the tree kept
on the device, step after step (the pooled host buffers are reused), and with 4 micro-batches no spare gradient
buffer is ever allocated (the streamed pair builds in the gradient buffer and leaves it before the last pair)."""

from __future__ import annotations

import pytest
import torch
from conftest import gpu
from torch import nn

from dettrain.loop.collectives import CanonicalReducer

pytestmark = gpu


def _grads(offload: bool, L: int, steps: int = 3) -> tuple[list[torch.Tensor], CanonicalReducer]:
    torch.manual_seed(0)
    # 4 x 16.8M parameters (268 MB of fp32 gradient): the copies take milliseconds, longer than this backward, so
    # a write to the gradient buffer that did not wait for them would change bits
    model = nn.Sequential(*[nn.Linear(4096, 4096, bias=i % 2 == 0) for i in range(4)]).cuda()
    red = CanonicalReducer(model, 0, 1, 16.0, 4, False, torch.device("cuda"), offload=offload)
    out = []
    g = torch.Generator(device="cuda").manual_seed(1)
    for _ in range(steps):
        red.begin_step(L)
        for k in range(L):
            x = torch.randn(8, 4096, device="cuda", generator=g)
            red.begin_micro(k)
            torch.nn.functional.gelu(model(x)).square().mean().backward()
            red.end_micro(k)
        red.finish(scale=1.0 / L)
        out.append(red.grad.clone())
    torch.cuda.synchronize()
    return out, red


@pytest.mark.parametrize("L", [4, 8])
def test_offloaded_partials_give_the_bits_of_the_device_ones_on_the_gpu(L):
    kept, red_kept = _grads(False, L)
    off, red_off = _grads(True, L)
    for step, (a, b) in enumerate(zip(kept, off)):
        assert torch.equal(a, b), f"step {step}: {int((a != b).sum())} elements differ"
    partials = (L // 2).bit_length() - 1
    assert red_off.host.copied_out == partials * 4 * red_off.layout.padded
    assert red_kept.spares_peak == partials
    assert red_off.spares_peak == (0 if L == 4 else partials)
