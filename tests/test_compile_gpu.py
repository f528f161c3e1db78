"""train.compile on the GPU (skipped on CI, which has none): the Triton kernels as custom ops under torch.compile, and
compiled tier-3/tier-4 training reruns.

Promises checked: every dettrain kernel entry point traces into one graph with the custom op as its node and, compiled,
gives the eager bits (outputs and gradients); a transformer block with det.batch_invariant on traces into one graph
that calls the custom ops; two compiled tier-3 runs (dettrain's attention kernel) and two compiled tier-4 runs
(every batch-invariant kernel), each compiling from its own empty Inductor cache, write identical ledgers.

Any model (train.compile=auto never crashes one): a GRU LM (compiled whole: falls back to eager) and a model with
GRU blocks beside MLP blocks (the MLPs compiled, the GRUs eager) train at tier 3 with the default train.compile=auto,
record the choice per module in the header, warn once, and rerun identically; tiny Hugging Face Llama, Qwen2 and
Mistral models (the presets, 2 layers) at tier 3 with train.compile=true compile block by block and rerun
identically."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from conftest import REPO, gpu, step_fields, train

from dettrain.record.ledger import read_ledger

pytestmark = gpu


@pytest.fixture
def bi():
    pytest.importorskip("triton", reason="the kernels need Triton (installed with CUDA builds of torch)")
    from dettrain.kernels import batch_invariant

    batch_invariant.set_enabled(True)
    yield batch_invariant
    batch_invariant.set_enabled(False)
    torch._dynamo.reset()


def _ops(bi, x, w_lin, w_norm, q, k, v, logits, target):
    from dettrain.kernels import attention as attn

    return (bi.linear(x, w_lin), bi.rms_norm(x, w_norm, 1e-5), attn.attention(q, k, v),
            bi.cross_entropy_rows(logits, target))


def test_custom_ops_compiled_match_eager_bitwise(bi):
    from dettrain.loop.compile import COMPILE_OPTIONS

    g = torch.Generator(device="cuda").manual_seed(0)

    def r(*shape, dt=torch.bfloat16):
        return torch.randn(*shape, generator=g, device="cuda", dtype=dt).requires_grad_()

    args = (r(512, 768), r(1536, 768), r(768, dt=torch.float32), r(2, 8, 256, 64), r(2, 2, 256, 64),
            r(2, 2, 256, 64), r(512, 32000), torch.randint(0, 32000, (512,), device="cuda", generator=g))

    def fn(*a):
        return _ops(bi, *a)

    torch._dynamo.reset()
    ex = torch._dynamo.explain(fn)(*args)
    assert ex.graph_break_count == 0 and len(ex.graphs) == 1
    targets = {str(n.target) for n in ex.graphs[0].graph.nodes if n.op == "call_function"}
    assert {f"dettrain.{n}.default" for n in ("bi_linear", "bi_rms_norm", "bi_attention", "bi_cross_entropy")} \
        <= targets
    torch._dynamo.reset()
    eager = fn(*args)
    comp = torch.compile(fn, **COMPILE_OPTIONS)(*args)
    gouts = [torch.randn(t.shape, device="cuda", dtype=t.dtype, generator=g) for t in eager]
    inputs = [a for a in args if a.requires_grad]
    ge = torch.autograd.grad(eager, inputs, gouts)
    gc = torch.autograd.grad(comp, inputs, gouts)
    for a, b in zip((*eager, *ge), (*comp, *gc)):
        assert torch.equal(a, b)


def test_batch_invariant_block_traces_into_one_graph_of_custom_ops(bi):
    from dettrain.models.llama import ModelConfig, build_model

    cfg = ModelConfig(dim=256, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=512, vocab_size=512, seq_len=128)
    model = build_model(cfg, seed=0, device="cuda")
    x = torch.randn(2, 128, 256, device="cuda", requires_grad=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        ex = torch._dynamo.explain(model.layers[0])(x, model.rope_cos, model.rope_sin)
    assert ex.graph_break_count == 0 and len(ex.graphs) == 1
    targets = {str(n.target) for n in ex.graphs[0].graph.nodes if n.op == "call_function"}
    assert {"dettrain.bi_linear.default", "dettrain.bi_rms_norm.default", "dettrain.bi_attention.default"} <= targets


@pytest.mark.parametrize("tier", [3, 4])
def test_compiled_training_reruns_identically(tmp_path, tier: int) -> None:
    """Two compiled runs, each compiling from scratch (its own Inductor cache), write the same step lines."""
    pytest.importorskip("triton")
    over = [f"det.tier={tier}", "train.precision=bf16", "model.vocab_size=512", "train.compile=true"]
    pa = train(tmp_path / "a", *over, env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache_a")})
    train(tmp_path / "b", *over, env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache_b")})
    assert "compile+first step" in pa.stdout
    fa = step_fields(tmp_path / "a")
    assert len(fa) == 4 and fa == step_fields(tmp_path / "b")
    la = (tmp_path / "a" / "ledger.jsonl").read_text().splitlines()[1:]
    assert la == (tmp_path / "b" / "ledger.jsonl").read_text().splitlines()[1:]


TESTS = Path(__file__).resolve().parent
SMALL_RUN = ["train.steps=4", "train.global_batch=8", "train.micro_batch=2", "data.max_bytes=300000",
             "log.wandb.mode=disabled", "log.every=1"]


def _two_runs(tmp_path: Path, over: list[str], env: dict | None = None):
    """Two runs of ``over``, each compiling from its own empty Inductor cache; (stdout of the first, its header)."""
    env = env or {}
    pa = train(tmp_path / "a", *over, tiny=False, env={**env, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache_a")})
    train(tmp_path / "b", *over, tiny=False, env={**env, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache_b")})
    fa = step_fields(tmp_path / "a")
    assert len(fa) == 4 and fa == step_fields(tmp_path / "b")  # whole step lines
    return pa.stdout, read_ledger(tmp_path / "a")[0]


@pytest.mark.parametrize("target,modules", [
    ("custom_models.gru_lm", {"<model>": "eager"}),
    ("custom_models.HybridLM", {"mixers.0": "eager", "mixers.1": "eager", "mlps.0": "fullgraph",
                                "mlps.1": "fullgraph"}),
], ids=["gru", "gru-and-mlp-blocks"])
def test_gru_models_at_tier_3_with_compile_auto_rerun_identically(tmp_path, target, modules):
    pytest.importorskip("triton", reason="train.compile=auto is on for CUDA with Triton")
    env = {"PYTHONPATH": os.pathsep.join([str(TESTS), str(REPO), os.environ.get("PYTHONPATH", "")])}
    over = ["model=custom", f"model._target_={target}", "model.seq_len=32", "det.tier=3", "train.compile=auto",
            *SMALL_RUN]
    out, header = _two_runs(tmp_path, over, env)
    c = header["compile"]
    assert c["setting"] == "auto" and c["enabled"] and c["loss"] and c["modules"] == modules
    assert c["units"] == sum(v == "fullgraph" for v in modules.values())
    assert all("Attempted to wrap RNN, GRU, or LSTM" in c["fallback"][n] for n, v in modules.items() if v == "eager")
    warnings = [ln for ln in out.splitlines() if ln.startswith("train.compile=auto:")]
    assert len(warnings) == 1 and "runs eagerly" in warnings[0], out[-3000:]


@pytest.mark.parametrize("preset", ["hf_llama", "hf_qwen2", "hf_mistral"])
def test_hf_models_at_tier_3_compiled_rerun_identically(tmp_path, preset):
    """The presets (seq_len 128; Mistral's 64-token window masks) with 2 layers, compiled block by block."""
    pytest.importorskip("triton")
    pytest.importorskip("transformers")
    out, header = _two_runs(tmp_path, [f"model={preset}", "model.num_hidden_layers=2", "det.tier=3",
                                       "train.compile=true", *SMALL_RUN])
    c = header["compile"]
    assert c["enabled"] and c["modules"] == {f"hf.model.layers.{i}": "fullgraph" for i in range(2)}
    assert c["units"] == 2 and not c["fallback"] and "compile+first step" in out
