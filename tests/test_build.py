"""``build_run`` (dettrain/loop/build.py) is the one assembly of a run: the Trainer and every tool that measures,
replays or checks a run build through it, and ``Run.close()`` puts every process-wide switch it made back as it was
before (torch's ``F.scaled_dot_product_attention``, the attention kernel's mode, batch-invariant mode, the loss
function), also when the build fails part-way.

On this CPU machine batch-invariant mode cannot be switched on (it needs Triton): the test lets it be on before
the build by setting the kernels module's own Triton flag, which only allows the switch (no kernel runs on CPU
tensors)."""

from __future__ import annotations

import ast

import pytest
import torch
import torch.nn.functional as F
from conftest import REPO, gpu

from dettrain.config import Config, TrainConfig
from dettrain.data import DataConfig
from dettrain.determinism import DetConfig
from dettrain.dist import DistInfo
from dettrain.errors import UserError
from dettrain.kernels import attention as kernel
from dettrain.kernels import batch_invariant as bi
from dettrain.loop.build import Run, build_run
from dettrain.models import attention as attention_route
from dettrain.models.llama import ModelConfig

CPU = DistInfo(rank=0, world=1, local_rank=0, device=torch.device("cpu"), backend=None)
TORCH_SDPA = F.scaled_dot_product_attention


def tiny(**det) -> Config:
    return Config(model=ModelConfig(dim=32, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=64, seq_len=16),
                  train=TrainConfig(steps=2, global_batch=4, micro_batch=2, compile=False),
                  data=DataConfig(max_bytes=300_000), det=DetConfig(**det))


@pytest.fixture
def callers_settings(monkeypatch):
    """A caller whose process-wide settings are not dettrain's defaults: its own SDPA wrapper, the attention kernel
    in mode ``never``, batch-invariant mode on, a loss function of its own.  Put back to the defaults afterwards."""
    monkeypatch.setattr(bi, "HAVE_TRITON", True)  # allows set_enabled(True) on CPU (CPU tensors never use it)

    def mine(*args, **kwargs):
        return TORCH_SDPA(*args, **kwargs)

    def loss(logits, target):
        return bi.eager_cross_entropy(logits, target)

    F.scaled_dot_product_attention = mine
    kernel.set_attention("never")
    bi.set_enabled(True)
    bi.set_loss_fn(loss)
    yield mine, loss
    F.scaled_dot_product_attention = TORCH_SDPA
    kernel.set_attention("off")
    bi.set_enabled(False)
    bi.set_loss_fn(None)


def settings() -> tuple:
    return (F.scaled_dot_product_attention, kernel.attention_mode(), kernel.attention_strict(), bi.enabled(),
            bi._LOSS_FN)


def test_close_puts_every_switch_back(callers_settings):
    mine, loss = callers_settings
    before = settings()
    assert before == (mine, "never", False, True, loss)
    cfg = tiny(tier=3, attention="dettrain")  # the kernel for every call (its fp32 reference on CPU)
    cfg.train.compile = True  # compiles the loss too (lazily: nothing is compiled until it runs)
    run = build_run(cfg, CPU)
    try:
        assert isinstance(run, Run) and run.engine is not None and run.engine_name == "flat"
        assert run.resolved.attention.resolved == "dettrain" and run.compiled.enabled
        # the run's switches while it is open
        assert F.scaled_dot_product_attention is attention_route.sdpa
        assert (kernel.attention_mode(), kernel.attention_strict()) == ("always", True)
        assert not bi.enabled() and bi._LOSS_FN not in (None, loss)
    finally:
        run.close()
    assert settings() == before
    run.close()  # idempotent
    assert settings() == before and run.engine is None


def test_a_with_block_closes_and_a_failed_build_switches_nothing(callers_settings):
    before = settings()
    with build_run(tiny(tier=3, attention="dettrain"), CPU) as run:
        assert F.scaled_dot_product_attention is attention_route.sdpa and run.model.training
    assert settings() == before
    # the model cannot be allocated: refused after the switches were made, and they are undone
    cfg = tiny(tier=3, attention="dettrain")
    cfg.model.vocab_size = 2**31
    with pytest.raises(UserError, match="model.vocab_size"):
        build_run(cfg, CPU)
    assert settings() == before


