"""FSDP2 wrapping of a model: ``fully_shard`` per transformer block, then the root (ZeRO-3).

Shared by the FSDP2 engine (engines.py) and the memory planner (tools/memory.py), so both shard the same way.
Blocks are the entries of ``model.layers`` (dettrain's LLaMA, most Hugging Face decoders under
``model.model.layers``); a model without such a list is sharded as one unit at the root.
"""

from __future__ import annotations

import torch
from torch import nn


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks FSDP2 shards one by one (each all-gathered just before it runs, freed after)."""
    for holder in (model, getattr(model, "model", None)):
        layers = getattr(holder, "layers", None) if holder is not None else None
        if isinstance(layers, (nn.ModuleList, nn.Sequential)):
            return list(layers)
    return []


def mp_policy(mixed_precision: bool):
    """bf16 compute with fp32 gradient reduction and fp32 master weights, or everything fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    # cast_forward_inputs off: activations arrive in bf16 from the bf16 embedding anyway, and the RoPE tables a
    # block is given stay fp32 (cast, they would lose precision, and recomputation would see other inputs)
    if mixed_precision:
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False)
    return MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32, cast_forward_inputs=False)


def shard_model(model: nn.Module, mesh, *, mixed_precision: bool, reshard_after_forward: bool = True) -> list:
    """``fully_shard`` every block, then the root, on the 1-D ``mesh``; returns the FSDP modules, root last.

    One parameter group per ``fully_shard`` call: each block's gradients are reduce-scattered as one flat buffer
    as soon as its backward is done; the root holds the embeddings, the final norm and the output projection."""
    from torch.distributed.fsdp import fully_shard

    policy = mp_policy(mixed_precision)
    units = []
    for block in transformer_blocks(model):
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
        units.append(block)
    # the root is needed again right after the last block's backward: keep it unsharded after forward
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
    units.append(model)
    return units
