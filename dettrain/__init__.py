"""dettrain: distributed PyTorch training whose runs reproduce bit for bit (see README.md and docs/).

The library API for your own loop (``dettrain.api``): ``setup``, ``GradSync``, ``StepLedger`` (with a wandb mirror),
``sampler``, ``save_checkpoint``/``load_checkpoint``, ``seed_micro_batch``, ``derive_seed``, ``fingerprint``.
Imported lazily, so ``import dettrain`` (and the CLI's ``--help``) stays cheap.
"""

__version__ = "0.1.0"

_LAZY = {
    "setup": "dettrain.api", "GradSync": "dettrain.api", "StepLedger": "dettrain.api", "shutdown": "dettrain.api",
    "sampler": "dettrain.api", "save_checkpoint": "dettrain.api", "load_checkpoint": "dettrain.api",
    "seed_micro_batch": "dettrain.determinism", "derive_seed": "dettrain.determinism",
    "fingerprint": "dettrain.record.fingerprint", "UserError": "dettrain.errors",
}
__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'dettrain' has no attribute {name!r}")
