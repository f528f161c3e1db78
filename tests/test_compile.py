"""train.compile on CPU (Inductor's C++ backend): no graph breaks, the custom ops, and every tier's promise compiled.

Promises checked: a transformer block traces into one graph at tiers 0-3 (with and without activation checkpointing
and dropout), and so does the loss; dettrain's kernels are registered custom ops whose fake implementations give
the real shapes, dtypes and strides, which Dynamo records as single nodes and whose compiled outputs and gradients
are the eager ones bit for bit; the attention op returns its outputs in its inputs' layout with the values of
contiguous inputs; a graph cached under other kernel sources is not reused; compiling keeps parameter names; bad
settings are refused with the key and the fix; and with compile on, tier-2 reruns write identical step lines,
tier 3 on 2 ranks gives the same bits for any bucket size (and sharded optimizer), tier 4 the same bits on 1 and 2
ranks.  Compile is slow on 2 cores, so the runs are the 2-layer TINY job and few; a 2-rank run spends ~25 s
starting and ~17 s compiling here.

Any model: the units are the block list (dettrain's ``layers``, a Hugging Face model's ``hf.model.layers``, any list
of identical blocks) or the whole model; each distinct unit is traced by Dynamo before compiling, without moving
the RNG; ``auto`` compiles what traces and runs a GRU block eagerly with one warning line, recording the choice per
module in the header; ``true`` refuses it, and a GRU model run with train.compile=true exits 2 with one line naming
the module and the fix, before any ledger is written.
"""

from __future__ import annotations

import copy
import logging
import os
import subprocess
import sys
from pathlib import Path

import custom_models
import pytest
import torch
from conftest import REPO, step_fields, train
from torch import nn

from dettrain.config import Config, TrainConfig, validate
from dettrain.determinism import DetConfig, apply_tier
from dettrain.errors import UserError
from dettrain.kernels import attention as attn
from dettrain.kernels import batch_invariant as bi
from dettrain.loop.compile import COMPILE_OPTIONS, compile_model, compile_units, resolve_compile
from dettrain.models.custom import CustomModelConfig
from dettrain.models.llama import ModelConfig, build_model, rope_tables
from dettrain.record.ledger import read_ledger
from dettrain.sync.fsdp import transformer_blocks

SMALL = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, seq_len=32)
COMPILE = ["train.compile=true"]
TESTS = Path(__file__).resolve().parent
HF_TINY = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2}


@pytest.fixture
def restore_tier():
    """apply_tier changes process-wide torch settings: put tier 0 back (torch's defaults here) afterwards."""
    yield
    apply_tier(DetConfig(tier=0, threads=0))
    torch._dynamo.reset()


def _graph_breaks(fn, *args) -> tuple[int, list]:
    torch._dynamo.reset()
    ex = torch._dynamo.explain(fn)(*args)
    return ex.graph_break_count, ex.graphs


@pytest.mark.parametrize("tier,extra", [(0, {}), (1, {}), (2, {}), (3, {}),
                                        (3, {"activation_checkpointing": True, "dropout": 0.1})],
                         ids=["tier0", "tier1", "tier2", "tier3", "tier3-ckpt-dropout"])
def test_block_and_loss_trace_without_graph_breaks(restore_tier, tier, extra):
    apply_tier(DetConfig(tier=tier))
    model = build_model(ModelConfig(**{**SMALL.__dict__, **extra}), seed=0)
    model.train()
    cos, sin = rope_tables(16, SMALL.seq_len, SMALL.rope_theta)
    x = torch.randn(2, SMALL.seq_len, SMALL.dim, requires_grad=True)
    breaks, block_graphs = _graph_breaks(model.layers[0], x, cos, sin)
    assert breaks == 0 and len(block_graphs) == 1
    logits = torch.randn(2, SMALL.seq_len, SMALL.vocab_size, requires_grad=True)
    target = torch.randint(0, SMALL.vocab_size, (2, SMALL.seq_len))
    breaks, graphs = _graph_breaks(bi.eager_cross_entropy, logits, target)
    assert breaks == 0 and len(graphs) == 1
    if extra.get("activation_checkpointing"):  # the checkpoint is inside the block's graph, as a recomputed region
        assert "tag_activation_checkpoint" in {str(n.target) for n in block_graphs[0].graph.nodes}


def _op_module(x, w_lin, w_norm, q, k, v, logits, target):
    """Every dettrain kernel entry point, as the model and the loss call them."""
    y = bi.linear(x, w_lin)
    n = bi.rms_norm(x, w_norm, 1e-5)
    o = attn.attention(q, k, v)
    ce = bi.cross_entropy_rows(logits, target)
    return y, n, o, ce


