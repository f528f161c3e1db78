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
from dettrain.errors import UserError

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


# one bad value per rule of config.validate (and model.validate_model): each must name its key
BAD = [
    (["det.tier=7"], "det.tier"),
    (["det.tier=-1"], "det.tier"),
    (["det.on_divergence=explode"], "det.on_divergence"),
    (["det.attention=flash"], "det.attention"),
    (["det.threads=0"], "det.threads"),
    (["det.reference=/nonexistent/run"], "det.reference"),
    (["train.steps=0"], "train.steps"),
    (["train.global_batch=0"], "train.global_batch"),
    (["train.micro_batch=-2"], "train.micro_batch"),
    (["train.lr=0"], "train.lr"),
    (["train.lr=-0.001"], "train.lr"),
    (["train.lr=nan"], "train.lr"),
    (["train.global_batch=10", "train.micro_batch=4"], "train.global_batch"),
    (["train.precision=fp8"], "train.precision"),
    (["train.compile=sometimes"], "train.compile"),
    (["dist.reshard_after_forward=sometimes"], "dist.reshard_after_forward"),
    (["train.stop_after=99", "train.steps=10"], "train.stop_after"),
    (["train.stop_after=-1"], "train.stop_after"),
    (["det.tier=4", "train.global_batch=12", "train.micro_batch=2"], "det.tier=4"),
    (["optim.eps=0"], "optim.eps"),
    (["optim.eps=-1e-8"], "optim.eps"),
    (["optim.beta1=1.0"], "optim.beta1"),
    (["optim.beta1=-0.1"], "optim.beta1"),
    (["optim.beta2=1.5"], "optim.beta2"),
    (["optim.clip_grad_norm=-1"], "optim.clip_grad_norm"),
    (["optim.weight_decay=-0.1"], "optim.weight_decay"),
    (["optim.warmup_steps=-1"], "optim.warmup_steps"),
    (["optim.min_lr_ratio=2"], "optim.min_lr_ratio"),
    (["dist.timeout_s=0"], "dist.timeout_s"),
    (["data.max_bytes=0"], "data.max_bytes"),
    (["data.max_bytes=-5"], "data.max_bytes"),
    (["data.num_workers=-1"], "data.num_workers"),
    (["data.path=/nonexistent/tokens.bin"], "data.path"),
    (["data.val_fraction=1.0"], "data.val_fraction"),
    (["data.val_fraction=-0.1"], "data.val_fraction"),
    (["data.val_fraction=0.1", "data.val_path=/nonexistent/val.bin"], "data.val_fraction=0.1"),
    (["data.val_path=/nonexistent/val.bin"], "data.val_path"),
    (["eval.every=-1"], "eval.every"),
    (["eval.every=5"], "eval.every=5"),
    (["eval.every=1", "data.val_fraction=0.1", "eval.batches=0"], "eval.batches"),
    (["det.tier=4", "eval.every=1", "data.val_fraction=0.1", "eval.batches=6"], "eval.batches=6"),
    (["dist.backend=nccl"], "dist.backend"),
    (["dist.backend=mpi"], "dist.backend"),
    (["dist.bucket_mb=0"], "dist.bucket_mb"),
    (["dist.bucket_mb=-1"], "dist.bucket_mb"),
    (["det.tier=2", "dist.shard_optimizer=true"], "dist.shard_optimizer"),
    (["log.wandb.mode=sometimes"], "log.wandb.mode"),
    (["optim.no_decay=[norm,'']"], "optim.no_decay"),
    (["log.every=0"], "log.every"),
    (["log.tensor_every=-1"], "log.tensor_every"),
    (["ckpt.every=-1"], "ckpt.every"),
    (["ckpt.keep=0"], "ckpt.keep"),
    (["ckpt.resume="], "ckpt.resume"),
    (["ckpt.overwrite=true", "ckpt.resume=auto"], "ckpt.overwrite"),
    (["model.n_heads=3"], "model.dim"),
    (["model.dim=24", "model.n_heads=8"], "model.dim / model.n_heads"),
    (["model.n_kv_heads=3"], "model.n_kv_heads"),
    (["model.n_kv_heads=-2"], "model.n_kv_heads"),
    (["model.dropout=1.0"], "model.dropout"),
    (["model.dim=0"], "model.dim"),
    (["model.n_layers=0"], "model.n_layers"),
    (["model.n_heads=0"], "model.n_heads"),
    (["model.ffn_dim=0"], "model.ffn_dim"),
    (["model.vocab_size=-1"], "model.vocab_size"),
    (["model.seq_len=-1"], "model.seq_len"),
    # issue 23: every numeric key's range (tests/test_exit_codes.py walks the schema for the rest)
    (["det.tier=0", "det.threads=-1"], "det.threads"),
    (["data.max_bytes=1"], "data.max_bytes"),
    (["log.wandb.timeout_s=0"], "log.wandb.timeout_s"),
    (["model.norm_eps=0"], "model.norm_eps"),
    (["model.rope_theta=-1"], "model.rope_theta"),
    (["model.init_std=-1"], "model.init_std"),
]


