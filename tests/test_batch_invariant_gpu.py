"""GPU kernels of tiers 3-4 and of det.batch_invariant (GPU only; skipped on CI, which has none).

Promises checked: the fused AdamW gives the torch reference's bits; the chunked sum of squares is the same for any
split of the buffer; every batch-invariant op gives a sample the same bits in batches of other sizes and at other
positions, and matches fp32 torch math to bf16/fp32 accuracy; the attention backward reruns bit for bit; and two
tier-3 or tier-4 GPU training runs (dettrain's attention; at tier 4 every batch-invariant kernel) write identical
ledgers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import gpu, step_fields, train

pytestmark = gpu


@pytest.fixture(scope="module")
def bi():
    pytest.importorskip("triton", reason="the kernels need Triton (installed with CUDA builds of torch)")
    from dettrain.kernels import batch_invariant

    batch_invariant.set_enabled(True)
    yield batch_invariant
    batch_invariant.set_enabled(False)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())


def test_fused_adamw_equals_torch_reference_bitwise() -> None:
    pytest.importorskip("triton")
    from dettrain.kernels.optim import adamw_

    g = torch.Generator(device="cuda").manual_seed(0)
    n = 1_000_003  # not a multiple of the block
    a = [torch.randn(n, device="cuda", generator=g) * s for s in (1.0, 1e-2)] + [torch.zeros(n, device="cuda")] * 0
    p, grad = a
    m, v = torch.zeros(n, device="cuda"), torch.zeros(n, device="cuda")
    ref = [t.clone() for t in (p, grad, m, v)]
    out = [t.clone() for t in (p, grad, m, v)]
    for step in range(1, 6):
        kw = dict(beta1=0.9, beta2=0.95, lr=3e-4 * step, weight_decay=0.1, eps=1e-8, step=step)
        adamw_(*ref, impl="torch", **kw)
        adamw_(*out, impl="triton", **kw)
        # and on two slices (shards) of the same buffers: an element's update does not depend on its slice
        for t in (p, grad):
            t.add_(torch.randn(n, device="cuda", generator=g) * 1e-3)
        ref[1].copy_(grad)
        out[1].copy_(grad)
    for x, y in zip(ref, out):
        assert torch.equal(x.view(torch.int32), y.view(torch.int32))
    halves = [t.clone() for t in ref]
    whole = [t.clone() for t in ref]
    kw = dict(beta1=0.9, beta2=0.95, lr=1e-3, weight_decay=0.1, eps=1e-8, step=6)
    adamw_(*whole, impl="triton", **kw)
    for a_, b_ in ((0, 333_333), (333_333, n)):
        adamw_(*(t[a_:b_] for t in halves), impl="triton", **kw)
    for x, y in zip(whole, halves):
        assert torch.equal(x, y)


def test_adamw_many_equals_one_update_per_tensor_bitwise() -> None:
    """The FSDP2 engine's one-launch update of many shards gives each tensor exactly the bits of its own adamw_
    call (Triton) and of the torch reference: sizes that are not multiples of the block, one of a single element,
    an empty one, two weight decays, and tensors at addresses that are not 16-byte aligned."""
    pytest.importorskip("triton")
    from dettrain.kernels.optim import adamw_, adamw_many_

    sizes = [1, 2047, 2048, 2049, 4096 * 3 + 5, 0, 1_000_003, 77]
    decays = [0.1 if i % 3 else 0.0 for i in range(len(sizes))]

    def fresh(offset: int) -> list[list[torch.Tensor]]:
        gen = torch.Generator(device="cuda").manual_seed(5)
        quads = []
        for n in sizes:
            ts = [torch.randn(n + offset, device="cuda", generator=gen)[offset:] for _ in range(2)]
            ts += [torch.randn(n + offset, device="cuda", generator=gen)[offset:] * 1e-3,
                   torch.rand(n + offset, device="cuda", generator=gen)[offset:] * 1e-4]
            quads.append(ts)
        return quads

    for offset in (0, 1):  # 1: every address is 4 bytes past a 16-byte boundary (the unaligned variant)
        many, one, ref = fresh(offset), fresh(offset), fresh(offset)
        for step in (1, 2, 7):
            kw = dict(beta1=0.9, beta2=0.95, lr=3e-4 * step, eps=1e-8, step=step)
            adamw_many_(*[[q[j] for q in many] for j in range(4)], weight_decays=decays, **kw)
            for q, r, wd in zip(one, ref, decays):
                adamw_(*q, weight_decay=wd, impl="triton", **kw)
                adamw_(*r, weight_decay=wd, impl="torch", **kw)
            for qm, qo, qr in zip(many, one, ref):
                for a, b, c in zip(qm, qo, qr):
                    assert torch.equal(a.view(torch.int32), b.view(torch.int32))
                    assert torch.equal(a.view(torch.int32), c.view(torch.int32))
        assert not torch.equal(many[1][0], fresh(offset)[1][0])  # the update did move the parameters

def _row0_invariant(fn, data: torch.Tensor) -> None:
    ref = fn(data[:1])[0]
    for b in (2, 3, 5, 8, 17, 64):
        assert torch.equal(fn(data[:b])[0], ref), f"batch size {b}"
    batch = data[:8].clone()
    batch[6] = data[0]
    out = fn(batch)
    assert torch.equal(out[6], out[0]), "position in the batch"


def test_linear_batch_invariant_and_accurate(bi) -> None:
    w = torch.randn(1536, 4096, device="cuda", dtype=torch.bfloat16) * 0.02
    x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
    _row0_invariant(lambda xb: bi.linear(xb, w), x)
    assert _rel(bi.linear(x, w), x.float() @ w.float().t()) < 1e-2
    # backward: dX rows invariant too, dW deterministic
    xr = x.clone().requires_grad_()
    wr = w.float().clone().requires_grad_()
    y = bi.linear(xr, wr)
    dy = torch.randn_like(y)
    g1 = torch.autograd.grad(y, (xr, wr), dy)
    g2 = torch.autograd.grad(bi.linear(xr, wr), (xr, wr), dy)
    assert all(torch.equal(a, b) for a, b in zip(g1, g2))
    assert g1[1].dtype == torch.float32 and _rel(g1[0], dy.float() @ w.float()) < 1e-2

    def dx_of(xb):
        xb = xb.detach().requires_grad_()
        return torch.autograd.grad(bi.linear(xb, w), xb, torch.ones(xb.shape[0], 1536, device="cuda",
                                                                        dtype=torch.bfloat16))[0]

    _row0_invariant(dx_of, x)


def test_rmsnorm_and_cross_entropy_batch_invariant(bi) -> None:
    x = torch.randn(64, 768, device="cuda")
    w = torch.randn(768, device="cuda")
    _row0_invariant(lambda xb: bi.rms_norm(xb, w, 1e-5), x)
    ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w
    assert _rel(bi.rms_norm(x, w, 1e-5), ref) < 1e-6
    lg = torch.randn(64, 32000, device="cuda", dtype=torch.bfloat16) * 4
    tg = torch.randint(0, 32000, (64,), device="cuda")
    same = torch.full((64,), 1234, device="cuda")  # one target for every row: a row moved keeps its target
    _row0_invariant(lambda lb: bi.cross_entropy_rows(lb, same[: lb.shape[0]]), lg)
    assert _rel(bi.cross_entropy_rows(lg, tg), F.cross_entropy(lg.float(), tg, reduction="none")) < 1e-6
    lr = lg.clone().requires_grad_()
    g = torch.autograd.grad(bi.cross_entropy(lr, tg), lr)[0]
    lf = lg.float().requires_grad_()
    assert _rel(g, torch.autograd.grad(F.cross_entropy(lf, tg), lf)[0]) < 1e-2


@pytest.mark.parametrize("shape", [(4, 12, 12, 256, 64), (2, 8, 2, 300, 64), (1, 4, 4, 512, 128)],
                         ids=["mha", "gqa-ragged", "d128"])
def test_attention_matches_sdpa_and_is_batch_invariant(bi, shape) -> None:
    from dettrain.kernels import attention as attn

    B, H, HKV, T, D = shape
    q = torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(B, HKV, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(B, HKV, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    do = torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16)
    o = attn.attention(q, k, v)
    grads = torch.autograd.grad(o, (q, k, v), do)
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    rep = H // HKV
    ref = F.scaled_dot_product_attention(qf, kf.repeat_interleave(rep, 1), vf.repeat_interleave(rep, 1),
                                         is_causal=True)
    rgrads = torch.autograd.grad(ref, (qf, kf, vf), do.float())
    assert _rel(o, ref) < 2e-2
    for gv, rv in zip(grads, rgrads):
        assert _rel(gv, rv) < 3e-2
    again = torch.autograd.grad(attn.attention(q, k, v), (q, k, v), do)
    assert all(torch.equal(a, b) for a, b in zip(grads, again))  # no atomics: reruns are bitwise equal
    if B > 1:
        one = attn.attention(q[:1], k[:1], v[:1])
        assert torch.equal(one[0], o[0])
        g1 = torch.autograd.grad(one, (q, k, v), do[:1])
        assert torch.equal(g1[0][0], grads[0][0]) and torch.equal(g1[1][0], grads[1][0])


@pytest.mark.parametrize("tier", [3, 4])
def test_gpu_training_reruns_identically(tmp_path, tier: int) -> None:
    """Tier 3 (dettrain's attention kernel) and tier 4 (every batch-invariant kernel) on the GPU, twice."""
    pytest.importorskip("triton")
    over = [f"det.tier={tier}", "train.precision=bf16", "model.vocab_size=512"]
    train(tmp_path / "a", *over)
    train(tmp_path / "b", *over)
    assert step_fields(tmp_path / "a") == step_fields(tmp_path / "b")