def _op_inputs(dtype: torch.dtype):
    g = torch.Generator().manual_seed(0)

    def r(*shape, dt=dtype):
        return torch.randn(*shape, generator=g, dtype=dt).requires_grad_()

    return (r(6, 32), r(48, 32), r(32, dt=torch.float32), r(2, 4, 16, 16), r(2, 2, 16, 16), r(2, 2, 16, 16),
            r(10, 50), torch.randint(0, 50, (10,), generator=g))


def test_custom_ops_registered_with_fake_shapes_and_pass_opcheck():
    for name in bi.CUSTOM_OPS + attn.CUSTOM_OPS:
        assert hasattr(torch.ops.dettrain, name), name
    # fake implementations: the real ops' shapes, dtypes and strides, on FakeTensors (no kernel runs)
    from torch._subclasses.fake_tensor import FakeTensorMode

    real = _op_module(*_op_inputs(torch.bfloat16))
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake = _op_module(*_op_inputs(torch.bfloat16))
    for r, f in zip(real, fake):
        assert (r.shape, r.dtype, r.stride()) == (f.shape, f.dtype, f.stride())
    # torch's own checker: schema, fake vs real, autograd registration, AOT dispatch (CPU reference kernels)
    x, w_lin, w_norm, q, k, v, logits, target = _op_inputs(torch.float32)
    for op, args in ((bi.mm_op, (x, w_lin.detach().t().contiguous().requires_grad_())), (bi.linear_op, (x, w_lin)),
                     (bi.rms_norm_op, (x, w_norm, 1e-5)), (bi.cross_entropy_op, (logits, target)),
                     (attn.attention_op, (q, k, v))):
        torch.library.opcheck(op, args)


