"""``python -m dettrain.advise``, a published path: re-exports dettrain/tools/advise.py, where the code lives."""

from dettrain.tools.advise import *  # noqa: F403
from dettrain.tools.advise import __all__, main  # noqa: F401

if __name__ == "__main__":
    raise SystemExit(main())
