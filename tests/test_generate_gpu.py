"""dettrain.generate on CUDA (GPU only; skipped without one): generated logits equal the training forward's, bit for
bit, with the Triton batch-invariant kernels (linear, RMSNorm, attention; cuDNN's forward is off in that mode)
under the training run's bf16 autocast and in fp32."""

from __future__ import annotations

import pytest
import torch
from conftest import gpu

from dettrain.generate import generate, token_logprobs
from dettrain.models.llama import ModelConfig, build_model

pytestmark = gpu

SHAPES = {  # head sizes 64 and 128 (the 1b and 7B ones), 80 (zero-padded to 128 by the kernel)
    "d64-gqa": ModelConfig(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=512, vocab_size=512, seq_len=256),
    "d128": ModelConfig(dim=256, n_layers=2, n_heads=2, n_kv_heads=2, ffn_dim=512, vocab_size=512, seq_len=256),
    "d80": ModelConfig(dim=160, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=320, vocab_size=512, seq_len=256),
}


@pytest.fixture
def invariant():
    pytest.importorskip("triton", reason="the kernels need Triton (installed with CUDA builds of torch)")
    from dettrain.kernels import batch_invariant as bi

    bi.set_enabled(True)
    yield
    bi.set_enabled(False)


def _prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(k),), generator=g).tolist() for k in torch.randint(1, 120, (n,), generator=g)]


def _teacher_forced(model, seqs: list[list[int]], dtype) -> list[torch.Tensor]:
    n = max(map(len, seqs))
    toks = torch.zeros(len(seqs), n, dtype=torch.long, device="cuda")
    for b, s in enumerate(seqs):
        toks[b, :len(s)] = torch.tensor(s)
    model.train()
    with torch.no_grad(), torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
        lg = model(toks)
    return [lg[b, :len(s)] for b, s in enumerate(seqs)]  # in the forward's dtype (bf16 under autocast)


@pytest.fixture(params=[False, True], ids=["unfused", "fused"])
def fused(request, monkeypatch):
    """The decode path as it is and with LlamaStepper.FUSED on (stacked projections, one RoPE-and-cache kernel)."""
    from dettrain.generate.llama import LlamaStepper

    monkeypatch.setattr(LlamaStepper, "FUSED", request.param)
    return request.param


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_generated_logits_equal_the_training_forward_on_cuda(invariant, fused, shape, dtype):
    cfg = SHAPES[shape]
    model = build_model(cfg, 0, "cuda")
    prompts = _prompts(6, cfg.vocab_size)
    with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
        out = generate(model, prompts, max_new_tokens=24, temperature=1.0, seed=1, return_logits=True,
                       prefill_chunk=37)
    ref = _teacher_forced(model, [o.prompt + o.tokens for o in out], dtype)
    for o, r in zip(out, ref):
        n = len(o.prompt)
        assert o.training_equal
        assert torch.equal(o.logits, r[n - 1:n - 1 + len(o.tokens)].float().cpu())
        # the trainer's recomputation, from its logits as the forward gives them and from their fp32 copy
        for logits in (r, r.float()):
            assert torch.equal(torch.tensor(o.logprobs),
                               token_logprobs(logits[n - 1:-1], torch.tensor(o.tokens, device="cuda")).cpu())


def test_alone_and_in_a_batch_of_64_on_cuda(invariant, fused):
    cfg = SHAPES["d64-gqa"]
    model = build_model(cfg, 0, "cuda")
    prompts = _prompts(64, cfg.vocab_size, seed=2)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        batch = generate(model, prompts, max_new_tokens=16, temperature=1.0, seed=3, return_logits=True)
        for i in (0, 17, 63):
            alone = generate(model, [prompts[i]], ids=[i], max_new_tokens=16, temperature=1.0, seed=3,
                             return_logits=True, prefill_chunk=5)[0]
            assert alone.tokens == batch[i].tokens and torch.equal(alone.logits, batch[i].logits)


