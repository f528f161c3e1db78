"""``python -m dettrain.diff``, a published path: re-exports dettrain/tools/diff.py, where the code lives."""

from dettrain.tools.diff import *  # noqa: F403
from dettrain.tools.diff import __all__, main  # noqa: F401

if __name__ == "__main__":
    raise SystemExit(main())
