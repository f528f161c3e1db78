"""Tensors saved by name from pieces of a flat buffer: rectangular chunks of one global tensor per name.

The flat engine holds its parameters and AdamW moments as one flat fp32 buffer, each rank its bucket shards, whose
boundaries cut parameters anywhere.  A flat range [lo, hi) of a row-major tensor is a union of a few rectangular
boxes (a partial row, whole rows, a partial row, recursively by dimension), each one contiguous in the buffer.
``boxes`` computes them; ``Chunks`` is a global tensor given as such boxes (views into the buffer, no copy).

DCP's default planners know only whole tensors, DTensors and ShardedTensors; ``ChunkSavePlanner`` adds one
``WriteItem`` per box (type SHARD, the box's offsets within the global shape), so DCP's coordinator records one
``TensorStorageMetadata`` per name, whose chunks are the boxes of every rank; DCP checks that they tile the tensor
without overlap.  Plain DCP then reads ``<name>`` as one tensor of its global shape (``dcp.load`` of a tensor,
``dcp_to_torch_save``), resharding as it does for DTensors.  ``ChunkLoadPlanner`` reads any set of boxes back
(straight into the buffer), whatever boxes the checkpoint was saved in.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass

import torch

Offsets = tuple[int, ...]
NAMED = (("param", "model/{}"), ("exp_avg", "optim/{}/exp_avg"), ("exp_avg_sq", "optim/{}/exp_avg_sq"))
"""The flat engine's buffers and the DCP key of each parameter's part of them: the names the DDP and FSDP2 engines
save too (``model/<name>``, ``optim/<name>/<moment>``)."""


@dataclass
class Chunks:
    """A global tensor of shape ``size`` of which this rank holds ``parts``: (offsets, tensor of the box's shape)."""

    size: tuple[int, ...]
    parts: list[tuple[Offsets, torch.Tensor]]


def boxes(shape: tuple[int, ...], lo: int, hi: int) -> list[tuple[Offsets, tuple[int, ...], int]]:
    """The flat range [lo, hi) of a row-major tensor of ``shape`` as boxes (offsets, sizes, flat start), in order;
    each box is contiguous in the flat index space and the boxes tile [lo, hi)."""
    if lo >= hi:
        return []
    if not shape:
        return [((), (), 0)]
    if len(shape) == 1:
        return [((lo,), (hi - lo,), lo)]
    inner = math.prod(shape[1:])
    out = []
    r = lo // inner
    if lo % inner:  # a partial first row
        end = min(hi, (r + 1) * inner)
        out += [((r, *o), (1, *s), r * inner + f) for o, s, f in boxes(shape[1:], lo - r * inner, end - r * inner)]
        r += 1
        if end == hi:
            return out
    full = hi // inner
    if full > r:  # whole rows
        out.append(((r, *(0,) * (len(shape) - 1)), (full - r, *shape[1:]), r * inner))
    if hi % inner:  # a partial last row
        out += [((full, *o), (1, *s), full * inner + f) for o, s, f in boxes(shape[1:], 0, hi - full * inner)]
    return out


def flat_chunks(shape: tuple[int, ...], flat: torch.Tensor, lo: int, hi: int) -> list[tuple[Offsets, torch.Tensor]]:
    """Boxes of elements [lo, hi) of a tensor of ``shape`` whose elements [lo, hi) are ``flat`` (1-D, hi - lo
    long), as views of ``flat``."""
    return [(o, flat[f - lo : f - lo + math.prod(s)].view(s)) for o, s, f in boxes(tuple(shape), lo, hi)]


def named_chunks(entries, regions: dict[str, list[tuple[int, int]]], view) -> dict[str, Chunks]:
    """The chunks of every name of ``NAMED`` that lie inside ``regions[buffer]`` (global flat ranges [a, b)):
    ``entries`` are (name, parameter, offset, numel) in offset order (collectives.FlatLayout at world 1), ``view(
    buffer, lo, hi)`` gives elements [lo, hi) of a buffer.  Names with no part here are left out."""
    import bisect

    starts = [off for _, _, off, _ in entries]
    out: dict[str, Chunks] = {}
    for buf, fmt in NAMED:
        for a, b in regions[buf]:
            i = max(bisect.bisect_right(starts, a) - 1, 0)  # the first parameter that can overlap [a, b)
            while i < len(entries) and entries[i][2] < b:
                name, p, off, k = entries[i]
                lo, hi = max(a, off), min(b, off + k)
                if lo < hi:
                    c = out.setdefault(fmt.format(name), Chunks(tuple(p.shape), []))
                    c.parts += flat_chunks(tuple(p.shape), view(buf, lo, hi), lo - off, hi - off)
                i += 1
    return out


def _index(fqn: str, offsets) -> tuple[str, Offsets]:
    return fqn, tuple(int(x) for x in offsets)


def save_planner(chunks: dict[str, Chunks]):
    """DCP's DefaultSavePlanner plus one SHARD write item per box of ``chunks``."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    by = {_index(fqn, o): t for fqn, c in chunks.items() for o, t in c.parts}

    class ChunkSavePlanner(DefaultSavePlanner):
        def create_local_plan(self):
            plan = super().create_local_plan()
            items = list(plan.items)
            for fqn, c in chunks.items():
                for o, t in c.parts:
                    off = torch.Size(o)
                    items.append(WriteItem(
                        index=MetadataIndex(fqn, off), type=WriteItemType.SHARD,
                        tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=off, sizes=t.size()),
                                                    properties=TensorProperties.create_from_tensor(t),
                                                    size=torch.Size(c.size))))
            self.plan = dataclasses.replace(plan, items=items)
            return self.plan

        def lookup_object(self, index):
            key = _index(index.fqn, index.offset or ())
            return by[key] if key in by else super().lookup_object(index)

    return ChunkSavePlanner()


def load_planner(chunks: dict[str, Chunks]):
    """DCP's DefaultLoadPlanner plus reads of every box of ``chunks`` (each name must be in the checkpoint)."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    by = {_index(fqn, o): t for fqn, c in chunks.items() for o, t in c.parts}

    class ChunkLoadPlanner(DefaultLoadPlanner):
        def create_local_plan(self):
            plan = super().create_local_plan()
            items = list(plan.items)
            for fqn, c in chunks.items():
                local = [ChunkStorageMetadata(offsets=torch.Size(o), sizes=t.size()) for o, t in c.parts]
                items += create_read_items_for_chunk_list(fqn, self.metadata.state_dict_metadata[fqn], local)
            return dataclasses.replace(plan, items=items)

        def lookup_tensor(self, index):
            key = _index(index.fqn, index.offset or ())
            return by[key] if key in by else super().lookup_tensor(index)

    return ChunkLoadPlanner()


def split(sd: dict) -> tuple[dict, dict[str, Chunks]]:
    """A state dict whose values are tensors or ``Chunks`` -> (the plain part, the chunked part)."""
    return ({k: v for k, v in sd.items() if not isinstance(v, Chunks)},
            {k: v for k, v in sd.items() if isinstance(v, Chunks)})


# ---- reading: the saved layouts of the flat engine's buffers ------------------------------------------------------
PIECE_RE = re.compile(r"^flat/(param|exp_avg|exp_avg_sq)/(\d+)-(\d+)$")
"""A piece ``flat/<buffer>/<lo>-<hi>`` of the earlier flat format (elements [lo, hi) of a flat buffer)."""


def has_pieces(md) -> bool:
    """Whether DCP metadata ``md`` is of the earlier flat format (pieces, not names)."""
    return any(PIECE_RE.match(k) for k in md.state_dict_metadata)


def needed_pieces(pieces: dict[str, list[tuple[int, int, str]]], regions: list[tuple[int, int]]):
    """The pieces (lo, hi, key) of each buffer that overlap ``regions``."""
    return {name: [(a, b, k) for a, b, k in lst if any(a < hi and lo < b for lo, hi in regions)]
            for name, lst in pieces.items()}


def plan_pieces(md, path, N: int) -> dict[str, list[tuple[int, int, str]]]:
    """The saved pieces of each flat buffer, checked to tile [0, N) exactly."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from dettrain.checkpoint.errors import CheckpointError, CorruptCheckpoint

    pieces: dict[str, list[tuple[int, int, str]]] = {"param": [], "exp_avg": [], "exp_avg_sq": []}
    for key, tmd in md.state_dict_metadata.items():
        m = PIECE_RE.match(key)
        if not m:
            continue
        a, b = int(m.group(2)), int(m.group(3))
        if not isinstance(tmd, TensorStorageMetadata) or tmd.properties.dtype != torch.float32 or \
                tuple(tmd.size) != (b - a,):
            raise CorruptCheckpoint(f"checkpoint {path}: entry {key} is not a float32 tensor of {b - a} elements")
        pieces[m.group(1)].append((a, b, key))
    for name, lst in pieces.items():
        lst.sort()
        pos = 0
        for a, b, key in lst:
            if a != pos:
                raise CorruptCheckpoint(f"checkpoint {path}: {name} pieces do not tile [0, {N}) (gap or overlap "
                                        f"at {pos}, next piece {key})")
            pos = b
        if pos != N:
            raise CheckpointError(f"checkpoint {path} holds {pos} elements of {name}, this model has {N}; "
                                  "the model shape differs")
    return pieces


def check_named(md, path, entries) -> str:
    """A flat-engine checkpoint by name holds every name of ``NAMED`` as a float32 tensor of its parameter's
    shape; "named" when it does, CheckpointError naming the first that differs otherwise."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from dettrain.checkpoint.errors import CheckpointError

    for _, fmt in NAMED:
        for name, p, _, _ in entries:
            tmd = md.state_dict_metadata.get(fmt.format(name))
            if not isinstance(tmd, TensorStorageMetadata) or tmd.properties.dtype != torch.float32 or \
                    tuple(tmd.size) != tuple(p.shape):
                have = tuple(tmd.size) if isinstance(tmd, TensorStorageMetadata) else None
                raise CheckpointError(f"checkpoint {path}: {fmt.format(name)} is {'missing' if have is None else have}"
                                      f" there, a float32 tensor of shape {tuple(p.shape)} here; the model differs")
    return "named"