def test_custom_ops_compile_as_single_nodes_with_eager_bits():
    args = _op_inputs(torch.float32)
    breaks, graphs = _graph_breaks(_op_module, *args)
    assert breaks == 0 and len(graphs) == 1
    targets = {str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"}
    for name in ("bi_linear", "bi_rms_norm", "bi_attention", "bi_cross_entropy"):
        assert f"dettrain.{name}.default" in targets, (name, targets)
    torch._dynamo.reset()
    compiled = torch.compile(_op_module, **COMPILE_OPTIONS)
    eager_out = _op_module(*args)
    comp_out = compiled(*args)
    grads_out = [torch.randn(t.shape, generator=torch.Generator().manual_seed(i)) for i, t in enumerate(eager_out)]
    inputs = [a for a in args if a.requires_grad]
    ge = torch.autograd.grad(eager_out, inputs, grads_out)
    gc = torch.autograd.grad(comp_out, inputs, grads_out)
    # Inductor calls the ops as they are: their outputs, and the gradients their backward ops produce, keep the bits
    for a, b in zip((*eager_out, *ge), (*comp_out, *gc)):
        assert torch.equal(a, b)


def _qkv_layouts():
    """q, k, v as a model hands them over: transposed views of (B, T, heads, D) projections (dettrain's LLaMA), slices
    of one fused projection (a fused kv), contiguous tensors, and a head dim that is not contiguous."""
    g = torch.Generator().manual_seed(1)
    B, T, H, HKV, D = 2, 16, 4, 2, 16
    q = torch.randn(B, T, H, D, generator=g).transpose(1, 2)
    kv = torch.randn(B, T, 2, HKV, D, generator=g).permute(2, 0, 3, 1, 4)
    contiguous = tuple(t.contiguous() for t in (q, kv[0], kv[1]))
    odd_head = tuple(t.transpose(-1, -2).contiguous().transpose(-1, -2) for t in contiguous)
    return {"transposed": (q, kv[0], kv[1]), "contiguous": contiguous, "head dim strided": odd_head}


@pytest.mark.parametrize("layout", ["transposed", "contiguous", "head dim strided"])
def test_attention_outputs_take_the_inputs_layout_with_the_same_values(layout):
    """O and dQ come back in q's layout, dK in k's, dV in v's (dense, head dim last), as cuDNN's attention lays them
    out, so the model's transpose + reshape after the op is a view; the values are those of contiguous inputs, bit
    for bit, and the fakes (what a compiled graph assumes) give the real strides."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, k, v = (t.clone().requires_grad_() for t in _qkv_layouts()[layout])
    o, lse = attn.attention_op(q, k, v)
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(2))
    grads = attn.attention_bwd_op(q, k, v, o, lse, do)
    ref_o, ref_lse = attn.attention_op(*(t.detach().contiguous() for t in (q, k, v)))
    ref = attn.attention_bwd_op(*(t.detach().contiguous() for t in (q, k, v)), ref_o, ref_lse, do)
    assert torch.equal(o, ref_o) and torch.equal(lse, ref_lse)
    assert all(torch.equal(a, b) for a, b in zip(grads, ref))
    for out, x in zip((o, *grads), (q, q, k, v)):
        expect = x.stride() if x.stride(-1) == 1 else x.contiguous().stride()
        assert out.stride() == expect, (layout, out.stride(), x.stride())
    if layout == "transposed":  # the model's o.transpose(1, 2).reshape(B, T, -1) needs no copy
        assert o.transpose(1, 2).is_contiguous()
    with FakeTensorMode(allow_non_fake_inputs=True):
        fo, flse = attn.attention_op(q, k, v)
        fgrads = attn.attention_bwd_op(q, k, v, fo, flse, do)
    assert [t.stride() for t in (fo, *fgrads)] == [t.stride() for t in (o, *grads)]
    torch.library.opcheck(attn.attention_op, (q, k, v))


def test_a_graph_cached_under_other_kernel_sources_is_not_reused(tmp_path):
    """torch.compile's caches key a graph on its ops, not on a custom op's code: dettrain puts its kernels' sources
    into the key (``tag_compile_caches``).  A copy of dettrain whose attention returns contiguous outputs (an older
    layout) compiles into a cache first; this checkout then compiles the same function with the same cache and
    gets its own layout and the eager bits, where a reused graph would stop at Inductor's stride assertion."""
    import shutil

    old = tmp_path / "old"
    shutil.copytree(REPO / "dettrain", old / "dettrain", ignore=shutil.ignore_patterns("__pycache__"))
    with open(old / "dettrain" / "kernels" / "attention.py", "a") as f:
        f.write("\n\ndef _out_strides(x):  # contiguous: the layout before outputs followed their inputs\n"
                "    return torch.empty(x.shape, device='meta').stride()\n")
    script = tmp_path / "run.py"
    script.write_text(
        "import sys, torch\n"
        "import torch.compiler.config as cc\n"
        "from dettrain.kernels import attention as attn\n"
        "g = torch.Generator().manual_seed(0)\n"
        "x = torch.randn(2, 16, 64, generator=g, requires_grad=True)\n"
        "w = torch.randn(64, 96, generator=g) / 8\n"
        "def f(x):\n"
        "    q, k, v = (x @ w).view(2, 16, 3, 2, 16).permute(2, 0, 3, 1, 4)\n"
        "    o = attn.attention(q, k, v)\n"
        "    return o.transpose(1, 2).reshape(2, 16, 32)\n"
        "y = torch.compile(f, fullgraph=True, dynamic=False)(x)\n"
        "(gx,) = torch.autograd.grad(y.square().sum(), x)\n"
        "x2 = x.detach().requires_grad_()\n"
        "ye = f(x2)\n"
        "(ge,) = torch.autograd.grad(ye.square().sum(), x2)\n"
        "print('tag', cc.cache_key_tag)\n"
        "print('equal', torch.equal(y, ye), torch.equal(gx, ge))\n")
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache"), "TORCHINDUCTOR_FX_GRAPH_CACHE": "1",
           "TORCHINDUCTOR_AUTOGRAD_CACHE": "1"}
    outs = []
    for path in (old, REPO):
        p = subprocess.run([sys.executable, str(script)], env={**env, "PYTHONPATH": str(path)}, capture_output=True,
                           text=True, timeout=600, cwd=tmp_path)
        assert p.returncode == 0, p.stderr[-3000:]
        outs.append(p.stdout)
    tags = [next(line for line in o.splitlines() if line.startswith("tag ")) for o in outs]
    assert tags[0] != tags[1] and all("dettrain-kernels-" in t for t in tags)
    assert all("equal True True" in o for o in outs), outs


def test_compile_model_keeps_names_and_resolves_auto(restore_tier):
    cpu = torch.device("cpu")
    assert resolve_compile("auto", cpu) is False and resolve_compile(True, cpu) is True
    assert resolve_compile("false", torch.device("cuda")) is False
    model = build_model(SMALL, seed=0)
    names = list(model.state_dict())
    report = compile_model(model, Config(model=SMALL, train=TrainConfig(compile=True)), cpu)
    assert report.enabled and report.units == ["layers.0", "layers.1"] and report.loss
    assert list(model.state_dict()) == names  # no _orig_mod. prefix: checkpoints and fingerprints keep their names
    header = report.header()
    assert header["enabled"] and header["options"] == {"fullgraph": True, "dynamic": False}
    off = compile_model(build_model(SMALL, seed=0), Config(model=SMALL, train=TrainConfig(compile="auto")), cpu)
    assert not off.enabled and bi._LOSS_FN is None  # auto is off on CPU, and resets the compiled loss


