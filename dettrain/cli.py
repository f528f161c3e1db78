"""One command line: ``dettrain <command> [args]``, each command the ``main`` of one module.

The commands, their modules and their published ``python -m`` paths are listed once, in
dettrain/tools/__init__.py (``COMMAND_TABLE``); ``dettrain --help`` prints them.  ``dettrain train`` is
``python -m dettrain``; under torchrun keep ``-m dettrain``.

``dettrain train --help`` (and ``python -m dettrain --help``) prints every config key with its type, default and
documentation, read from the schema's source by dettrain/tools/keys.py: printing help imports neither torch nor
Hydra.
"""

from __future__ import annotations

import importlib
import sys

from dettrain.tools import COMMAND_TABLE
from dettrain.tools.keys import config_keys, train_help  # noqa: F401 - config_keys: part of this module's interface

# command -> (module, argv prefix, one-line summary); modules are imported only when their command runs
COMMANDS: dict[str, tuple[str, tuple[str, ...], str]] = {
    command: (module, tuple(published.split()[1:]), summary) for command, module, published, summary in COMMAND_TABLE}


# ---- dispatch -------------------------------------------------------------------------------------------------
def _usage() -> str:
    w = max(map(len, COMMANDS))
    rows = "\n".join(f"  {name:<{w}}  {summary}" for name, (_, _, summary) in COMMANDS.items())
    return (f"usage: dettrain <command> [args]   (dettrain <command> --help for its options)\n\n"
            f"Reproducible distributed training: runs repeat bit for bit and diff step by step.\n\ncommands:\n{rows}\n")


def run_train(argv: list[str], prog: str = "dettrain train") -> int:
    """``python -m dettrain``: our help for --help/-h, else Hydra's main with these arguments."""
    if any(a in ("--help", "-h") for a in argv):
        sys.stdout.write(train_help(prog))
        return 0
    from dettrain.__main__ import hydra_main

    old = sys.argv
    sys.argv = [prog, *argv]  # Hydra parses sys.argv
    try:
        hydra_main()
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv = old
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        sys.stdout.write(_usage())
        return 0 if argv else 2
    if argv[0] == "--version":
        from dettrain import __version__

        print(f"dettrain {__version__}")
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd not in COMMANDS:
        sys.stderr.write(f"dettrain: unknown command {cmd!r}\n\n{_usage()}")
        return 2
    if cmd == "train":
        return run_train(rest)
    module, prefix, _ = COMMANDS[cmd]
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module:
            raise  # a dependency of the module is missing: its own traceback says which
        sys.stderr.write(f"dettrain {cmd}: this installation has no {module} (python -m {module} is not available "
                         f"here); update dettrain\n")
        return 2
    rc = mod.main([*prefix, *rest])
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
