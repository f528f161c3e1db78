"""Command-line tools, each a module with a ``main(argv)`` that returns the exit status, and the one list of them.

``COMMAND_TABLE`` below is that list, written once: every ``dettrain <command>``, the module that runs it, its
published ``python -m`` path and what it does.  dettrain/cli.py dispatches and prints its usage from it,
completion.py completes the command names from it, and tests/test_layout.py reads it (as source) to check that
every published path is a thin module that runs its tool: ``dettrain/<tool>.py`` for ``python -m dettrain.<tool>``,
or a package's ``__main__.py`` (``python -m dettrain.data prepare``, ``python -m dettrain.checkpoint``).

Besides the commands: launch.py (the launch scripts' environment, ``python -m dettrain.tools.launch``),
completion.py (bash completion for ``dettrain train`` and ``python -m dettrain``) and keys.py (the config key
reference of ``dettrain train --help``, read from the schema's source).

Tools depend on the library, never the reverse: no library module imports ``dettrain.tools``; only the entry points
do (cli.py, __main__.py, and the thin modules at the published paths).  Importing this package loads nothing else.
"""

COMMAND_TABLE: tuple[tuple[str, str, str, str], ...] = (
    # (command, module that runs it, published `python -m` path and its leading arguments, what it does)
    ("train", "dettrain.__main__", "dettrain",
     "train (Hydra overrides: +exp=NAME key=value ...; --help lists every key)"),
    ("diff", "dettrain.tools.diff", "dettrain.diff",
     "compare two runs step by step (exit 0 identical, 1 diverged, 2 bad input)"),
    ("trace", "dettrain.tools.trace", "dettrain.trace",
     "replay one step with per-module/per-op fingerprints: which op diverged"),
    ("verify", "dettrain.tools.verify", "dettrain.verify", "check that this machine and model reproduce bit for bit"),
    ("advise", "dettrain.tools.advise", "dettrain.advise", "which tier and settings to use (the decision tree)"),
    ("audit", "dettrain.tools.audit", "dettrain.audit", "audit the determinism settings of this process"),
    ("prepare", "dettrain.tools.prepare", "dettrain.data prepare",
     "tokenize text files or directories into a token file for data.path"),
    ("export", "dettrain.tools.export", "dettrain.export",
     "write a Hugging Face directory from a checkpoint (LLaMA, HF models)"),
    ("memory", "dettrain.tools.memory", "dettrain.memory",
     "peak memory per rank of a config on N devices, estimated on one"),
    ("checkpoint", "dettrain.tools.checkpoint", "dettrain.checkpoint",
     "list a run's checkpoints, its status, or a to-torch file"),
    ("panel", "dettrain.tools.panel", "dettrain.panel",
     "save a wandb workspace comparing the step hashes of a run group"),
    ("generate", "dettrain.tools.generate", "dettrain.generate",
     "generate from a checkpoint, logits equal to the training forward's (JSONL of tokens and log-probs)"),
)
"""Every ``dettrain <command>``: (command, module whose ``main`` runs it, published path, one-line summary).  The
published path is what follows ``python -m``; words after the module name are passed before the user's arguments
(``dettrain prepare X`` runs ``main(["prepare", "X"])``, as ``python -m dettrain.data prepare X`` does)."""

__all__ = ["COMMAND_TABLE"]
