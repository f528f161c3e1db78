"""``dist.engine=ddp``: torch DistributedDataParallel + torch AdamW (tiers 0-2: the baseline users know)."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from dettrain.sync.engines.base import OPTIM, Engine, _hash, register


@register
class DDPEngine(Engine):
    """torch DDP (bucketed all-reduce inside the backend) and torch AdamW: tiers 0-2."""

    name = "ddp"
    state_kind = "torch"  # torch AdamW's per-parameter state, with its step counts
    cuda_graphs = True  # gradients are allocated before the first backward and zeroed in place (begin_step)

    def __init__(self, model, info, tier, optim, lr: float, bucket_mb: float, allow_unused: bool = False, *,
                 mixed_precision: bool = False) -> None:
        super().__init__(model, info, tier, optim, mixed_precision=mixed_precision)
        # model.allow_unused: DDP must then look for parameters without a gradient every step (a graph traversal),
        # or it waits for them forever and fails at the next forward
        self.ddp = (torch.nn.parallel.DistributedDataParallel(
            model, bucket_cap_mb=bucket_mb, device_ids=[info.local_rank] if info.device.type == "cuda" else None,
            find_unused_parameters=allow_unused) if info.world > 1 else None)
        # fused on CUDA: one elementwise kernel, no reductions, deterministic
        # optim.no_decay: a second param group with weight decay 0 (after the decayed one; both in model order)
        named = list(model.named_parameters())
        groups = [{"params": [p for n, p in named if n not in self.no_decay]},
                  {"params": [p for n, p in named if n in self.no_decay], "weight_decay": 0.0}]
        self.opt = torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=(optim.beta1, optim.beta2),
                                     eps=optim.eps, weight_decay=optim.weight_decay, foreach=False,
                                     fused=info.device.type == "cuda")

    @classmethod
    def from_config(cls, cfg, model, info, *, mixed_precision):
        return cls(model, info, cfg.det.tier, cfg.optim, cfg.train.lr, cfg.dist.bucket_mb, cfg.model.allow_unused,
                   mixed_precision=mixed_precision)

    @classmethod
    def cannot_keep(cls, pol):
        if pol.canonical_sum:
            return ("DDP sums gradients inside NCCL/Gloo, whose order changes with the algorithm and bucket layout; "
                    "use dist.engine=flat or fsdp2 (or auto)")
        return None

    @property
    def forward_module(self) -> nn.Module:
        return self.ddp or self.model

    def begin_step(self, n_micro):
        super().begin_step(n_micro)
        # every gradient exists before the first backward, so autograd accumulates into it in place: it never
        # adopts a backward's output as .grad (under train.cuda_graphs that memory is the graph's, rewritten by the
        # next replay)
        for p in self.model.parameters():
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)

    def micro(self, k: int):
        last = k == self.n_micro - 1
        return contextlib.nullcontext() if (self.ddp is None or last) else self.ddp.no_sync()

    def backward(self, loss, k):
        (loss / self.n_micro).backward()  # DDP averages over ranks: together the mean over M

    def reduce(self, scale):
        # torch's norm as a device tensor: the step line reads it with the fingerprints (no host sync before)
        # model.allow_unused: the frozen parameters' gradients are the zeros begin_step allocated, left out as a
        # frozen model's would be (a longer list of per-tensor norms can round the total differently)
        grads = [p.grad for n, p in self.model.named_parameters() if p.grad is not None and n not in self.frozen]
        return torch.nn.utils.get_total_norm(grads) if grads else torch.zeros((), device=self.info.device)

    def clip_(self, max_norm, norm):
        # torch's clip_grads_with_norm_: its fp32 coefficient clamped to 1 multiplies every gradient on the device
        # (by 1.0 when not clipping, which changes no bit), so the step never waits for the norm on the host
        if max_norm > 0:
            total = norm if isinstance(norm, torch.Tensor) else torch.tensor(norm)
            torch.nn.utils.clip_grads_with_norm_(self.model.parameters(), max_norm, total)

    def grad_parts(self):
        return [p.grad for p in self.model.parameters() if p.grad is not None]

    def step(self, lr):
        for g in self.opt.param_groups:
            g["lr"] = lr
        if self.frozen:  # torch AdamW skips a parameter without a gradient: no update, no weight decay
            for n, p in self.model.named_parameters():
                if n in self.frozen:
                    p.grad = None
        self.opt.step()
        self.opt.zero_grad(set_to_none=False)  # kept allocated: see begin_step

    def close(self):
        # DDP's C++ reducer holds the process group: drop it while the group is still registered, so that the
        # group is destroyed by dist.shutdown, not by whoever drops this wrapper last (dist.shutdown says why)
        self.ddp = None

    def partials(self, keys, per_tensor):
        # every rank holds everything: rank r hashes the tensors i with i % world == r
        N = self.layout.numel
        named = self.layout.entries[self.info.rank :: self.info.world]
        parts = []
        for key in keys:
            for name, p, off, _ in named:
                if key == "param":
                    parts.append((key, name, p.detach().reshape(-1), off))
                elif key == "grad":
                    g = p.grad if p.grad is not None else torch.zeros_like(p)
                    parts.append((key, name, g.reshape(-1), off))
                else:
                    st = self.opt.state.get(p, {})
                    for k, base in (("exp_avg", 0), ("exp_avg_sq", N)):
                        v = st.get(k)
                        parts.append((key, name, (v if v is not None else torch.zeros_like(p)).reshape(-1),
                                      base + off))
        return _hash(parts, keys, per_tensor)

    # ---- checkpoint: each tensor once, by name (every rank holds everything), with AdamW's step -----------------
    def state_dict(self):
        sd: dict = {}
        for name, p in self.model.named_parameters():
            sd[f"model/{name}"] = p.detach()
            for k, v in self.opt.state.get(p, {}).items():
                if not torch.is_tensor(v):
                    raise TypeError(f"optimizer state {name}.{k} is a {type(v).__name__}; only tensors are saved")
                sd[f"optim/{name}/{k}"] = v
        # AdamW's per-parameter step counts are not in the opt fingerprint: record them to check after a load
        steps = sorted({float(st["step"]) for st in self.opt.state.values() if "step" in st})
        sd[OPTIM] = {"kind": self.state_kind, "steps": steps}
        return sd

    def load_plan(self, md, path):
        """The saved tensors' shapes and dtypes by key (the optimizer state to allocate before reading it), after
        checking that every parameter is there with its shape."""
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        from dettrain.checkpoint.errors import CheckpointError

        plan = {k: (tuple(v.size), str(v.properties.dtype).removeprefix("torch."))
                for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
        for name, p in self.model.named_parameters():
            key = f"model/{name}"
            if plan.get(key, ((),))[0] != tuple(p.shape):
                raise CheckpointError(f"checkpoint {path}: parameter {name} has shape {plan.get(key, [None])[0]} "
                                      f"there, {tuple(p.shape)} here; the model differs")
        return plan

    def load_target(self, plan):
        sd: dict = {f"model/{name}": p.detach() for name, p in self.model.named_parameters()}
        for name, _ in self.model.named_parameters():
            prefix = f"optim/{name}/"
            for key, (shape, dtype) in plan.items():
                if key.startswith(prefix):
                    # CPU tensors of the saved shape and dtype (AdamW's step is a scalar); load_state_dict moves
                    # the moments beside their parameter
                    sd[key] = torch.zeros(shape, dtype=getattr(torch, dtype))
        return sd, None

    def load_state_dict(self, state_dict):
        from dettrain.checkpoint.errors import CorruptCheckpoint, _first_line

        opt_state: dict[torch.nn.Parameter, dict[str, torch.Tensor]] = {}
        for name, p in self.model.named_parameters():
            prefix = f"optim/{name}/"
            st = {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}
            if st:
                opt_state[p] = st
        ids = {id(p): i for i, p in enumerate(p for g in self.opt.param_groups for p in g["params"])}
        got = sorted({float(st["step"]) for st in opt_state.values() if "step" in st})
        want = state_dict[OPTIM].get("steps")
        if got != want:
            raise CorruptCheckpoint(f"AdamW step counts {got} != saved {want}")
        try:
            self.opt.load_state_dict({"state": {ids[id(p)]: st for p, st in opt_state.items()},
                                      "param_groups": self.opt.state_dict()["param_groups"]})
        except (ValueError, KeyError, RuntimeError) as e:  # optimizer entries of the wrong shape or kind
            raise CorruptCheckpoint(f"optimizer state does not fit this optimizer "
                                    f"({type(e).__name__}: {_first_line(e)})") from None
