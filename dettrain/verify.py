"""``python -m dettrain.verify``, a published path: re-exports dettrain/tools/verify.py, where the code lives."""

from dettrain.tools.verify import *  # noqa: F403
from dettrain.tools.verify import __all__, main  # noqa: F401

if __name__ == "__main__":
    raise SystemExit(main())
