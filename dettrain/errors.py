"""dettrain's one exception type for user errors.

``UserError`` means the input is wrong (a config key, a file, a run dir, a checkpoint) and the message names it and
the fix: the command-line entry points print it on one line and exit 2.  Every other exception is an internal bug
and keeps its traceback.  It derives from ValueError so callers that already catch ValueError keep working.
"""

from __future__ import annotations

EXIT_USAGE = 2
"""Exit status of a run refused for bad input (a UserError)."""


class UserError(ValueError):
    """Bad input: the message names the key or file and what to do instead."""
