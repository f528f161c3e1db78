"""``python -m dettrain.checkpoint list|status RUN_DIR``: runs the command line, dettrain/tools/checkpoint.py.

Imported by name at run time so that the library package has no import of dettrain.tools."""

import importlib
import sys

if __name__ == "__main__":
    sys.exit(importlib.import_module("dettrain.tools.checkpoint").main())
