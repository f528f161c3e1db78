"""The one CLI: ``dettrain <command>`` delegates to each module's main; ``train --help`` documents every key."""

from __future__ import annotations

import dataclasses
import importlib.util
import subprocess
import sys
import typing

import pytest
from conftest import REPO, train

from dettrain.cli import COMMANDS, config_keys
from dettrain.config import Config
from dettrain.models.custom import CustomModelConfig
from dettrain.models.llama import ModelConfig
from dettrain.record.ledger import read_ledger


def cli(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dettrain.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


def schema_keys(cls=Config, prefix: str = "") -> list[str]:
    """Every key of the runtime schema (dataclasses.fields), both model schemas included."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if cls is Config and f.name == "model":
            out += schema_keys(ModelConfig, "model.") + schema_keys(CustomModelConfig, "model.")
        elif dataclasses.is_dataclass(hints[f.name]):
            out += schema_keys(hints[f.name], f"{prefix}{f.name}.")
        elif not (cls is CustomModelConfig and f.name == "kwargs"):  # shown as model.<key>
            out.append(prefix + f.name)
    return out


def test_train_help_documents_every_key_without_importing_torch():
    code = ("import sys; from dettrain.cli import main; rc = main(['train', '--help']); "
            "heavy = sorted(m for m in ('torch', 'hydra', 'omegaconf', 'numpy') if m in sys.modules); "
            "print('HEAVY', heavy); sys.exit(rc)")
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "HEAVY []" in p.stdout
    text = p.stdout
    keys = schema_keys()
    assert len(keys) > 50
    missing = [k for k in keys if f"  {k}: " not in text]
    assert not missing
    documented = {k for k, _, _, doc in config_keys() if doc}
    assert {"det.tier", "train.lr", "model.dim", "model._target_", "data.path"} <= documented
    # the documentation is the attribute docstring, with type and default
    assert "  det.tier: int = 3\n      0 fast, 1 seeded, 2 ops, 3 collectives" in text
    assert "model=NAME" in text and "custom" in text and "+exp=NAME" in text and "llm_7b" in text


def test_python_m_dettrain_help_is_the_same_help():
    p = subprocess.run([sys.executable, "-m", "dettrain", "--help"], cwd=REPO, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    assert "  train.global_batch: int = 16" in p.stdout and "python -m dettrain" in p.stdout


@pytest.mark.parametrize("cmd", sorted(COMMANDS))
def test_every_command_has_help(cmd):
    p = cli(cmd, "--help")
    module = COMMANDS[cmd][0]
    if cmd == "memory" and importlib.util.find_spec(module) is None:  # being written elsewhere
        assert p.returncode == 2 and f"has no {module}" in p.stderr and "Traceback" not in p.stderr
        return
    assert p.returncode == 0, p.stderr[-2000:]
    assert "usage:" in p.stdout


def test_top_level_usage_and_unknown_command():
    p = cli("--help")
    assert p.returncode == 0 and all(c in p.stdout for c in COMMANDS)
    p = cli("frobnicate")
    assert p.returncode == 2 and "unknown command 'frobnicate'" in p.stderr


def test_dettrain_train_trains_like_python_m_dettrain(tmp_path):
    train(tmp_path / "cli", module=("dettrain.cli", "train"))
    train(tmp_path / "main")
    _, a = read_ledger(tmp_path / "cli")
    _, b = read_ledger(tmp_path / "main")
    assert len(a) == 4 and a == b


def test_dettrain_train_passes_exit_codes_through(tmp_path):
    p = train(tmp_path / "bad", "train.global_batch=10", "train.micro_batch=4", module=("dettrain.cli", "train"),
              check=False)
    assert p.returncode == 2 and "train.global_batch=10" in p.stderr


def test_dettrain_subcommand_delegates_with_its_argv(tmp_path):
    train(tmp_path / "a")
    p = cli("diff", str(tmp_path / "a"), str(tmp_path / "a"))
    assert p.returncode == 0, p.stdout + p.stderr
    p = cli("checkpoint", "status", str(tmp_path / "a"))
    assert p.returncode == 0 and "complete" in p.stdout


def test_hydra_run_dir_is_refused_with_the_key_to_use_and_leaves_no_directory(tmp_path):
    """hydra.run.dir (on the command line, or in a YAML of the user's) names run_dir; no empty directory is left."""
    import os

    conf = tmp_path / "conf" / "exp"
    conf.mkdir(parents=True)
    (conf / "h.yaml").write_text(f"# @package _global_\nhydra:\n  run:\n    dir: {tmp_path / 'from_yaml'}\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for args in (["++hydra.run.dir=" + str(tmp_path / "from_cli")],
                 ["--config-dir", str(tmp_path / "conf"), "+exp=h", "log.wandb.mode=disabled"]):
        p = subprocess.run([sys.executable, "-m", "dettrain", *args], cwd=tmp_path, capture_output=True, text=True,
                           timeout=300, env=env)
        assert p.returncode == 2 and "run_dir=" in p.stderr and "Traceback" not in p.stderr, p.stderr
        assert sorted(x.name for x in tmp_path.iterdir()) == ["conf"]  # no run dir, no Hydra dir, no outputs/
