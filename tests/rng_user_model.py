"""`python -m dettrain` with a user model that draws from the process-wide RNG streams every forward.

dettrain's own model draws only dropout, from the torch stream re-keyed per micro-batch (seed_micro_batch), so no
state of the global streams carries from one step to the next and a resume that failed to restore them would go
unnoticed.  A user's model may draw from Python's ``random`` or numpy's global generator (augmentation, noise),
which nothing re-keys: this one scales its logits by a factor drawn from both.  A resumed run then matches the
uninterrupted one only if the checkpoint restored both streams.  (torch's default stream is re-keyed at every
micro-batch, so its state never crosses a step and restoring it cannot be observed.)
"""

from __future__ import annotations

import random
import runpy
import sys

import numpy as np

import dettrain.models.llama as model

_forward = model.Transformer.forward


def noisy_forward(self, x):
    noise = random.random() + float(np.random.random_sample())
    return _forward(self, x) * (1.0 + 1e-2 * noise)


model.Transformer.forward = noisy_forward
sys.argv = ["dettrain", *sys.argv[1:]]
runpy.run_module("dettrain", run_name="__main__", alter_sys=True)
