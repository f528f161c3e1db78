"""``python -m dettrain.panel``, a published path: re-exports dettrain/tools/panel.py, where the code lives."""

from dettrain.tools.panel import *  # noqa: F403
from dettrain.tools.panel import __all__, main  # noqa: F401

if __name__ == "__main__":
    raise SystemExit(main())
