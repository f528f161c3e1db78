"""Tab completion (dettrain/tools/completion.py): the script that ``-sc install=bash`` prints, sourced in a real bash,
completes config keys after ``dettrain train`` and ``python -m dettrain`` by running Hydra's query the way bash
does (COMP_LINE, COMP_POINT, COMP_WORDS, COMP_CWORD set, the completion function called)."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys

import pytest
from conftest import REPO

from dettrain.tools.completion import hydra_line


@pytest.fixture()
def shell_env(tmp_path):
    """PATH with a ``dettrain`` executable that runs this tree's CLI (what the console script does)."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    exe = bindir / "dettrain"
    exe.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} -m dettrain.cli \"$@\"\n")
    exe.chmod(0o755)
    return {**os.environ, "PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}", "OMP_NUM_THREADS": "1"}


def complete(env: dict, install: str, line: str) -> list[str]:
    """COMPREPLY of ``line`` (the cursor at its end) in a bash that ran ``eval "$(<install> -sc install=bash)"``."""
    script = f"""
eval "$({install} -sc install=bash)" || exit 9
COMP_LINE={shlex.quote(line)}
COMP_POINT=${{#COMP_LINE}}
read -ra COMP_WORDS <<< "$COMP_LINE"
[[ "$COMP_LINE" == *" " ]] && COMP_WORDS+=("")
COMP_CWORD=$(( ${{#COMP_WORDS[@]}} - 1 ))
_dettrain_sc
printf '%s\\n' "${{COMPREPLY[@]}}"
"""
    p = subprocess.run(["bash", "--norc", "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    return [x for x in p.stdout.splitlines() if x]


def test_completion_after_dettrain_train(shell_env):
    got = complete(shell_env, "dettrain train", "dettrain train train.st")
    assert "train.steps=" in got and all(x.startswith("train.st") for x in got), got
    top = complete(shell_env, "dettrain train", "dettrain train ")
    assert {"train.", "model=", "ckpt."} <= set(top), top
    assert complete(shell_env, "dettrain train", "dettrain pre") == ["prepare"]  # the commands themselves


def test_completion_after_python_m_dettrain(shell_env):
    py = shlex.quote(sys.executable)
    got = complete(shell_env, f"{py} -m dettrain", f"{sys.executable} -m dettrain train.st")
    assert "train.steps=" in got, got


def test_hydra_line_strips_either_prefix():
    assert hydra_line("dettrain train train.st") == "dettrain train.st"
    assert hydra_line("/usr/bin/python3.11 -m dettrain seed=1 ") == "dettrain seed=1 "
    assert hydra_line("dettrain diff a b") == "dettrain diff a b"  # not a training command line: unchanged


def test_install_binds_only_dettrain_and_uninstall_removes_it(shell_env):
    """python keeps its own completion: after the eval, `complete -p` lists dettrain and nothing else of ours."""
    script = """
complete -F _my_python python python3          # the shell's own python completion, as bash-completion sets it
eval "$(dettrain train -sc install=bash)" || exit 9
complete -p
echo ---
eval "$(dettrain train -sc uninstall=bash)"
complete -p
"""
    p = subprocess.run(["bash", "--norc", "-c", script], cwd=REPO, env=shell_env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr
    installed, removed = p.stdout.split("---\n")
    assert "complete -o default -o nospace -F _dettrain_sc dettrain" in installed, installed
    assert "_my_python python" in installed and "_my_python python3" in installed, installed
    assert "_dettrain_sc" not in removed and "_my_python python3" in removed, removed
