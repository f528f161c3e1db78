"""Model shapes, the 7B parameter count on the meta device, and init keyed by (seed, parameter name)."""

from __future__ import annotations

import torch

from dettrain.models.llama import ModelConfig, Transformer, build_model, init_parameters, num_params

SEVEN_B = ModelConfig(name="7b", dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, ffn_dim=11008, vocab_size=32000,
                      seq_len=4096)


def test_7b_on_meta_has_llama2_parameter_count():
    m = build_model(SEVEN_B, seed=0, device="meta")
    n = num_params(m)
    # Llama-2-7B: 6,738,415,616 parameters, counted independently from the published shape
    per_layer = 4 * 4096 * 4096 + 3 * 4096 * 11008 + 2 * 4096
    expect = 32 * per_layer + 2 * 32000 * 4096 + 4096
    assert n == expect and abs(n - 6.74e9) < 0.01e9


def test_forward_shapes_and_gqa():
    cfg = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=100, seq_len=16)
    m = build_model(cfg, seed=1)
    assert m.layers[0].attn.wk.weight.shape == (2 * 16, 64)  # 2 kv heads of width 16
    out = m(torch.randint(0, 100, (3, 16)))
    assert out.shape == (3, 16, 100) and torch.isfinite(out).all()


def test_init_is_keyed_by_parameter_name_not_construction_order():
    cfg = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=100, seq_len=16)
    a = build_model(cfg, seed=3)
    # a deeper model: every shared name must get the same values although more parameters were created first
    deep = build_model(ModelConfig(**{**cfg.__dict__, "n_layers": 3}), seed=3)
    pa, pd = dict(a.named_parameters()), dict(deep.named_parameters())
    for name, p in pa.items():
        if name.endswith(("wo.weight", "w2.weight")):  # their std scales with n_layers: same draw, other scale
            assert torch.allclose(p * (2 * 2) ** 0.5, pd[name] * (2 * 3) ** 0.5, rtol=1e-5, atol=0), name
        else:
            assert torch.equal(p, pd[name]), name
    # re-initialising parameters in reverse order gives the same values
    b = Transformer(cfg)
    with torch.no_grad():
        for p in b.parameters():
            p.zero_()
    init_parameters(b, seed=3)
    for (n1, p1), (n2, p2) in zip(a.named_parameters(), b.named_parameters()):
        assert n1 == n2 and torch.equal(p1, p2)
    # another seed changes every random parameter
    c = build_model(cfg, seed=4)
    assert not torch.equal(a.tok_emb.weight, c.tok_emb.weight)


def test_tied_embeddings_share_the_weight():
    cfg = ModelConfig(dim=64, n_layers=1, n_heads=4, n_kv_heads=4, ffn_dim=96, vocab_size=100, seq_len=8,
                      tie_embeddings=True)
    m = build_model(cfg, seed=0)
    assert m.output is None
    assert num_params(m) == num_params(build_model(ModelConfig(**{**cfg.__dict__, "tie_embeddings": False}), 0)) \
        - 100 * 64
