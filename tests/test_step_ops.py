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


def train_and_fingerprint(eng, steps: int, m: int, g: torch.Generator, mixed: bool = False) -> dict:
    """``steps`` steps of ``m`` micro-batches of 2 x 32 random tokens through the engine's own step; returns the
    canonical fingerprints (the ledger's) of the last step's reduced gradient and updated parameters."""
    for _ in range(steps):
        eng.begin_step(m)
        for k in range(m):
            tok = torch.randint(0, 256, (2, 33), generator=g)
            with eng.micro(k), eng.autocast(eng.info.device, mixed):
                logits = eng.forward_module(tok[:, :-1])
                loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, 256), tok[:, 1:].reshape(-1))
                eng.backward(loss, k)
        eng.reduce(1.0 / m)
        fp = eng.partials(("grad",), False).resolve().totals
        eng.step(1e-3)
    return {**fp, **eng.partials(("param",), False).resolve().totals}


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


@pytest.mark.parametrize("tier,per_step", [(3, 4), (4, None)])
def test_fsdp2_sets_its_accumulation_flags_only_when_they_change(monkeypatch, tier, per_step):
    """FSDP2 on one rank skips the reduce-scatter and the reshard between micro-batches through two setters that
    each walk every module of the model; the engine calls them only when a value changes.  Tier 3: off at the
    first micro-batch, on at the last (4 walks a step whatever M); tier 4: the reshard flag twice a step, the sync
    flag at every micro-batch (it reduces pairs).  Also a clean run: one FSDP2 step's bits equal the flat engine's
    (a flag left off would skip a reduction)."""
    from torch.distributed.fsdp import FSDPModule

    walks: list[str] = []
    for name in ("set_requires_gradient_sync", "set_reshard_after_backward"):
        real = getattr(FSDPModule, name)
        monkeypatch.setattr(FSDPModule, name, lambda self, *a, _n=name, _r=real, **k: (walks.append(_n),
                                                                                      _r(self, *a, **k))[1])
    counts = {}
    for m in (8, 16):
        from dettrain.config import Config, TrainConfig
        from dettrain.determinism import DetConfig

        mcfg = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=256, seq_len=32)
        cfg = Config(model=mcfg, train=TrainConfig(global_batch=2 * m, micro_batch=2, compile=False),
                     det=DetConfig(tier=tier))
        info = D.DistInfo(0, 1, 0, torch.device("cpu"), None)
        grads = {}
        for engine in ("fsdp2", "flat"):
            cfg.dist.engine = engine
            model = build_model(cfg.model, 0, "cpu")
            eng = engine_class(cfg).from_config(cfg, model, info, mixed_precision=False)
            walks.clear()
            grads[engine] = train_and_fingerprint(eng, 2, m, torch.Generator().manual_seed(0))
            if engine == "fsdp2":
                counts[m] = len(walks) / 2
            eng.close()
        assert grads["fsdp2"] == grads["flat"], m  # the second step's reduced gradient and parameters, bit for bit
    if per_step is not None:
        assert counts == {8: per_step, 16: per_step}, counts
    else:  # tier 4: 2 reshard walks and M sync walks a step
        assert counts == {8: 2 + 8, 16: 2 + 16}, counts


def test_fsdp2_on_one_rank_gathers_into_the_same_memory_every_step(monkeypatch):
    """FSDP2 on one rank keeps its gathered parameters' memory between steps (engines/fsdp2.py ``keep_gathered``):
    every forward of every step reads a block's weight at one address, which is what lets train.cuda_graphs replay
    the compiled blocks under FSDP2 (a graph reads its parameters where it was captured; on the GPU FSDP2's own
    free-and-allocate moved them and re-recorded the graphs at every step).  With dist.reshard_after_forward=true
    the engine leaves FSDP2's freeing alone (that setting asks for the memory back after each forward).  Both with
    a unit per block and with the default units (here the root's one unit, DETTRAIN_FSDP2_UNITS)."""
    from dettrain.config import Config, TrainConfig
    from dettrain.determinism import DetConfig
    from dettrain.sync.engines.fsdp2 import UNITS_ENV

    mcfg = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=256, seq_len=32)
    info = D.DistInfo(0, 1, 0, torch.device("cpu"), None)
    for reshard, units in (("auto", "blocks"), ("auto", "auto"), (True, "auto")):
        monkeypatch.setenv(UNITS_ENV, units)
        cfg = Config(model=mcfg, train=TrainConfig(global_batch=4, micro_batch=2, compile=False),
                     det=DetConfig(tier=3))
        cfg.dist.engine, cfg.dist.reshard_after_forward = "fsdp2", reshard
        model = build_model(cfg.model, 0, "cpu")
        eng = engine_class(cfg).from_config(cfg, model, info, mixed_precision=False)
        seen: list[tuple[int, int]] = []

        def record(m, args, seen=seen):
            seen.append((m.weight.data_ptr(), m.weight.untyped_storage().nbytes()))

        hook = model.layers[1].attn.wq.register_forward_pre_hook(record)
        train_and_fingerprint(eng, 3, 2, torch.Generator().manual_seed(0))
        hook.remove()
        assert len(seen) == 6 and all(n == 64 * 64 * 4 for _, n in seen)  # the whole fp32 weight each time
        if reshard == "auto":  # one rank: not resharded after forward, so the memory is kept
            assert eng.kept_gathered
            assert len({p for p, _ in seen}) == 1, seen
        else:
            assert not eng.kept_gathered
        eng.close()