@pytest.mark.parametrize("D,H,HKV", [(64, 4, 2), (128, 2, 2)], ids=["d64-gqa", "d128"])
def test_attention_rows_equal_the_whole_sequence_call(invariant, D, H, HKV):
    """The decode step's attention (only the query blocks holding the rows) gives the whole-sequence call's bits,
    rows starting inside a block, at a block's edge and at the end, one row and many."""
    from dettrain.kernels import attention as kernel

    g = torch.Generator(device="cuda").manual_seed(0)
    B, T = 3, 300
    q, k, v = (torch.randn(B, h, T, D, device="cuda", generator=g).to(torch.bfloat16) for h in (H, HKV, HKV))
    full = kernel.attention(q, k, v)
    # per row count: a start at 0, one at or inside a block (128 is an edge of 64- and 128-row blocks), the end
    for n, mid in ((1, 130), (37, 128), (200, 90)):
        lo = torch.tensor([0, mid, T - n], device="cuda")
        assert int(lo.max()) + n <= T
        rows = kernel.attention_rows(q, k, v, lo, n)
        for b in range(B):
            s = int(lo[b])
            assert torch.equal(rows[b], full[b, :, s:s + n]), (n, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_the_fused_rope_and_cache_writes_give_the_eager_bits(dtype):
    """kernels.decode.rope_into_caches writes apply_rope(q), apply_rope(k) and v at each row's position with the
    eager path's bits (its products, difference, sum and rounding), touching no other slot or column: head sizes
    64 (GQA), 80 in a 128-wide cache, 128."""
    pytest.importorskip("triton", reason="the kernel needs Triton (installed with CUDA builds of torch)")
    from dettrain.kernels.decode import rope_into_caches
    from dettrain.models.llama import apply_rope, rope_tables

    g = torch.Generator(device="cuda").manual_seed(0)
    for H, KV, D, P in ((4, 2, 64, 64), (2, 2, 80, 128), (2, 2, 128, 128)):
        B, T, S = 3, 5, 40
        cos, sin = (t.cuda() for t in rope_tables(D, S, 10000.0))
        qkv = torch.randn(B, T, (H + 2 * KV) * D, device="cuda", generator=g).to(dtype)
        pos = torch.tensor([[0, 1, 2, 3, 4], [10, 11, 12, 13, 14], [30, 31, 32, 33, 34]], device="cuda")
        cq = torch.zeros(B, H, S, P, dtype=dtype, device="cuda")
        ck, cv = torch.zeros(B, KV, S, P, dtype=dtype, device="cuda"), torch.zeros(B, KV, S, P, dtype=dtype,
                                                                                     device="cuda")
        rope_into_caches(qkv.view(B * T, -1), pos, cos, sin, cq, ck, cv, H, KV, D)
        q, k, v = (t.view(B, T, n, D).transpose(1, 2) for t, n in zip(qkv.split([H * D, KV * D, KV * D], -1),
                                                                        (H, KV, KV)))
        for b in range(B):
            c, s = cos[pos[b]], sin[pos[b]]
            assert torch.equal(cq[b][:, pos[b], :D], apply_rope(q[b:b + 1], c, s)[0]), (H, D, b)
            assert torch.equal(ck[b][:, pos[b], :D], apply_rope(k[b:b + 1], c, s)[0]), (H, D, b)
            assert torch.equal(cv[b][:, pos[b], :D], v[b]), (H, D, b)
            rest = torch.ones(S, dtype=torch.bool, device="cuda")
            rest[pos[b]] = False
            assert not cq[b][:, rest].any() and not ck[b][:, rest].any() and not cv[b][:, rest].any()
        assert not cq[..., D:].any() and not ck[..., D:].any()


def test_decode_cuda_graphs_change_no_bit(invariant, fused):
    cfg = SHAPES["d128"]
    model = build_model(cfg, 0, "cuda")
    prompts = _prompts(8, cfg.vocab_size, seed=4)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        on, off = (generate(model, prompts, max_new_tokens=20, temperature=1.0, seed=5, return_logits=True,
                            cuda_graphs=graphs) for graphs in (True, False))
    for a, b in zip(on, off):
        assert a.tokens == b.tokens and torch.equal(a.logits, b.logits) and a.logprobs == b.logprobs


@pytest.mark.parametrize("K,N", [(2048, 2048), (2048, 256), (2048, 5632), (5632, 2048), (2048, 32000), (160, 320)])
def test_the_few_rows_tile_gives_the_training_tiles_bits(invariant, K, N):
    """bi.few_rows (the decode step's matmuls) changes how many columns a program holds, never a row's bits: at the
    1b model's shapes, an odd small one, 1 to 64 rows."""
    from dettrain.kernels import batch_invariant as bi

    if bi.FEW_ROWS_TILE is None:
        pytest.skip("no few-rows tile is set (bi.FEW_ROWS_TILE is None): decode uses the training tile itself")
    g = torch.Generator(device="cuda").manual_seed(K + N)
    w = torch.randn(N, K, device="cuda", generator=g).to(torch.bfloat16)
    for M in (1, 3, 8, 64):
        x = torch.randn(M, K, device="cuda", generator=g).to(torch.bfloat16)
        with bi.few_rows():
            few = bi.linear(x, w)
        assert torch.equal(few, bi.linear(x, w)), M
