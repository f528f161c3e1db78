"""``python -m dettrain.checkpoint list|status RUN_DIR``."""

import sys

from dettrain.checkpoint.state import main

sys.exit(main())
