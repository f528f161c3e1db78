"""train.compile on the GPU (skipped on CI, which has none): the Triton kernels as custom ops under torch.compile, and
compiled tier-3/tier-4 training reruns.

Promises checked: every dettrain kernel entry point traces into one graph with the custom op as its node and, compiled,
gives the eager bits (outputs and gradients); a transformer block with det.batch_invariant on traces into one graph
that calls the custom ops; two compiled tier-3 runs (dettrain's attention kernel) and two compiled tier-4 runs
(every batch-invariant kernel), each compiling from its own empty Inductor cache, write identical ledgers."""

from __future__ import annotations

import pytest
import torch
from conftest import gpu, step_fields, train

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
    from dettrain.compile import COMPILE_OPTIONS

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
    from dettrain.model import ModelConfig, build_model

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
