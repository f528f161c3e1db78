"""``python -m dettrain.memory``, a published path: re-exports dettrain/tools/memory.py, where the code lives."""

from dettrain.tools.memory import *  # noqa: F403
from dettrain.tools.memory import __all__, main  # noqa: F401

if __name__ == "__main__":
    raise SystemExit(main())
