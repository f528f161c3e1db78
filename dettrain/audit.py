"""``python -m dettrain.audit``, a published path: re-exports dettrain/tools/audit.py, where the code lives."""

from dettrain.tools.audit import *  # noqa: F403
from dettrain.tools.audit import __all__, main  # noqa: F401

if __name__ == "__main__":
    raise SystemExit(main())
