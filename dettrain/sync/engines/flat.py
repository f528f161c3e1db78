"""``dist.engine=flat``: dettrain's canonical reducer over one flat fp32 buffer (collectives.py) + FlatAdamW;
optionally ZeRO-1 (``dist.shard_optimizer``).  Sums canonically at every tier (``auto`` from tier 3 on)."""

from __future__ import annotations

import torch

from dettrain.record.fingerprint import combine, segment_fingerprints
from dettrain.sync.collectives import CanonicalReducer
from dettrain.sync.engines.base import OPTIM, Engine, _hash, register
from dettrain.sync.optim import FlatAdamW


@register
class FlatEngine(Engine):
    """dettrain's canonical reducer over one flat fp32 buffer and FlatAdamW (optionally sharded: ZeRO-1)."""

    name = "flat"
    state_kind = "flat"
    canonical_bits = True
    shards_optimizer = True  # ZeRO-1 (dist.shard_optimizer)
    offloads_partials = True  # at tier 4 (dist.offload_partials)
    cuda_graphs = True  # parameters are views of one flat buffer; backward accumulates into bound views of another

    def __init__(self, model, info, tier, optim, bucket_mb: float, shard: bool, *,
                 mixed_precision: bool = False, offload_partials: bool = False) -> None:
        super().__init__(model, info, tier, optim, mixed_precision=mixed_precision)
        # the reducer sums canonically at every tier: below the canonical tiers at the lowest one
        self.reducer = CanonicalReducer(model, info.rank, info.world, bucket_mb, self.policy.summing_tier, shard,
                                        info.device, offload=offload_partials)
        # no-decay parameters as global flat ranges: offsets of the canonical layout, the same for every world size
        no_decay = [(o, o + k) for n, _, o, k in self.layout.entries if n in self.no_decay]
        self.opt = FlatAdamW(self.reducer.param, self.reducer.grad, self.reducer.owned(), optim, no_decay)

    @classmethod
    def from_config(cls, cfg, model, info, *, mixed_precision):
        return cls(model, info, cfg.det.tier, cfg.optim, cfg.dist.bucket_mb, cfg.dist.shard_optimizer,
                   mixed_precision=mixed_precision, offload_partials=cfg.dist.offload_partials)

    def begin_step(self, n_micro):
        super().begin_step(n_micro)
        self.reducer.begin_step(n_micro)

    def backward(self, loss, k):
        self.reducer.begin_micro(k)
        loss.backward()  # buckets launch from the hooks during the last micro-batch's backward
        self.reducer.end_micro(k)

    def reduce(self, scale):
        self.reducer.finish(scale=scale)
        return self.reducer.grad_norm_tensor()  # on the device: no host sync before the update

    def grad_parts(self):
        return [self.reducer.grad[a:b] for a, b in self.reducer.owned()]

    def freeze(self, names):
        super().freeze(names)
        self.opt.freeze([(o, o + k) for n, _, o, k in self.layout.entries if n in self.frozen])

    def step(self, lr):
        self.opt.step(lr)
        self.reducer.gather_params()

    def partials(self, keys, per_tensor):
        r, N = self.reducer, self.layout.numel
        # each rank hashes its bucket shards (its own when sharded; any split works when every rank holds all):
        # the work is spread over the ranks and the integer partials add up exactly
        regions = [(a, min(b, N)) for a, b in r.layout.own_shards(self.info.rank) if a < N]
        views = {"grad": lambda a, b: [(r.grad[a:b], a)], "param": lambda a, b: [(r.param[a:b], a)],
                 "opt": lambda a, b: [(self.opt.view("exp_avg", a, b), a),
                                      (self.opt.view("exp_avg_sq", a, b), N + a)]}
        parts = [(key, "", t, off) for key in keys for a, b in regions for t, off in views[key](a, b)]
        out = _hash(parts, keys, False)
        if per_tensor:
            segs = self.layout.segments()
            for key in keys:
                if key == "opt":
                    continue
                local: dict[str, int] = {}
                for a, b in regions:
                    for name, v in segment_fingerprints(views[key](a, b)[0][0], a, segs).items():
                        local[name] = combine([local.get(name, 0), v])
                out.tensors[key] = local
        return out

    # ---- checkpoint: one global tensor per name, saved and read as boxes of the flat buffers (chunks.py) ---------
    def state_dict(self):
        # one global tensor per name (model/<name>, optim/<name>/exp_avg, optim/<name>/exp_avg_sq), of the
        # parameter's shape: each rank saves the boxes of its bucket shards (checkpoint/chunks.py), so a sharded
        # optimizer is saved by the ranks that hold it, writes are spread over ranks otherwise, and plain DCP
        # reads every name as one tensor
        from dettrain.checkpoint.chunks import NAMED, named_chunks

        regions = self._write_regions()
        sd: dict = dict(named_chunks(self.layout.entries, {buf: regions for buf, _ in NAMED}, self.flat_slice))
        sd[OPTIM] = {"kind": self.state_kind, "step_count": self.opt.step_count}
        return sd

    def _write_regions(self) -> list[tuple[int, int]]:
        N = self.layout.numel
        return [(a, min(b, N)) for a, b in self.reducer.layout.own_shards(self.info.rank) if a < N]

    def flat_slice(self, name: str, a: int, b: int) -> torch.Tensor:
        """Global flat range [a, b) of the parameters (a full buffer on every rank) or of an AdamW moment (held
        only for this rank's regions; ValueError if [a, b) is not inside one of them)."""
        return self.reducer.param[a:b] if name == "param" else self.opt.view(name, a, b)

    def load_plan(self, md, path):
        """"named" (every name of chunks.NAMED there with its shape), or the pieces of each buffer of the earlier
        flat format (``flat/<buffer>/<lo>-<hi>``), checked to tile the buffer."""
        from dettrain.checkpoint.chunks import check_named, has_pieces, plan_pieces

        if has_pieces(md):
            return plan_pieces(md, path, self.layout.numel)
        return check_named(md, path, self.layout.entries)

    def _own(self) -> list[tuple[int, int]]:
        N = self.layout.numel
        return [(a, min(b, N)) for a, b in self.reducer.owned() if a < N]

    def load_target(self, plan):
        from dettrain.checkpoint.chunks import load_planner, named_chunks, needed_pieces

        r, N = self.reducer, self.layout.numel
        own = self._own()
        # parameters: sharded -> own shards, then all_gather (every rank reads 1/W); else every rank reads all
        param_regions = own if r.shard and self.info.world > 1 else [(0, N)]
        want = {"param": param_regions, "exp_avg": own, "exp_avg_sq": own}
        if plan == "named":  # every name's boxes inside this rank's regions, read straight into the buffers
            self._spill = []
            return {}, load_planner(named_chunks(self.layout.entries, want, self.flat_slice))
        sd: dict = {}
        self._spill: list[tuple[str, int, int, torch.Tensor]] = []  # pieces past this rank's moment regions
        for name, regions in want.items():
            for a, b, key in needed_pieces({name: plan[name]}, regions)[name]:
                try:
                    sd[key] = self.flat_slice(name, a, b)  # read straight into place
                except ValueError:  # saved on another layout: read whole, keep the part this rank holds
                    sd[key] = torch.empty(b - a, dtype=torch.float32, device=r.param.device)
                    self._spill.append((name, a, b, sd[key]))
        return sd, None

    def load_state_dict(self, state_dict):
        own = self._own()
        for name, a, b, t in getattr(self, "_spill", []):
            for ra, rb in own:
                lo, hi = max(a, ra), min(b, rb)
                if lo < hi:
                    self.opt.view(name, lo, hi).copy_(t[lo - a : hi - a])
        self._spill = []
        if self.reducer.shard and self.info.world > 1:
            self.reducer.gather_params()
        self.opt.step_count = int(state_dict[OPTIM]["step_count"])

    @classmethod
    def saved_params(cls, md, path, entries):
        from dettrain.checkpoint.chunks import has_pieces, plan_pieces

        if not has_pieces(md):
            return super().saved_params(md, path, entries)
        # the earlier flat format: pieces flat/param/<lo>-<hi> of the flat parameter buffer
        numel = sum(k for _, _, _, k in entries)
        flat = torch.empty(numel, dtype=torch.float32)
        sd = {key: flat[a:b] for a, b, key in plan_pieces(md, path, numel)["param"]}  # read straight into place
        return sd, {name: flat[off : off + k].view(p.shape) for name, p, off, k in entries}
