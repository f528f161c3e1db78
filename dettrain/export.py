"""``python -m dettrain.export``, a published path: re-exports dettrain/tools/export.py, where the code lives."""

from dettrain.tools.export import *  # noqa: F403
from dettrain.tools.export import __all__, main  # noqa: F401

if __name__ == "__main__":
    raise SystemExit(main())