def test_bad_settings_are_refused(tmp_path):
    with pytest.raises(UserError, match="train.compile='maybe' must be auto, true or false"):
        validate(Config(train=TrainConfig(compile="maybe")), 1)
    # no C++ compiler for Inductor's CPU backend: refused at start-up with the fix, exit 2
    p = train(tmp_path / "r", *COMPILE, env={"CXX": str(tmp_path / "no-such-g++")}, check=False)
    assert p.returncode == 2, p.stderr[-2000:]
    assert "train.compile=true on CPU needs a C++ compiler" in p.stderr and "train.compile=false" in p.stderr


def test_tier2_compiled_reruns_are_identical_and_recorded(tmp_path):
    a, b, eager = tmp_path / "a", tmp_path / "b", tmp_path / "eager"
    # (both may load Inductor's compiled code from its cache; two cold compiles are left to the GPU test, where
    # they take seconds rather than a minute each)
    pa = train(a, "det.tier=2", "ckpt.final=false", *COMPILE)  # step lines only (no final checkpoint event)
    train(b, "det.tier=2", "ckpt.final=false", *COMPILE)
    la = (a / "ledger.jsonl").read_text().splitlines()[1:]
    assert len(la) == 4 and la == (b / "ledger.jsonl").read_text().splitlines()[1:]
    assert "step 0: compiling (torch.compile" in pa.stdout and "step 0: compile+first step" in pa.stdout
    header, _ = read_ledger(a)
    c = header["compile"]
    assert c["setting"] == "true" and c["enabled"] and c["units"] == 2 and c["loss"]
    assert c["inductor"]["deterministic"] is True and c["inductor"]["coordinate_descent_tuning"] is False
    audit = {r["name"]: r for r in header["audit"]}
    assert audit["inductor deterministic"]["ok"] and audit["inductor deterministic"]["value"] is True
    # against an eager run, diff names the setting and what to expect
    train(eager, "det.tier=2")
    d = subprocess.run([sys.executable, "-m", "dettrain.diff", str(a), str(eager)], cwd=REPO, capture_output=True,
                       text=True, timeout=120)
    assert d.returncode in (0, 1), d.stderr
    assert "hint: train.compile differs (A compiled, B eager)" in d.stdout and "FMA contraction" in d.stdout


