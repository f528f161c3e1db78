"""Tab completion of config keys for ``dettrain train`` and ``python -m dettrain`` (bash), through Hydra's own.

    eval "$(dettrain train -sc install=bash)"        # or: eval "$(python -m dettrain -sc install=bash)"

Hydra's bash plugin (``BashCompletion`` in Hydra's core plugins) assumes one of two shapes, ``python SCRIPT ...``
(a Python file containing ``@hydra.main``) or ``app ...`` (the app name, then overrides), and fits neither
of ours: ``python -m dettrain`` has no script file, and in ``dettrain train`` the subcommand ``train`` would be read
as an override (Hydra stops at "Error parsing override 'train'").  So dettrain answers ``-sc install=bash`` /
``uninstall=bash`` itself with a bash function that knows both shapes, and for ``-sc query=bash`` rewrites
COMP_LINE into Hydra's ``app ...`` shape (``dettrain`` then the overrides typed so far) before Hydra's own query
runs: the completions (config keys, groups, values) are Hydra's.  Only the ``dettrain`` command is bound, never
``python``, whose own completion (bash-completion's) must stay.  Other shells go to Hydra unchanged.
"""

from __future__ import annotations

import os
import re
import sys

from dettrain.tools import COMMAND_TABLE

# "dettrain train", ".../bin/dettrain train", "python -m dettrain", "python3.11 -m dettrain", ".../python -m dettrain"
_PREFIX = re.compile(r"^\s*(?:\S*/)?(?:dettrain\s+train|python[\d.]*\s+-m\s+dettrain)(?=\s|$)")

_SCRIPT = r"""_dettrain_sc()
{
    local line="${COMP_LINE:0:$COMP_POINT}"
    local -a w=($line)
    local cur="${COMP_WORDS[COMP_CWORD]}" helper
    case "${w[0]##*/}" in
        dettrain)
            if (( COMP_CWORD == 1 )); then
                COMPREPLY=($(compgen -W "%(commands)s" -- "$cur")); return
            fi
            [[ "${w[1]}" == train ]] || return 1   # another command: file names (complete -o default)
            helper="${w[0]} train" ;;
        python*)
            [[ "${w[1]}" == -m && "${w[2]}" == dettrain ]] || return 1
            helper="${w[0]} -m dettrain" ;;
        *) return 1 ;;
    esac
    local choices
    choices=$(COMP_LINE="$line" COMP_POINT=${#line} $helper -sc query=bash 2>/dev/null)
    COMPREPLY=($(compgen -o nospace -W "$choices" -- "$cur"))
}
# keys and values are one word: key=value must not be split at '='
COMP_WORDBREAKS=${COMP_WORDBREAKS//=/}
complete -o nospace -o default -F _dettrain_sc dettrain
"""


def install_script() -> str:
    """The bash code ``eval`` installs: completion of dettrain's commands, and of Hydra's keys after ``dettrain
    train``.  It binds the ``dettrain`` command only: ``python``'s own completion stays as it was (the function
    also answers ``python -m dettrain`` lines for a user who binds it to python: ``complete -o nospace -o default
    -F _dettrain_sc python3``)."""
    return _SCRIPT % {"commands": " ".join(command for command, *_ in COMMAND_TABLE)}


def hydra_line(line: str) -> str:
    """COMP_LINE in the ``app overrides...`` shape Hydra's bash query strips: ``dettrain`` and what follows the
    prefix (trailing space kept: it says a new word starts)."""
    m = _PREFIX.match(line)
    return f"dettrain{line[m.end():]}" if m else line


def handle(argv: list[str]) -> bool:
    """Answer ``-sc install=bash`` / ``uninstall=bash`` here (True: done), or rewrite COMP_LINE for
    ``-sc query=bash`` and let Hydra answer (False; likewise for anything else)."""
    flags = ("-sc", "--shell-completion", "--shell_completion")
    if not any(a in flags for a in argv):
        return False
    if "install=bash" in argv:
        sys.stdout.write(install_script())
        return True
    if "uninstall=bash" in argv:
        sys.stdout.write("complete -r dettrain 2>/dev/null\nunset -f _dettrain_sc\n")
        return True
    if "query=bash" in argv and "COMP_LINE" in os.environ:
        os.environ["COMP_LINE"] = hydra_line(os.environ["COMP_LINE"])
    return False
