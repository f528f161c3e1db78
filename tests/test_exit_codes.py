"""The exit-code contract for bad input: Hydra's own parse and compose errors, UserErrors that Hydra wraps, and a
bad value of every numeric config key exit 2 with one line naming the key (no traceback); a bug in the user's own
model factory keeps its traceback."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import typing
from pathlib import Path

import pytest
from conftest import REPO, TINY, train
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from dettrain.__main__ import hydra_error_line
from dettrain.config import Config, conf_dir, register, to_config, validate
from dettrain.errors import UserError
from dettrain.models.custom import CustomModelConfig
from dettrain.models.llama import ModelConfig

register()
TESTS = Path(__file__).resolve().parent


def one_line_error(p: subprocess.CompletedProcess, *needles: str) -> str:
    """Exit 2, stderr one ``dettrain: error:`` line holding every needle, no traceback."""
    err = p.stderr.strip()
    assert p.returncode == 2, (p.returncode, err[-3000:])
    assert "Traceback" not in err and "HYDRA_FULL_ERROR" not in err, err[-3000:]
    lines = [ln for ln in err.splitlines() if ln.startswith("dettrain: error:")]
    assert len(lines) == 1, err[-3000:]
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def dettrain(*args: str, module: tuple[str, ...] = ("dettrain",), env: dict | None = None,
             ) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    full = {**full, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", *module, *args], cwd=REPO, env=full, capture_output=True,
                          text=True, timeout=300)


# ---- Hydra's own errors, through the real command line -----------------------------------------------------
HYDRA_BAD = [
    (["train.steps=abc"], ["train.steps=abc", "Integer", "train.steps is int"]),
    (["det.tier=2.5"], ["det.tier=2.5", "Integer"]),
    (["train.nonexistent=1"], ["train.nonexistent is not a config key", "train.* keys"]),
    (["train.step=3"], ["did you mean train.steps"]),
    (["+exp=missing"], ["+exp=missing", "no such config", "llm_7b", "--config-dir"]),
    (["model=nosuch"], ["model=nosuch", "tiny"]),
    (["train.lr=1", "2"], ["cannot parse the override '2'", "quote a value"]),  # `train.lr=1 2` unquoted
    (["train.lr=${nope}"], ["train.lr", "nope"]),  # an interpolation to no key: found after composing
    (["+train.foo=1"], ["train.foo is not a config key"]),  # Hydra adds it; the typed schema would drop it
    # an HF model's node has its factory's keys, not dettrain's LLaMA's
    (["model=hf_llama", "model.dim=64"], ["model.dim is not a key of model=hf_llama", "hidden_size", "+model.dim="]),
    (["model=hf_qwen2", "model.foo=1"], ["model.foo is not a key of model=hf_qwen2", "num_hidden_layers"]),
]


@pytest.mark.parametrize("args,needles", HYDRA_BAD, ids=[" ".join(a) for a, _ in HYDRA_BAD])
def test_hydra_errors_exit_2_with_one_line(tmp_path, args, needles):
    p = dettrain(*args, f"run_dir={tmp_path / 'run'}", "log.wandb.mode=disabled")
    one_line_error(p, *needles)
    assert not (tmp_path / "run").exists()  # refused before anything was written


@pytest.mark.parametrize("module", [("dettrain.cli", "train"), ("dettrain",)], ids=["dettrain train", "-m"])
def test_same_through_both_entry_points(tmp_path, module):
    one_line_error(dettrain("train.steps=abc", f"run_dir={tmp_path}", module=module), "train.steps=abc")


def test_hydra_full_error_keeps_hydras_traceback(tmp_path):
    """A user who asks Hydra for the full trace gets it (Hydra's documented switch), not our one line."""
    p = dettrain("train.steps=abc", f"run_dir={tmp_path}", env={"HYDRA_FULL_ERROR": "1"})
    assert p.returncode != 0 and "Traceback" in p.stderr and "ConfigCompositionException" in p.stderr


def test_wrapped_user_error_is_unwrapped(tmp_path):
    """model=hf_llama without transformers: the factory's UserError (which Hydra's instantiate wraps) is the one
    line, exit 2.  Without transformers here means a package of that name that fails to import, first on the path."""
    shadow = tmp_path / "site"
    (shadow / "transformers").mkdir(parents=True)
    (shadow / "transformers" / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'transformers'\", name='transformers')\n")
    env = {"PYTHONPATH": os.pathsep.join([str(shadow), str(REPO), os.environ.get("PYTHONPATH", "")])}
    p = train(tmp_path / "run", "model=hf_llama", "train.steps=1", "log.wandb.mode=disabled", tiny=False, env=env,
              check=False)
    one_line_error(p, "needs transformers", "pip install 'dettrain[hf]'")


def test_factory_bug_shows_the_users_traceback(tmp_path):
    """A factory that raises: its own frames are in the traceback (their bug), with a line that says whose it is;
    not Hydra's one-line InstantiationException."""
    env = {"PYTHONPATH": os.pathsep.join([str(TESTS), str(REPO), os.environ.get("PYTHONPATH", "")])}
    p = train(tmp_path / "run", "model=custom", "model._target_=custom_models.broken_factory", "train.steps=1",
              "log.wandb.mode=disabled", tiny=False, env=env, check=False)
    assert p.returncode not in (0, 2), p.stderr[-3000:]  # not a clean run, not a bad-input refusal
    err = p.stderr
    assert "Traceback" in err and "in broken_factory" in err and "in _build_broken" in err, err[-3000:]
    assert "ZeroDivisionError: broken_factory's own bug" in err
    assert "raised ZeroDivisionError while building the model" in err
    assert "InstantiationException" not in err and "Error in call to target" not in err


# ---- every numeric key of the schema has a bad value that is refused naming it -----------------------------
def _numeric_keys() -> set[str]:
    """Dotted keys of every int/float field (bool excluded; Optional included) of the schema's dataclasses."""
    out: set[str] = set()

    def walk(cls, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.name == "kwargs":  # a custom model's own keys: its factory's business
                continue
            t = hints[f.name]
            args = set(typing.get_args(t)) or {t}
            if dataclasses.is_dataclass(t):
                walk(t, f"{prefix}{f.name}.")
            elif f.name == "model" and cls is Config:
                walk(ModelConfig, "model.")
                walk(CustomModelConfig, "model.")
            elif bool not in args and args & {int, float}:
                out.add(f"{prefix}{f.name}")

    walk(Config, "")
    return out


CUSTOM = ["model=custom", "model._target_=custom_models.MLPLM"]
# key -> bad cases (overrides); each must be refused with a message that names the key
BAD_VALUES: dict[str, list[list[str]]] = {
    "seed": [["seed=abc"]],  # any integer is a seed: only the type is wrong
    "model.dim": [["model.dim=0"]],
    "model.n_layers": [["model.n_layers=0"]],
    "model.n_heads": [["model.n_heads=0"]],
    "model.n_kv_heads": [["model.n_kv_heads=-2"]],
    "model.ffn_dim": [["model.ffn_dim=0"]],
    "model.vocab_size": [["model.vocab_size=-1"], ["model.vocab_size=10000000000"], ["model.vocab_size=1e10"],
                         [*CUSTOM, "model.vocab_size=-3"], [*CUSTOM, "model.vocab_size=10000000000"]],
    "model.seq_len": [["model.seq_len=-1"], [*CUSTOM, "model.seq_len=0"]],
    "model.norm_eps": [["model.norm_eps=0"], ["model.norm_eps=-1e-5"], ["model.norm_eps=nan"]],
    "model.rope_theta": [["model.rope_theta=0"], ["model.rope_theta=-10000"], ["model.rope_theta=inf"]],
    "model.dropout": [["model.dropout=1.0"], ["model.dropout=-0.1"]],
    "model.init_std": [["model.init_std=-0.02"], ["model.init_std=nan"]],
    "data.max_bytes": [["data.max_bytes=0"], ["data.max_bytes=1"]],
    "data.num_workers": [["data.num_workers=-1"]],
    "data.val_fraction": [["data.val_fraction=1.0"], ["data.val_fraction=nan"]],
    "train.steps": [["train.steps=0"]],
    "train.global_batch": [["train.global_batch=0"]],
    "train.micro_batch": [["train.micro_batch=-2"]],
    "train.lr": [["train.lr=nan"]],
    "train.stop_after": [["train.stop_after=-1"]],
    "eval.every": [["eval.every=-1"]],
    "eval.batches": [["eval.every=1", "data.val_fraction=0.1", "eval.batches=0"]],
    "optim.beta1": [["optim.beta1=1.0"]],
    "optim.beta2": [["optim.beta2=-0.5"]],
    "optim.eps": [["optim.eps=0"]],
    "optim.weight_decay": [["optim.weight_decay=-0.1"]],
    "optim.clip_grad_norm": [["optim.clip_grad_norm=-1"]],
    "optim.warmup_steps": [["optim.warmup_steps=-1"]],
    "optim.min_lr_ratio": [["optim.min_lr_ratio=2"]],
    "det.tier": [["det.tier=7"], ["det.tier=2.5"]],
    "det.threads": [["det.threads=0"], ["det.tier=0", "det.threads=-1"]],
    "dist.bucket_mb": [["dist.bucket_mb=0"]],
    "dist.timeout_s": [["dist.timeout_s=0"]],
    "ckpt.every": [["ckpt.every=-1"]],
    "ckpt.keep": [["ckpt.keep=0"]],
    "log.every": [["log.every=0"]],
    "log.tensor_every": [["log.tensor_every=-1"]],
    "log.wandb.timeout_s": [["log.wandb.timeout_s=0"], ["log.wandb.timeout_s=nan"]],
}


def start_up_error(overrides: list[str]) -> str | None:
    """What ``python -m dettrain`` would refuse these overrides with before training (its one line), or None:
    Hydra's compose (hydra_error_line), the typed schema, then config.validate."""
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
            d = compose(config_name="config", overrides=overrides)
        validate(to_config(d), world=1)
    except (HydraException, OmegaConfBaseException) as e:
        return hydra_error_line(e)
    except UserError as e:
        return str(e)
    return None


def test_every_numeric_key_has_a_bad_case():
    """Walks the schema: a numeric key added without a row in BAD_VALUES (and a rule that refuses it) fails here."""
    keys = _numeric_keys()
    assert {"model.norm_eps", "model.init_std", "log.wandb.timeout_s", "eval.batches"} <= keys  # the walk works
    assert not keys - set(BAD_VALUES), f"numeric keys without a bad case: {sorted(keys - set(BAD_VALUES))}"
    assert not set(BAD_VALUES) - keys, f"stale rows: {sorted(set(BAD_VALUES) - keys)}"


@pytest.mark.parametrize("key,overrides", [(k, o) for k, cases in BAD_VALUES.items() for o in cases],
                         ids=[" ".join(o) for cases in BAD_VALUES.values() for o in cases])
def test_bad_value_is_refused_naming_the_key(key, overrides, monkeypatch):
    monkeypatch.syspath_prepend(str(TESTS))  # custom_models for model=custom
    msg = start_up_error(overrides)
    assert msg is not None, f"{overrides} was accepted"
    assert key in msg, msg
    assert "\n" not in msg


def test_too_few_bytes_names_the_minimum():
    msg = start_up_error([*TINY, "data.max_bytes=1"])
    assert msg is not None and "data.max_bytes >= " in msg
    least = int(msg.rsplit(">= ", 1)[1].split()[0])
    assert start_up_error([*TINY, f"data.max_bytes={least}"]) is None  # the minimum is exact: it starts,
    assert start_up_error([*TINY, f"data.max_bytes={least - 1}"]) is not None  # one byte less is refused
    from dettrain.data import SampleDataset, stdlib_corpus

    # and the corpus it gives holds one global batch (train.global_batch=8 of seq_len 64), the one below does not
    assert SampleDataset(stdlib_corpus(least), 64).n >= 8


@pytest.mark.parametrize("overrides,needles", [
    (["data.max_bytes=1"], ["data.max_bytes=1", "data.max_bytes >= "]),
    (["model.norm_eps=0"], ["model.norm_eps=0"]),
    (["det.tier=0", "det.threads=-1"], ["det.threads=-1", ">= 0"]),
    # within the uint32 bound, but 2^31 x 64 x 2 fp32 parameters are 1 TiB: refused before any allocation
    (["model.vocab_size=2147483648"], ["parameters", "GiB", "model.vocab_size=2147483648"]),
], ids=["max_bytes", "norm_eps", "threads", "vocab_size_memory"])
def test_range_errors_through_the_command_line(tmp_path, overrides, needles):
    one_line_error(train(tmp_path / "run", *overrides, check=False), *needles)


def test_threads_zero_at_tier_0_records_what_torch_used(tmp_path):
    """det.threads=0 (torch's default) at tier 0: the header's thread count is the one torch ran with."""
    import json

    p = train(tmp_path / "run", "det.tier=0", "det.threads=0", "train.steps=1", env={"OMP_NUM_THREADS": "2"})
    assert p.returncode == 0
    h = json.loads((tmp_path / "run" / "ledger.jsonl").read_text().splitlines()[0])
    assert h["config"]["det"]["threads"] == 0 and h["threads"] == 2  # what torch used: OMP_NUM_THREADS=2