@pytest.mark.parametrize("overrides,key", BAD, ids=[b[1] + ":" + b[0][0] for b in BAD])
def test_bad_config_names_the_key(overrides, key):
    import torch

    if "dist.backend=nccl" in overrides and torch.cuda.is_available():
        pytest.skip("CUDA present: nccl is valid here")
    cfg = compose_cfg(overrides)
    with pytest.raises(UserError) as e:
        validate(cfg, world=1)
    assert key in str(e.value)


def test_every_validation_rule_has_a_bad_case(tmp_path):
    """Each `raise UserError` of config.validate, model.validate_model and dist.resolve_backend is the one that
    fires for some bad config here (found by the line it raised from), so no rule goes untested."""
    import inspect
    import traceback

    import torch

    from dettrain import config, dist
    from dettrain.models import llama as model

    sites = set()
    for fn in (config.validate, model.validate_model, dist.resolve_backend):
        lines, start = inspect.getsourcelines(fn)
        f = inspect.getsourcefile(fn)
        sites |= {(f, start + i) for i, line in enumerate(lines) if line.strip().startswith("raise UserError")}
    # a token file whose sidecar says vocabulary 300, for a model of vocabulary 256
    tok = tmp_path / "tokens.bin"
    tok.write_bytes(bytes(64))
    (tmp_path / "tokens.bin.json").write_text('{"vocab_size": 300, "dtype": "uint16"}')
    cases = [(o, 1) for o, _ in BAD] + [(["train.global_batch=8", "train.micro_batch=2"], 3),
                                         (["det.tier=4", "train.global_batch=12", "train.micro_batch=2"], 3),
                                         ([f"data.path={tok}", "model.vocab_size=256"], 1)]
    hit = set()
    for overrides, world in cases:
        try:
            validate(compose_cfg(overrides), world=world)
        except UserError as e:
            last = traceback.extract_tb(e.__traceback__)[-1]
            hit.add((last.filename, last.lineno))
    text = {f: Path(f).read_text().splitlines() for f, _ in sites}
    missing = [text[f][n - 1].strip() for f, n in sorted(sites - hit)]
    if torch.cuda.is_available():  # dist.backend=nccl is valid here: its rule cannot fire
        missing = [m for m in missing if "nccl" not in m]
    assert not missing


def test_bad_config_from_the_cli_exits_2_with_the_key(tmp_path):
    p = train(tmp_path / "run", "train.global_batch=10", "train.micro_batch=4", check=False)
    assert p.returncode == 2
    assert "train.global_batch=10" in p.stderr and "Traceback" not in p.stderr


def test_world_size_enters_the_divisibility_check():
    cfg = compose_cfg(["train.global_batch=8", "train.micro_batch=2"])
    validate(cfg, world=4)
    with pytest.raises(UserError, match="world size 3"):
        validate(cfg, world=3)
    cfg = compose_cfg(["det.tier=4", "train.global_batch=12", "train.micro_batch=2"])
    with pytest.raises(UserError, match="det.tier=4 needs a power-of-two world size"):
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
