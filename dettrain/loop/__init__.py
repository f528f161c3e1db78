"""The training loop and what it drives: the one assembly of a run (build.py: ``build_run``, used by the trainer and
the tools), the Trainer (trainer.py), what watches each step (observers.py: the checks, ledger, wandb mirror,
progress log and checkpointing), the step's ledger line (step_record.py), the gradient-sync engines (engines/, one
file per engine) and their collectives (collectives.py), the optimizer (optim.py), FSDP2 wrapping (fsdp.py),
torch.compile (compile.py), the device-dependent choices (resolve.py) and the non-finite stop (nonfinite.py)."""
