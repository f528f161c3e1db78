"""``python -m dettrain.checkpoint list|status RUN_DIR``: runs the command line, dettrain/tools/checkpoint.py.

The import sits under the ``__main__`` guard, so importing the library package never loads a tool."""

import sys

if __name__ == "__main__":
    from dettrain.tools.checkpoint import main

    sys.exit(main())
