"""``python -m dettrain.generate RUN --prompts FILE``, a published path: runs dettrain/tools/generate.py, the command
line of ``dettrain.generate``."""

from dettrain.tools.generate import main

if __name__ == "__main__":
    raise SystemExit(main())
