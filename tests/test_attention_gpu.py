"""det.attention on the GPU: HF models through dettrain's kernel give the bits of dettrain's own LLaMA attention,
rerun identically compiled at tier 3 (llama, qwen2, mistral), and the padded head sizes are rerun-stable."""

from __future__ import annotations

import pytest
import torch
from conftest import gpu, step_fields, train

from dettrain.kernels import attention as kernel
from dettrain.models import attention as route
from dettrain.record.ledger import read_ledger

transformers = pytest.importorskip("transformers")

pytestmark = gpu


@pytest.fixture
def routed():
    """The route a tier-3 run on CUDA installs (det.attention=auto), taken out afterwards."""
    route.install(route.AttentionChoice("auto", "dettrain", "triton", "test"))
    yield
    route.uninstall()


def _hf_attention_module(heads: int, kv_heads: int, head_dim: int, model_type: str = "llama"):
    from dettrain.models.hf import from_config

    m = from_config(256, 64, model_type=model_type, hidden_size=heads * head_dim, intermediate_size=64,
                    num_hidden_layers=1, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim)
    return m.hf.model.layers[0].self_attn.cuda()


def _qkv(B: int, H: int, HKV: int, T: int, D: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(B, n, T, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
            for n in (H, HKV, HKV)]


@pytest.mark.parametrize("H,HKV,D", [(12, 12, 64), (8, 2, 64), (8, 4, 128), (4, 4, 128)])
def test_hf_attention_gives_the_bits_of_dettrains_llama_attention(routed, H, HKV, D):
    # models/llama.py's kernel path is kernel.attention(q, k, v) (default scale); HF's call passes
    # scaling=head_dim**-0.5
    mod = _hf_attention_module(H, HKV, D)
    q, k, v = _qkv(2, H, HKV, 256, D)
    do = torch.randn(2, H, 256, D, device="cuda", dtype=torch.bfloat16)
    out_hf, _ = route.hf_attention(mod, q, k, v, None, dropout=0.0, scaling=mod.scaling)
    g_hf = torch.autograd.grad(out_hf, (q, k, v), do.transpose(1, 2))
    out_ll = kernel.attention(q, k, v)
    g_ll = torch.autograd.grad(out_ll, (q, k, v), do)
    assert torch.equal(out_hf, out_ll.transpose(1, 2))
    for a, b in zip(g_hf, g_ll):
        assert torch.equal(a, b)


def test_the_hf_model_calls_the_kernel_in_every_layer_compiled(routed):
    from dettrain.models.hf import from_config

    m = from_config(256, 128, hidden_size=256, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
                    num_key_value_heads=2).cuda()
    found = []

    def backend(gm, inputs):
        found.append(sum("bi_attention" in str(n.target) for n in gm.graph.nodes))
        return gm.forward

    torch._dynamo.reset()
    cm = torch.compile(m, backend=backend, fullgraph=True, dynamic=False)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        cm(torch.randint(0, 256, (2, 128), device="cuda")).float().sum().backward()
    assert found == [3]


@pytest.mark.parametrize("D", [80, 96])
def test_padded_head_sizes_are_rerun_stable_and_exact_to_rounding(routed, D):
    q, k, v = _qkv(4, 8, 4, 512, D, seed=D)
    do = torch.randn(4, 8, 512, D, device="cuda", dtype=torch.bfloat16)
    runs = []
    for _ in range(3):
        o = kernel.attention(q, k, v, D ** -0.5)
        runs.append([o.detach(), *torch.autograd.grad(o, (q, k, v), do)])
    for r in runs[1:]:
        for a, b in zip(runs[0], r):
            assert torch.equal(a, b)
    ref = route.reference_attention(q.detach(), k.detach(), v.detach())
    assert float((runs[0][0].double() - ref).norm() / ref.norm()) < 1e-2


def test_batch_invariant_through_the_hf_route(routed):
    # batch invariance is det.batch_invariant's promise (outside it the forward may be cuDNN's: kernels/attention.py)
    from dettrain.kernels import batch_invariant

    mod = _hf_attention_module(8, 2, 64)
    q, k, v = _qkv(8, 8, 2, 384, 64, seed=3)
    batch_invariant.set_enabled(True)
    try:
        assert not kernel.cudnn_forward(q, k)
        full = route.hf_attention(mod, q, k, v, None, scaling=mod.scaling)[0]
        for b in (1, 3):
            part = route.hf_attention(mod, q[:b], k[:b], v[:b], None, scaling=mod.scaling)[0]
            assert torch.equal(part, full[:b])
    finally:
        batch_invariant.set_enabled(False)


HF = ["model=hf_llama", "model.seq_len=256", "model.hidden_size=256", "model.intermediate_size=512",
      "model.num_hidden_layers=2", "model.num_attention_heads=4", "model.num_key_value_heads=2",
      "train.steps=6", "train.global_batch=8", "train.micro_batch=4", "data.max_bytes=2000000",
      "log.wandb.mode=disabled", "log.every=1", "train.compile=true"]


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "mistral"])
def test_hf_models_rerun_identically_at_tier_3_compiled(tmp_path, model_type):
    runs = [tmp_path / "a", tmp_path / "b"]
    for r in runs:
        train(r, *HF, f"model.model_type={model_type}", "det.tier=3", tiny=False)
    h, _ = read_ledger(runs[0])
    assert h["attention"]["resolved"] == "dettrain" and h["attention"]["hf_attn_implementation"] == "dettrain"
    assert h["compile"]["enabled"] is True
    a, b = step_fields(runs[0]), step_fields(runs[1])
    assert len(a) == 6 and a == b