@pytest.mark.parametrize("tier", [3, 4])
def test_fsdp2_units_of_several_blocks_on_one_rank_change_no_bit(monkeypatch, tier):
    """DETTRAIN_FSDP2_UNITS (engines/fsdp2.py ``blocks_per_unit``) shards consecutive blocks together as one FSDP2
    unit on one rank, so FSDP2's hooks run once a unit instead of once a block.  The reduced gradients and the
    updated parameters after two steps of 8 micro-batches (the ledger's fingerprints) are the same with a unit per
    block, two blocks a unit, and the whole model as the root's one unit, with fp32 and with bf16 compute; and
    FSDP2's post-forward hook (reshard and pre-backward registration) runs once a unit a micro-batch (counted), not
    once a block.  (Its pre-forward hook runs on every module of a unit of several, its work gated to once a unit:
    torch's ``_register_group_forward_hooks``; so one unit for the whole model saves the most.)"""
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    from dettrain.config import Config, TrainConfig
    from dettrain.determinism import DetConfig
    from dettrain.sync.engines.fsdp2 import UNITS_ENV

    calls = []
    post_forward = FSDPState._post_forward

    def counted(self, *args, **kwargs):  # bound into each unit's hooks by fully_shard, so patched before it
        calls.append(1)
        return post_forward(self, *args, **kwargs)

    monkeypatch.setattr(FSDPState, "_post_forward", counted)

    mcfg = ModelConfig(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=256, seq_len=32)
    cfg = Config(model=mcfg, train=TrainConfig(global_batch=16, micro_batch=2, compile=False), det=DetConfig(tier=tier))
    cfg.dist.engine = "fsdp2"
    info = D.DistInfo(0, 1, 0, torch.device("cpu"), None)
    for mixed in (False, True):
        seen = {}
        for units, n_units in (("blocks", 5), ("2", 3), ("root", 1)):
            monkeypatch.setenv(UNITS_ENV, units)
            model = build_model(cfg.model, 0, "cpu")
            eng = engine_class(cfg).from_config(cfg, model, info, mixed_precision=mixed)
            assert len(eng.units) == n_units and eng.kept_gathered
            calls.clear()
            seen[units] = train_and_fingerprint(eng, 2, 8, torch.Generator().manual_seed(0), mixed)
            assert len(calls) == n_units * 2 * 8, (units, len(calls))  # 2 steps of 8 micro-batches
            eng.close()
        assert seen["2"] == seen["blocks"] and seen["root"] == seen["blocks"], (mixed, seen)


def test_fsdp2_units_auto_groups_small_blocks_on_one_rank_only(monkeypatch):
    """``auto`` (the default) groups blocks under SMALL_BLOCK parameters into the fewest units of consecutive blocks
    within UNIT_PARAMS parameters each, as even as they go (one unit with the root's own parameters where all of
    them fit), on one rank without resharding after forward; on several ranks or with resharding, one block a unit.
    The other values are taken as given where they apply and refused, naming the variable and the fix, where they do
    not."""
    from dettrain.errors import UserError
    from dettrain.sync.engines.fsdp2 import SMALL_BLOCK, UNIT_PARAMS, UNITS_ENV, blocks_per_unit

    monkeypatch.delenv(UNITS_ENV, raising=False)
    block_125m = 4 * 768 * 768 + 3 * 768 * 2048 + 2 * 768  # 12 of them, 7.1M parameters each
    block_1b = 2048 * 2048 * 2 + 2 * 2048 * 256 + 3 * 2048 * 5632 + 2 * 2048  # 22 of them, 44M each
    assert blocks_per_unit(1, False, block_125m, 12, 2 * 32000 * 768) == 0  # the whole model fits: the root's unit
    assert blocks_per_unit(1, False, block_125m, 12, UNIT_PARAMS) == 12  # the blocks fit, the root beside them not
    assert block_1b >= SMALL_BLOCK and blocks_per_unit(1, False, block_1b, 22, 2 * 32000 * 2048) == 1  # not small
    assert blocks_per_unit(1, False, 5, 22) == 0
    assert blocks_per_unit(1, False, SMALL_BLOCK - 1, 17) == 6  # 8 a unit at most: 3 units, evened out: 6, 6, 5
    assert blocks_per_unit(2, False, block_125m, 12) == 1 and blocks_per_unit(1, True, block_125m, 12) == 1
    for value, want in (("auto", 0), ("blocks", 1), ("3", 3), ("root", 0)):
        monkeypatch.setenv(UNITS_ENV, value)
        assert blocks_per_unit(1, False, block_125m, 12) == want
    monkeypatch.setenv(UNITS_ENV, "blocks")
    assert blocks_per_unit(2, False, block_125m, 12) == 1
    for value in ("root", "2"):
        monkeypatch.setenv(UNITS_ENV, value)
        for world, reshard in ((2, False), (1, True)):
            with pytest.raises(UserError, match=rf"DETTRAIN_FSDP2_UNITS={value} .* unset DETTRAIN_FSDP2_UNITS"):
                blocks_per_unit(world, reshard, block_125m, 12)
    for value in ("layers", "0", "-1"):
        monkeypatch.setenv(UNITS_ENV, value)
        with pytest.raises(UserError, match=rf"DETTRAIN_FSDP2_UNITS='{value}' must be auto .* root"):
            blocks_per_unit(1, False, block_125m, 12)
