"""Gradient synchronisation, below the training loop (it imports nothing from dettrain.loop): the engines behind
``dist.engine`` (engines/, one file per engine), the flat engine's canonical reducer (collectives.py), how a rank
sums its micro-batches before it (accumulate.py), tier 4's partial sums in host memory (offload.py), FSDP2 wrapping
(fsdp.py) and the optimizer with the ``optim.*`` keys (optim.py)."""
