"""``python -m dettrain.data prepare ...``, a published path: runs dettrain/tools/prepare.py, the command line
of ``dettrain.data.prepare``."""

from dettrain.tools.prepare import main

if __name__ == "__main__":
    raise SystemExit(main())
