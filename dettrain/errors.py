"""dettrain's one exception type for user errors.

``UserError`` means the input is wrong (a config key, a file, a run dir, a checkpoint) and the message names it and
the fix: the command-line entry points print it on one line and exit 2.  Every other exception is an internal bug
and keeps its traceback.  It derives from ValueError so callers that already catch ValueError keep working.
``io_error`` turns an OSError on a file the user chose into one, with the fix for the usual causes;
``replace_atomically`` writes a file so that a failure never leaves half of it.
"""

from __future__ import annotations

import errno
from pathlib import Path

EXIT_USAGE = 2
"""Exit status of a run refused for bad input (a UserError)."""


class UserError(ValueError):
    """Bad input: the message names the key or file and what to do instead."""


def io_error(what: str, path: Path | str, e: OSError, target: str = "run_dir") -> UserError:
    """A UserError for an OSError on ``path``: the path, the reason, and the fix for the usual causes (``target``:
    what the user picks instead, e.g. ``--out``)."""
    reason = e.strerror or str(e)
    fix = {
        errno.ENOSPC: f"no space left on the device: free space or pick a {target} on another file system",
        errno.EDQUOT: f"disk quota exceeded: free space or pick a {target} on another file system",
        errno.EROFS: f"the file system is read-only: pick a writable {target}",
        errno.EACCES: f"permission denied: fix the permissions or pick another {target}",
        errno.EPERM: "not permitted (an immutable file? see 'lsattr'; 'chattr -i' clears it) or pick another "
                     f"{target}",
        errno.ENOTDIR: f"a parent of it is a file, not a directory: pick another {target}",
    }.get(e.errno or 0, f"pick another {target}")
    return UserError(f"cannot {what} {path}: {reason}; {fix}")


def write_error(path: Path | str, e: BaseException, target: str = "--out") -> UserError:
    """A UserError for a failed write of ``path`` by any writer: torch.save and safetensors report a full disk as a
    RuntimeError or their own error, not an OSError, so a file system with (almost) no space left is named as such."""
    import os

    if isinstance(e, OSError):
        return io_error("write", path, e, target)
    try:
        st = os.statvfs(Path(path).parent)
        full = st.f_bavail * st.f_frsize < (1 << 20)
    except OSError:
        full = False
    if full:
        return io_error("write", path, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), target)
    first = (str(e).splitlines() or [""])[0][:200]
    return UserError(f"cannot write {path}: {type(e).__name__}: {first}; pick another {target}")


def follow_umask(path: Path | str) -> None:
    """Give a file the mode ``open`` would have created it with (0o666 less the umask): files made by mkstemp or by
    libraries that write 0600 (safetensors) would otherwise stay private to their writer."""
    import os

    mask = os.umask(0o022)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)


def replace_atomically(dest: Path, write) -> None:
    """``write(tmp_path)`` into a fresh temporary file beside ``dest``, then rename it over ``dest``; on any failure
    the temporary file is removed (nothing half-written is ever left, under any name).  The file's mode follows the
    umask, as a file ``open`` creates does."""
    import os
    import tempfile

    fd, name = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(name)
    try:
        follow_umask(tmp)  # mkstemp creates 0600
        write(tmp)
        tmp.replace(dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def first_line(e: BaseException) -> str:
    """The first line of an exception's message (its type's name when empty), cut to 200 characters: enough to name
    what a library rejected in a one-line UserError."""
    return (str(e).splitlines() or [type(e).__name__])[0][:200]
