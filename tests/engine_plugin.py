"""A trivial engine registered from outside dettrain (docs/engines.md): one class in one file.

``HalvingFlat`` is the flat engine whose learning rate is multiplied by a factor that shrinks every step.  The
factor is engine state: it is saved with the checkpoint (its own DCP entry) and loaded back, so a resumed run
continues bit for bit only if the engine saves and loads itself.  Run it with
``dist.engine=engine_plugin:HalvingFlat`` (this directory on PYTHONPATH)."""

from __future__ import annotations

import torch

from dettrain.sync.engines import FlatEngine, register

SCALE_KEY = "halving/lr_scale"


@register
class HalvingFlat(FlatEngine):
    name = "halving_flat"
    state_kind = "halving_flat"  # its checkpoints hold one more entry than the flat engine's
    canonical_bits = False  # its updates differ from the flat engine's

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.lr_scale = torch.ones((), dtype=torch.float64)

    def step(self, lr: float) -> None:
        super().step(lr * float(self.lr_scale))
        self.lr_scale.mul_(0.75)

    def state_dict(self):
        return {**super().state_dict(), SCALE_KEY: self.lr_scale}

    def load_target(self, plan):
        sd, planner = super().load_target(plan)
        return {**sd, SCALE_KEY: self.lr_scale}, planner  # read in place, like every other tensor
