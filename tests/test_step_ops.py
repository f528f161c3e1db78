"""What the canonical engines add to a micro-batch, counted in dispatched ops (not timed).

A micro-batch's forward and backward under tier 3 (flat engine, one left fold into bound views of the flat gradient)
and tier 4 (flat engine, binary counter over pairs) dispatch at most a fixed number of ops more than tier 0 (the
DDP engine, torch's own accumulation) for the same model, and that number does not grow with the model's parameter
tensors: the accumulation is autograd's own in-place add into memory the engine bound before the backward, never a
copy or a Python pass per parameter per micro-batch.  Counted with a TorchDispatchMode over real engines on the
CPU (world 1), for a 1-layer and a 4-layer model (11 and 38 parameter tensors)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dettrain import dist as D
from dettrain.models.llama import ModelConfig, build_model
from dettrain.sync.engines import engine_class

M = 8  # micro-batches a step


class CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def _cfg(tier: int, layers: int):
    from dettrain.config import Config, TrainConfig
    from dettrain.determinism import DetConfig

    mcfg = ModelConfig(dim=64, n_layers=layers, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=256, seq_len=32)
    return Config(model=mcfg, train=TrainConfig(global_batch=2 * M, micro_batch=2, compile=False),
                  det=DetConfig(tier=tier))


def ops_per_micro_batch(tier: int, layers: int) -> list[int]:
    """Ops dispatched by each micro-batch's forward, loss and backward (engine hooks included) in the second of two
    steps (the first makes what an engine keeps across steps)."""
    cfg = _cfg(tier, layers)
    info = D.DistInfo(0, 1, 0, torch.device("cpu"), None)
    model = build_model(cfg.model, 0, "cpu")
    eng = engine_class(cfg).from_config(cfg, model, info, mixed_precision=False)
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        counts = []
        eng.begin_step(M)
        for k in range(M):
            tok = torch.randint(0, 256, (2, 33), generator=g)
            with CountOps() as c, eng.micro(k):
                logits = eng.forward_module(tok[:, :-1])
                loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), tok[:, 1:].reshape(-1))
                eng.backward(loss, k)
            counts.append(c.n)
        eng.reduce(1.0 / M)
        eng.step(1e-3)
    eng.close()
    return counts


@pytest.mark.parametrize("tier,bound", [(3, 0), (4, 2)])
def test_canonical_accumulation_adds_a_fixed_number_of_ops_per_micro_batch(tier, bound):
    added = {}
    for layers in (1, 4):
        base = ops_per_micro_batch(0, layers)
        ours = ops_per_micro_batch(tier, layers)
        # every micro-batch but the last (which launches the buckets: once a step, not per micro-batch)
        added[layers] = [o - b for o, b in zip(ours[:-1], base[:-1])]
    for layers, extra in added.items():
        assert max(extra) <= bound, (layers, extra)
    # the same count for 11 and 38 parameter tensors: nothing per parameter
    assert added[1] == added[4], added
