"""FSDP2 wrapping of a model: ``fully_shard`` per transformer block, then the root (ZeRO-3).

Shared by the FSDP2 engine (engines/fsdp2.py) and the memory planner (tools/memory.py), so both shard the same way.
Blocks are what ``transformer_blocks`` finds (dettrain's LLaMA ``layers``, a Hugging Face decoder's
``model.layers``, any list of identical blocks); a model without one is sharded as one unit at the root.
train.compile compiles the same blocks one by one (compile.py).
"""

from __future__ import annotations

import torch
from torch import nn

# where the block list of the models dettrain knows lives: its own LLaMA (``layers``), a transformers
# *ForCausalLM (``model.layers``) and dettrain.models.hf.HFCausalLM, which holds one under ``hf``
BLOCK_PATHS = ("layers", "model.layers", "hf.model.layers")


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of ``model``: the units FSDP2 shards one by one (each all-gathered just before it runs,
    freed after) and train.compile compiles one by one.

    The first of ``BLOCK_PATHS`` that is an ``nn.ModuleList``/``nn.Sequential``; else every ``nn.ModuleList`` of
    two or more identical blocks (same class, same parameter names and shapes), outermost first in module order
    (a list inside a found block is part of that block); else none.  A function of the module tree only, so every
    rank and every rerun finds the same blocks."""
    for path in BLOCK_PATHS:
        holder: nn.Module | None = model
        for part in path.split("."):
            holder = getattr(holder, part, None) if holder is not None else None
        if isinstance(holder, (nn.ModuleList, nn.Sequential)):
            return list(holder)
    blocks: list[nn.Module] = []
    inside: list[str] = []  # names of lists already taken: their descendants are parts of those blocks
    for name, mod in model.named_modules():
        if any(p == "" or name.startswith(p + ".") for p in inside):
            continue
        if (isinstance(mod, nn.ModuleList) and len(mod) >= 2 and len({block_signature(b) for b in mod}) == 1
                and next(iter(mod.parameters()), None) is not None):
            blocks.extend(mod)
            inside.append(name)
    return blocks


def block_signature(block: nn.Module) -> tuple:
    """What makes blocks identical: their class and their parameters' names, shapes and dtypes."""
    return (type(block), tuple((n, tuple(p.shape), p.dtype) for n, p in block.named_parameters()))


def mp_policy(mixed_precision: bool, *, bf16_rows: bool = False):
    """bf16 compute with fp32 gradient reduction and fp32 master weights, or everything fp32.

    ``bf16_rows`` (bf16 compute only, with the canonical reduce-scatter, engines/fsdp2.py): FSDP2's reduce dtype is
    the gradients' own bf16, so its copy-in into the reduce-scatter input is a plain copy, not a cast to fp32; the
    canonical reduce-scatter then sums those rows in fp32 into fp32 shards, the same bits as fp32 rows (widening
    bf16 is exact).  Never with FSDP2's own reduce-scatter, which would sum in bf16."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    # cast_forward_inputs off: activations arrive in bf16 from the bf16 embedding anyway, and the RoPE tables a
    # block is given stay fp32 (cast, they would lose precision, and recomputation would see other inputs)
    if mixed_precision:
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                    reduce_dtype=torch.bfloat16 if bf16_rows else torch.float32,
                                    cast_forward_inputs=False)
    return MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32, cast_forward_inputs=False)


def shard_model(model: nn.Module, mesh, *, mixed_precision: bool, reshard_after_forward: bool = True,
                bf16_rows: bool = False, blocks_per_unit: int = 1) -> list:
    """``fully_shard`` the blocks, then the root, on the 1-D ``mesh``; returns the FSDP modules, root last.

    One parameter group per ``fully_shard`` call: each unit's gradients are reduce-scattered as one flat buffer as
    soon as its backward is done; the root holds the embeddings, the final norm and the output projection.
    ``bf16_rows``: see ``mp_policy``. ``blocks_per_unit``: consecutive blocks sharded together as one unit
    (``fully_shard`` of a list: FSDP2's post-forward and backward hooks run once a unit, not once a block); 0: the
    root only, one parameter group for the whole model. engines/fsdp2.py ``blocks_per_unit`` chooses it
    (``DETTRAIN_FSDP2_UNITS``)."""
    from torch.distributed.fsdp import fully_shard

    policy = mp_policy(mixed_precision, bf16_rows=bf16_rows)
    blocks = list(transformer_blocks(model)) if blocks_per_unit > 0 else []
    units = []
    for i in range(0, len(blocks), max(blocks_per_unit, 1)):
        group = blocks[i:i + blocks_per_unit]
        fully_shard(group if len(group) > 1 else group[0], mesh=mesh, mp_policy=policy,
                    reshard_after_forward=reshard_after_forward)
        units.append(group[0])  # one module of the unit: they share its FSDP state
    # the root is needed again right after the last block's backward: keep it unsharded after forward
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
    units.append(model)
    return units