def test_tier3_compiled_on_2_ranks_identical_across_bucket_sizes(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    train(a, "det.tier=3", *COMPILE, "dist.bucket_mb=25", nproc=2)
    train(b, "det.tier=3", *COMPILE, "dist.bucket_mb=0.05", "dist.shard_optimizer=true", nproc=2)
    fa = step_fields(a)
    assert len(fa) == 4 and fa == step_fields(b)


def test_tier4_compiled_identical_on_1_and_2_ranks(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    train(one, "det.tier=4", *COMPILE, nproc=1)
    train(two, "det.tier=4", *COMPILE, nproc=2)
    f1 = step_fields(one)
    assert len(f1) == 4 and f1 == step_fields(two)


# ---- any model: units, the probe, the fallback ------------------------------------------------------------------
def test_block_lists_of_dettrain_hf_and_identical_blocks():
    llama = build_model(SMALL, seed=0)
    assert transformer_blocks(llama) == list(llama.layers)
    hybrid = custom_models.HybridLM(50)
    assert transformer_blocks(hybrid) == [*hybrid.mixers, *hybrid.mlps]  # two lists, not named layers
    assert transformer_blocks(custom_models.GRULM(50, 8)) == []  # no list: compiled whole
    assert transformer_blocks(custom_models.MLPLM(50, 8)) == []  # a Sequential of unlike modules is no block list
    unlike = nn.Module()
    unlike.parts = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 8)])  # same class, other shapes
    assert transformer_blocks(unlike) == []
    nested = nn.Module()  # a list inside a found block belongs to that block
    nested.outer = nn.ModuleList(nn.Sequential(nn.Linear(2, 2), nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)]))
                                 for _ in range(3))
    assert transformer_blocks(nested) == list(nested.outer)
    pytest.importorskip("transformers")
    from dettrain.models.hf import from_config

    hf = from_config(64, 16, **HF_TINY)
    assert transformer_blocks(hf) == list(hf.hf.model.layers) == transformer_blocks(hf.hf)


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "mistral"])
def test_hf_blocks_are_probed_and_compiled_one_by_one(restore_tier, model_type):
    pytest.importorskip("transformers")
    from dettrain.models.hf import from_config

    extra = {"sliding_window": 8} if model_type == "mistral" else {}  # a window shorter than the probe's 16 tokens
    model = from_config(64, 16, model_type=model_type, **HF_TINY, **extra)
    names = list(model.state_dict())
    rng = torch.get_rng_state()
    report = compile_units(model, torch.zeros(2, 16, dtype=torch.long), strict=True)
    assert torch.equal(torch.get_rng_state(), rng)  # the probe forward drew nothing from the run's stream
    units = ["hf.model.layers.0", "hf.model.layers.1"]
    assert report.modules == dict.fromkeys(units, "fullgraph") and report.units == units and not report.fallback
    assert all("forward" in b.__dict__ for b in model.hf.model.layers)  # each block's forward compiled in place
    assert "forward" not in model.__dict__ and list(model.state_dict()) == names


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_auto_compiles_what_traces_and_runs_gru_blocks_eagerly(restore_tier):
    """compile_model as train.compile=auto does it (forced on, on this CPU): the MLP blocks compiled, the GRU
    blocks eager, one warning line, the choice per module in the header; one forward/backward through Inductor."""
    tokens = torch.zeros(2, 16, dtype=torch.long)
    with pytest.raises(UserError, match=r"^train.compile=true: Dynamo cannot trace mixers.0 \(GRUBlock\) as one "
                       r"graph \(Unsupported: Attempted to wrap RNN, GRU, or LSTM at custom_models.py:\d+\); "
                       r"set train.compile=auto .* or train.compile=false$"):
        compile_units(custom_models.HybridLM(64), tokens, strict=True)
    torch.manual_seed(0)
    model = custom_models.HybridLM(64)
    eager = copy.deepcopy(model)
    cfg = Config(model=CustomModelConfig(_target_="custom_models.HybridLM", vocab_size=64, seq_len=16),
                 train=TrainConfig(compile="auto", micro_batch=2))
    log = logging.getLogger("dettrain")
    records = _Records()
    log.addHandler(records)
    try:
        report = compile_model(model, cfg, torch.device("cpu"), enabled=True)
    finally:
        log.removeHandler(records)
        bi.set_loss_fn(None)  # the compiled loss is process-wide: later tests get the eager one
    assert report.setting == "auto" and report.enabled and report.loss
    assert report.modules == {"mixers.0": "eager", "mixers.1": "eager", "mlps.0": "fullgraph", "mlps.1": "fullgraph"}
    assert report.units == ["mlps.0", "mlps.1"] and set(report.fallback) == {"mixers.0", "mixers.1"}
    assert "Attempted to wrap RNN, GRU, or LSTM" in report.fallback["mixers.0"]
    assert len(records.lines) == 1, records.lines
    assert records.lines[0].startswith("train.compile=auto: mixers.0, mixers.1 (GRUBlock) runs eagerly: Dynamo "
                                       "cannot trace it as one graph (Unsupported: Attempted to wrap RNN")
    header = report.header()
    assert header["modules"] == report.modules and header["fallback"] == report.fallback and header["units"] == 2
    assert all("forward" not in b.__dict__ for b in model.mixers) and all("forward" in b.__dict__ for b in model.mlps)
    # it trains: the same values as the eager copy up to Inductor's rounding (fused, FMA-contracted MLPs)
    tok = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    out, ref = model(tok), eager(tok)
    out.square().mean().backward()
    ref.square().mean().backward()
    torch.testing.assert_close(out, ref)
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_gru_model_with_compile_true_exits_2_naming_the_module(tmp_path):
    env = {"PYTHONPATH": os.pathsep.join([str(TESTS), str(REPO), os.environ.get("PYTHONPATH", "")])}
    p = train(tmp_path / "g", "model=custom", "model._target_=custom_models.gru_lm", "model.seq_len=32", *COMPILE,
              "train.steps=2", "train.global_batch=4", "train.micro_batch=2", "data.max_bytes=300000",
              "log.wandb.mode=disabled", tiny=False, env=env, check=False)
    assert p.returncode == 2, p.stderr[-3000:]
    lines = [ln for ln in p.stderr.splitlines() if "train.compile=true" in ln]
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert ("Dynamo cannot trace the model (GRULM) as one graph (Unsupported: Attempted to wrap RNN, GRU, or LSTM"
            in lines[0]) and "set train.compile=auto" in lines[0] and lines[0].endswith("or train.compile=false")
    assert not (tmp_path / "g" / "ledger.jsonl").exists()  # refused at start-up, before the header
