"""Every shipped YAML composes against the schema; bad configs fail with messages that name the key."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, train
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from dettrain.config import Config, conf_dir, register, to_config, validate

register()
CONF = conf_dir()


def compose_cfg(overrides: list[str]) -> Config:
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        d = compose(config_name="config", overrides=overrides)
    return to_config(d)


def all_yaml() -> list[Path]:
    return sorted(p for p in CONF.rglob("*.yaml"))


def test_conf_dir_is_the_repo_conf():
    assert CONF.resolve() == (REPO / "conf").resolve()


@pytest.mark.parametrize("path", all_yaml(), ids=lambda p: p.relative_to(CONF).as_posix())
def test_every_yaml_composes_against_the_schema(path: Path):
    rel = path.relative_to(CONF)
    if rel.parts[0] == "exp":
        overrides = [f"+exp={path.stem}"]
        assert path.read_text().startswith("# @package _global_"), "+exp files need '# @package _global_'"
    elif rel.parts[0] == "model":
        overrides = [f"model={path.stem}"]
        if path.stem == "custom":  # names no factory of its own (tests/custom_models.py is on sys.path here)
            overrides.append("model._target_=custom_models.MLPLM")
    else:
        overrides = []
    cfg = compose_cfg(overrides)
    assert isinstance(cfg, Config)
    validate(cfg, world=1) if cfg.data.path is None else None


def test_llm_7b_is_the_llama2_7b_shape():
    cfg = compose_cfg(["+exp=llm_7b"])
    m = cfg.model
    assert (m.dim, m.n_layers, m.n_heads, m.ffn_dim, m.vocab_size, m.seq_len) == (4096, 32, 32, 11008, 32000, 4096)
    assert cfg.train.precision == "bf16" and cfg.exp_name == "llm_7b"


def test_typed_schema_rejects_wrong_types():
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException, match="train.steps"):
        compose_cfg(["train.steps=many"])
    with pytest.raises(Exception, match="no_such_key"):
        compose_cfg(["train.no_such_key=1"])


BAD = [
    (["det.tier=7"], "det.tier"),
    (["train.global_batch=10", "train.micro_batch=4"], "train.global_batch"),
    (["data.path=/nonexistent/tokens.bin"], "data.path"),
    (["dist.backend=nccl"], "dist.backend"),
    (["dist.backend=mpi"], "dist.backend"),
    (["train.precision=fp8"], "train.precision"),
    (["det.tier=4", "train.global_batch=12", "train.micro_batch=2"], "det.tier=4"),
    (["det.tier=2", "dist.shard_optimizer=true"], "dist.shard_optimizer"),
    (["log.wandb.mode=sometimes"], "log.wandb.mode"),
    (["det.on_divergence=explode"], "det.on_divergence"),
    (["det.reference=/nonexistent/run"], "det.reference"),
    (["det.threads=0"], "det.threads"),
    (["train.stop_after=99", "train.steps=10"], "train.stop_after"),
    (["model.n_heads=3"], "model.dim"),
]


@pytest.mark.parametrize("overrides,key", BAD, ids=[b[1] + ":" + b[0][0] for b in BAD])
def test_bad_config_names_the_key(overrides, key):
    import torch

    if "dist.backend=nccl" in overrides and torch.cuda.is_available():
        pytest.skip("CUDA present: nccl is valid here")
    cfg = compose_cfg(overrides)
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        validate(cfg, world=1)


def test_bad_config_from_the_cli_exits_2_with_the_key(tmp_path):
    p = train(tmp_path / "run", "train.global_batch=10", "train.micro_batch=4", check=False)
    assert p.returncode == 2
    assert "train.global_batch=10" in p.stderr and "Traceback" not in p.stderr


def test_world_size_enters_the_divisibility_check():
    cfg = compose_cfg(["train.global_batch=8", "train.micro_batch=2"])
    validate(cfg, world=4)
    with pytest.raises(ValueError, match="world size 3"):
        validate(cfg, world=3)


def test_configs_are_found_from_an_installed_package(tmp_path):
    """A real (non-editable) install into a target dir, used from another cwd, composes +exp=llm_7b."""
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "-q",
                    "--target", str(target), str(REPO)], check=True, capture_output=True, timeout=300)
    assert (target / "dettrain" / "conf" / "exp" / "llm_7b.yaml").is_file()
    env = {"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"}
    p = subprocess.run([sys.executable, "-c", "import dettrain.config as c; print(c.conf_dir())"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert Path(p.stdout.strip()).resolve() == (target / "dettrain" / "conf").resolve()
    p = subprocess.run([sys.executable, "-m", "dettrain", "+exp=llm_7b", "--cfg", "job"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "dim: 4096" in p.stdout and "exp_name: llm_7b" in p.stdout
    # the console script ([project.scripts] dettrain = dettrain.cli:main): its help, and a train command
    script = target / "bin" / "dettrain"
    assert script.is_file()
    p = subprocess.run([str(script), "train", "--help"], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    assert "  det.tier: int = 3" in p.stdout and "llm_7b" in p.stdout  # the packaged conf/ and schema sources
    p = subprocess.run([str(script), "train", "+exp=llm_7b", "--cfg", "job"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "dim: 4096" in p.stdout