def test_the_model_alone_and_overrides():
    """``with_engine=False``: the bare model (no process group needed) with torch's autocast for the precision;
    ``engine=`` builds another registered engine; ``compile=`` overrides train.compile only."""
    cfg = tiny(tier=3)
    cfg.train.precision = "bf16"
    with build_run(cfg, CPU, with_engine=False) as run:
        assert run.engine is None and isinstance(run.autocast, torch.autocast)
        assert run.n_params == sum(p.numel() for p in run.model.parameters())
    cfg = tiny(tier=1)
    with build_run(cfg, CPU, engine="flat", compile=True) as run:
        assert run.engine_name == "flat" and run.compiled.enabled and run.compiled.units == ["layers.0", "layers.1"]
        assert not run.resolved.compile  # the override compiles; the resolved choice is still the config's
    assert bi._LOSS_FN is None


def test_the_trainer_runs_the_built_run(tmp_path):
    from dettrain.loop.trainer import Trainer

    before = settings()
    tr = Trainer(tiny(tier=3, attention="dettrain"), CPU, tmp_path)
    try:
        assert isinstance(tr.built, Run)
        assert tr.model is tr.built.model and tr.engine is tr.built.engine and tr.autocast is tr.built.autocast
        assert tr.attention is tr.built.attention and F.scaled_dot_product_attention is attention_route.sdpa
    finally:
        tr.close()
    assert settings() == before


# ---- nobody retypes the sequence --------------------------------------------------------------------------------
ASSEMBLY = {"resolve", "build_model", "compile_model", "engine_class", "lookup", "check_fits", ".from_config",
            "bi.set_enabled", ".install", ".route"}
"""What build_run does (a bare function name, or ``.attr`` for a method or module function): a caller that calls
any of these assembles a run of its own."""
BUILDERS = {  # module -> the functions that build the trainer's run (None: the whole module)
    "dettrain/loop/trainer.py": None,
    "dettrain/tools/trace.py": None,
    "dettrain/tools/verify.py": None,
    "dettrain/tools/memory.py": {"measure"},  # the stock baseline and the FakeTensor estimate are stock FSDP2
}
NOT_ASSEMBLY = {"guard.install"}  # the preemption guard's signal handlers


def _calls(node: ast.AST) -> set[str]:
    """Called names: ``f`` for ``f(...)``, ``x.f`` for ``x.f(...)``, ``.f`` for other attribute calls."""
    names = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Call):
            f = n.func
            if isinstance(f, ast.Attribute):
                names.add(f"{f.value.id}.{f.attr}" if isinstance(f.value, ast.Name) else f".{f.attr}")
            elif isinstance(f, ast.Name):
                names.add(f.id)
    return names - NOT_ASSEMBLY


def _assembles(name: str) -> bool:
    return name in ASSEMBLY or any(a.startswith(".") and name.endswith(a) for a in ASSEMBLY)


@pytest.mark.parametrize("path", sorted(BUILDERS))
def test_callers_build_through_build_run(path):
    tree = ast.parse((REPO / path).read_text(encoding="utf-8"))
    only = BUILDERS[path]
    scopes = [tree] if only is None else [n for n in ast.walk(tree)
                                          if isinstance(n, ast.FunctionDef) and n.name in only]
    assert scopes, path
    called = set().union(*(_calls(s) for s in scopes))
    assert "build_run" in called, f"{path} does not build through build_run"
    own = sorted(c for c in called if _assembles(c))
    assert not own, f"{path} assembles a run itself: {own}"


@gpu
def test_batch_invariant_mode_on_cuda_lasts_as_long_as_the_run():
    """Tier 4, eager, on CUDA: batch-invariant mode and dettrain's attention for the run, torch's after it."""
    cuda = DistInfo(rank=0, world=1, local_rank=0, device=torch.device("cuda", 0), backend=None)
    before = settings()
    with build_run(tiny(tier=4), cuda) as run:
        assert run.resolved.batch_invariant and bi.enabled() and run.attention.resolved == "dettrain"
        assert F.scaled_dot_product_attention is attention_route.sdpa
    assert settings() == before and not bi.enabled()
