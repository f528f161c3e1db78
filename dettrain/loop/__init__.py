"""The training loop: the one assembly of a run (build.py: ``build_run``, used by the trainer and the tools), the
Trainer (trainer.py), what watches each step (observers.py: the checks, ledger, wandb mirror, progress log and
checkpointing), the step's ledger line (step_record.py), torch.compile (compile.py), the device-dependent choices
(resolve.py) and the non-finite stop (nonfinite.py).  Gradient synchronisation (the engines, their sums, the
optimizer) is below it, in dettrain.sync."""
