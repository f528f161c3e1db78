"""``python -m dettrain.trace``, a published path: re-exports dettrain/tools/trace.py, where the code lives."""

from dettrain.tools.trace import *  # noqa: F403
from dettrain.tools.trace import __all__, main  # noqa: F401

if __name__ == "__main__":
    raise SystemExit(main())
