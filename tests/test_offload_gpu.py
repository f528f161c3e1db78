"""Tier 4 with its partial sums in host memory (``dist.offload_partials``, sync/offload.py) on the GPU, where the
copies really run on a side stream into pinned memory.

Flat engine (one ``HostCounter`` per bucket): the reduced gradients are bitwise those of the tree kept on the device,
step after step (the host levels are reused), with every micro-batch followed by writes into every free block of the
gradient's size (a merged entry's staged copy, had the allocator handed its memory out before its copy to the host
was done, would be overwritten), and no spare gradient buffer is ever allocated (every pair builds in the gradient
buffer, which the next pair zeroes only after the copies out of it are done).

FSDP2 engine (``HostCounter``): every counter entry on the host, staged back for the merges and the finish; the
sums are ``BinaryCounter``'s on the device, bit for bit, with the pushes made on another stream (FSDP2 runs its
hooks on its reduce-scatter stream) and the freed leaves' memory overwritten at once; and whole training runs on
the GPU with and without offload give the same ledger.

The bit tests run with the copies of both directions on one side stream and on one stream each
(``DETTRAIN_OFFLOAD_STREAMS=2``): there the copies back run beside the copies out, ordered only by the waits
``HostLevels`` adds, so a missing wait would read an entry before its copy to the host is done."""

from __future__ import annotations

import pytest
import torch
from conftest import gpu
from torch import nn

from dettrain.sync.accumulate import BinaryCounter
from dettrain.sync.collectives import CanonicalReducer
from dettrain.sync.offload import HostCounter, HostLevels

pytestmark = gpu


def _overwrite_free_blocks(n: int) -> None:
    """Write into every free block of the caching allocator that holds n fp32 elements, until it has to take new
    memory from the device.  A merged entry's staged copy (L >= 8) is handed back to the allocator once its copy to
    the host is queued: if the allocator could give its memory out again before that copy is done, these writes
    would be what reaches the host."""
    held, reserved = [], torch.cuda.memory_reserved()
    while torch.cuda.memory_reserved() == reserved:
        held.append(torch.full((n,), 7.0, device="cuda").mul_(3.0))


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
            _overwrite_free_blocks(red.layout.bsize)  # a bucket: the size of a merged entry's staged copy
        red.finish(scale=1.0 / L)
        out.append(red.grad.clone())
    torch.cuda.synchronize()
    return out, red


@pytest.mark.parametrize("L, streams", [(4, "1"), (16, "1"), (16, "2")])
def test_offloaded_partials_give_the_bits_of_the_device_ones_on_the_gpu(L, streams, monkeypatch):
    """streams: DETTRAIN_OFFLOAD_STREAMS, the copies of both directions on one side stream or one each."""
    monkeypatch.setenv("DETTRAIN_OFFLOAD_STREAMS", streams)
    kept, red_kept = _grads(False, L)
    off, red_off = _grads(True, L)
    for step, (a, b) in enumerate(zip(kept, off)):
        assert torch.equal(a, b), f"step {step}: {int((a != b).sum())} elements differ"
    partials = (L // 2).bit_length() - 1
    assert red_off.host.copied_out == (L // 2 - 1) * 4 * red_off.layout.padded  # every pair but the last, once
    assert red_kept.spares_peak == partials
    assert red_off.spares_peak == 0


def _counter_sums(offload: bool, rounds: int, sizes: list[int], steps: int = 2,
                  streams: int = 1) -> tuple[list, HostLevels | None]:
    dev = torch.device("cuda")
    g = torch.Generator(device="cuda").manual_seed(3)
    host = HostLevels(sizes, dev, stage_bytes=64 * 2**20, streams=streams) if offload else None
    counters = [HostCounter(host, i) if offload else BinaryCounter() for i in range(len(sizes))]
    rs = torch.cuda.Stream()  # FSDP2 calls the hooks on its reduce-scatter stream
    out = []
    for _ in range(steps):
        for r in range(rounds):
            last = r == rounds - 1
            if offload:
                host.expect([(i, lv) for i, c in enumerate(counters) for lv in c.reads(None if last else 0)])
            with torch.cuda.stream(rs):
                for i, n in enumerate(sizes):
                    # a leaf allocated on that stream, as FSDP2's reduce-scatter output is
                    leaf = torch.randn(n, device=dev, generator=g) * 10.0 ** (r % 5 - 2)
                    if not last:
                        counters[i].push(leaf, 0)
                    elif offload:
                        counters[i].finish_(leaf)
                        out.append(leaf)
                    else:
                        counters[i].finish_(leaf, slice(None))
                        counters[i].reset()
                        out.append(leaf)
                    del leaf
                    # the allocator may hand a freed leaf's memory out again at once: a copy to the host that
                    # had not finished before this write would take these values instead
                    torch.full((n,), 7.0, device=dev).mul_(3.0)
        torch.cuda.current_stream().wait_stream(rs)
    torch.cuda.synchronize()
    return out, host


@pytest.mark.parametrize("rounds, streams", [(4, 1), (16, 1), (16, 2)])
def test_host_counter_gives_the_bits_of_the_device_counter_on_the_gpu(rounds, streams):
    # 3 x 16.8M-element shards a level (201 MB): the copies take milliseconds, longer than the pushes' kernels
    sizes = [1 << 24, 4097, 1 << 24, 1 << 24]
    kept, _ = _counter_sums(False, rounds, sizes)
    off, host = _counter_sums(True, rounds, sizes, streams=streams)
    assert host.copies.streams == streams
    for k, (a, b) in enumerate(zip(kept, off)):
        assert torch.equal(a, b), f"step {k // len(sizes)}, shard {k % len(sizes)}: {int((a != b).sum())} differ"
    levels = (rounds - 1).bit_length()
    assert sorted(host.levels) == list(range(levels)) and host.host_bytes == levels * 4 * sum(sizes)


def test_fsdp2_offloaded_partials_train_the_same_bits_on_the_gpu(tmp_path):
    """The FSDP2 engine on one GPU (NCCL, bf16 compute, compiled), 16 micro-batches a step: 8 pairs, so the
    counter reads entries back at levels 1-3; the ledger with dist.offload_partials equals the one without."""
    import json

    from conftest import train

    job = ("model.dim=256", "model.n_layers=2", "model.n_heads=4", "model.seq_len=256", "train.global_batch=16",
           "train.micro_batch=1", "train.compile=true", "det.tier=4", "dist.engine=fsdp2")
    train(tmp_path / "kept", *job)
    train(tmp_path / "off", *job, "dist.offload_partials=true")

    def steps(d):
        lines = [json.loads(x) for x in (d / "ledger.jsonl").read_text().splitlines()]
        return [x for x in lines if x.get("kind") == "step"]

    kept, off = steps(tmp_path / "kept"), steps(tmp_path / "off")
    assert len(kept) == 4 and kept == off
