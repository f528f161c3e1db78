"""det.attention (dettrain/models/attention.py): the switch's choice and its record, the routes of HF models and of
F.scaled_dot_product_attention callers into torch.ops.dettrain.bi_attention, the calls that go to torch (auto) or are
refused (dettrain), and the zero-padded head sizes against a float64 reference.  On CPU the op runs its fp32
reference (det.attention=dettrain), which is what lets these tests see the routing."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import REPO, train
from torch.utils._python_dispatch import TorchDispatchMode

from dettrain.config import Config, validate
from dettrain.determinism import DetConfig, audit
from dettrain.errors import UserError
from dettrain.kernels import attention as kernel
from dettrain.models import attention as route
from dettrain.record.ledger import read_ledger

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention_models import SDPALM  # noqa: E402

transformers = pytest.importorskip("transformers")

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


class OpCalls(TorchDispatchMode):
    """Counts dispatches of dettrain's attention ops (forward and backward) at the dispatcher."""

    def __init__(self) -> None:
        super().__init__()
        self.fwd = self.bwd = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        self.fwd += name.startswith("dettrain.bi_attention.")
        self.bwd += name.startswith("dettrain.bi_attention_bwd.")
        return func(*args, **(kwargs or {}))


@pytest.fixture
def use_route():
    """install(choice) for one test; torch's attention back afterwards."""
    def put(setting: str = "dettrain", strict: bool | None = None):
        choice = route.AttentionChoice("dettrain" if strict is not None else setting, "dettrain", "reference", "test")
        route.install(choice)
        if strict is not None:  # auto's semantics (torch for what the kernel cannot serve) on CPU tensors
            kernel.set_attention("always", strict=strict)
        return choice

    yield put
    route.uninstall()


def _hf(model_type: str = "llama", layers: int = 3, **kw):
    from dettrain.models.hf import from_config

    args = dict(hidden_size=64, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
                num_key_value_heads=2)
    return from_config(128, 32, model_type=model_type, **{**args, **kw})


# ---- the switch ---------------------------------------------------------------------------------------------------
def test_resolve_gives_each_settings_choice(monkeypatch):
    res = lambda s, dev, det=True, bi=False, asked=None: route.resolve(  # noqa: E731
        s, dev, deterministic_ops=det, batch_invariant=bi, batch_invariant_asked=asked)
    assert (res("auto", CPU).resolved, res("auto", CPU).kernel) == ("torch", None)
    assert (res("dettrain", CPU).resolved, res("dettrain", CPU).kernel) == ("dettrain", "reference")
    assert res("torch", CPU).resolved == "torch"
    monkeypatch.setattr(route, "HAVE_TRITON", False)
    assert res("auto", CUDA).resolved == "torch"
    with pytest.raises(UserError, match=r"det.attention=dettrain on CUDA needs Triton.*auto\|torch"):
        res("dettrain", CUDA)
    monkeypatch.setattr(route, "HAVE_TRITON", True)
    assert (res("auto", CUDA).resolved, res("auto", CUDA).kernel, res("auto", CUDA).mode) == \
        ("dettrain", "triton", "cuda")
    assert res("auto", CUDA, det=False).resolved == "torch"  # tiers 0-1: nothing to make deterministic
    assert res("auto", CUDA, det=False, bi=True).resolved == "dettrain"  # det.batch_invariant wants the kernel
    assert (res("dettrain", CUDA).mode, res("dettrain", CUDA).strict) == ("always", True)
    assert (res("torch", CUDA, bi=True).mode, res("torch", CUDA, bi=True).resolved) == ("never", "torch")
    with pytest.raises(UserError, match="det.attention=torch with det.batch_invariant=true"):
        res("torch", CUDA, bi=True, asked=True)
    with pytest.raises(UserError, match="det.attention='fast' must be one of auto, dettrain, torch"):
        res("fast", CPU)
    cfg = Config(det=DetConfig(attention="fast"))
    with pytest.raises(UserError, match="det.attention='fast' must be auto, dettrain or torch"):
        validate(cfg, 1)


def test_install_routes_sdpa_for_the_run_and_uninstall_restores_torchs(use_route, monkeypatch):
    monkeypatch.setattr(kernel, "HAVE_TRITON", True)  # auto's CUDA mode, set without a GPU
    torch_sdpa = F.scaled_dot_product_attention
    use_route("auto")
    assert F.scaled_dot_product_attention is route.sdpa and kernel.attention_mode() == "cuda"
    route.install(route.AttentionChoice("torch", "torch", None, "x"))
    assert F.scaled_dot_product_attention is torch_sdpa and kernel.attention_mode() == "never"
    use_route("dettrain")
    assert kernel.attention_mode() == "always" and kernel.attention_strict()
    route.uninstall()
    assert F.scaled_dot_product_attention is torch_sdpa and kernel.attention_mode() == "off"


def test_the_choice_is_in_the_header_and_the_audit(tmp_path):
    tiny_hf = ["model=hf_llama", "model.seq_len=32", "model.hidden_size=64", "model.intermediate_size=64",
               "model.num_hidden_layers=2", "model.num_attention_heads=4", "model.num_key_value_heads=2",
               "train.steps=6", "train.global_batch=4", "train.micro_batch=2", "data.max_bytes=300000",
               "log.wandb.mode=disabled", "log.every=1", "train.lr=3e-3"]
    train(tmp_path / "d", *tiny_hf, "det.attention=dettrain", tiny=False)
    h, steps = read_ledger(tmp_path / "d")
    want = {"setting": "dettrain", "resolved": "dettrain", "kernel": "reference", "sdpa_routed": True,
            "hf_attn_implementation": "dettrain"}
    assert {k: h["attention"][k] for k in want} == want
    row = next(r for r in h["audit"] if r["name"] == "attention (det.attention)")
    assert row["value"] == "dettrain (reference)" and row["level"] == "info"
    assert len(steps) == 6 and steps[-1]["loss"] < steps[0]["loss"]  # it trains through the op
    # the audit tool records what a run would resolve to on this machine
    rows = audit(3, attention=route.resolve("torch", CPU, deterministic_ops=True, batch_invariant=False).header())
    assert next(r for r in rows if r["name"] == "attention (det.attention)")["value"] == "torch"
    import subprocess

    p = subprocess.run([sys.executable, "-m", "dettrain.audit", "--attention", "dettrain", "--json", "-"],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    import json

    out = json.loads(p.stdout)
    assert out["attention"]["resolved"] == "dettrain" and out["attention"]["kernel"] == "reference"
    assert any(r["name"] == "attention (det.attention)" and r["value"] == "dettrain (reference)" for r in out["rows"])


# ---- Hugging Face models ------------------------------------------------------------------------------------------
def test_from_config_selects_dettrains_attention_unless_pinned():
    assert _hf(layers=1).hf.config._attn_implementation == "dettrain"
    assert _hf(layers=1, attn_implementation="sdpa").hf.config._attn_implementation == "sdpa"
    with pytest.raises(UserError, match="model.attn_implementation='flash_attention_2'"):
        _hf(layers=1, attn_implementation="flash_attention_2")


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "mistral"])
def test_every_hf_layer_runs_the_op_forward_and_backward(use_route, model_type):
    m = _hf(model_type)
    pinned = _hf(model_type, attn_implementation="eager")
    pinned.load_state_dict(m.state_dict())
    tok = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(0))
    want = pinned(tok)
    use_route("dettrain")
    with OpCalls() as calls:
        out = m(tok)
        out.float().pow(2).mean().backward()
    assert (calls.fwd, calls.bwd) == (3, 3)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)  # HF's eager reference attention, same weights


def test_a_causal_unpadded_batch_reaches_the_attention_without_a_mask_compiled_too(use_route):
    # transformers materialises the mask while tracing (it cannot read positions or padding there); under
    # HFCausalLM's plain inputs dettrain's mask function returns None, so the op stays in the compiled graph
    m = _hf(layers=2)
    use_route("dettrain")
    found = []

    def backend(gm, inputs):
        found.append(sum("bi_attention" in str(n.target) for n in gm.graph.nodes))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(m, backend=backend, fullgraph=True, dynamic=False)(torch.randint(0, 128, (2, 32)))
    assert found == [2]


def _padding_mask():
    mask = torch.ones(2, 32, dtype=torch.long)
    mask[1, :5] = 0  # left padding in the second row
    return mask


@pytest.mark.parametrize("case", ["padding", "dropout", "sliding window 8 < 32"])
def test_what_the_kernel_cannot_serve_goes_to_torch_at_auto_and_is_refused_at_dettrain(use_route, case):
    kw = {"attention_dropout": 0.5} if case == "dropout" else {}
    model_type = "mistral" if case.startswith("sliding") else "llama"
    if case.startswith("sliding"):
        kw["sliding_window"] = 8
    m = _hf(model_type, **kw)
    pinned = _hf(model_type, attn_implementation="sdpa", **kw)
    pinned.load_state_dict(m.state_dict())
    tok = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))
    call = {"input_ids": tok, "use_cache": False}
    if case == "padding":
        call["attention_mask"] = _padding_mask()
    if case != "dropout":
        m.eval(), pinned.eval()

    def run(model):
        torch.manual_seed(7)  # the same dropout draws for both
        return model.hf(**call).logits

    want = run(pinned)
    use_route("auto", strict=False)
    with OpCalls() as calls:
        got = run(m)
    assert calls.fwd == 0 and torch.equal(got, want)  # torch's sdpa path, bit for bit
    use_route("dettrain")
    reason = {"padding": "an attention mask", "dropout": "attention dropout 0.5 while training",
              "sliding window 8 < 32": "a sliding window of 8 < 32 tokens"}[case]
    if case.startswith("sliding"):
        reason = "an attention mask"  # transformers builds the window into the mask it passes
    with pytest.raises(UserError, match=f"det.attention=dettrain: dettrain's attention kernel cannot serve {reason}.*"
                                        r"det.attention=auto .*det.attention=torch"):
        run(m)


def test_a_sliding_window_as_long_as_the_sequence_is_plain_causal(use_route):
    m = _hf("mistral", sliding_window=32)  # transformers' sdpa mask would materialise this one
    use_route("dettrain")
    with OpCalls() as calls:
        m(torch.randint(0, 128, (2, 32)))
    assert calls.fwd == 3


# ---- a user's own model calling F.scaled_dot_product_attention -------------------------------------------------------
def test_a_custom_sdpa_model_is_routed_eager_and_compiled(use_route):
    torch.manual_seed(0)
    m = SDPALM(64, 16)
    tok = torch.randint(0, 64, (2, 16))
    want = m(tok)
    use_route("dettrain")
    with OpCalls() as calls:
        got = m(tok)
        got.sum().backward()
    assert (calls.fwd, calls.bwd) == (2, 2)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    found = []

    def backend(gm, inputs):
        found.append(sum("bi_attention" in str(n.target) for n in gm.graph.nodes))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(m, backend=backend, fullgraph=True, dynamic=False)(tok)
    assert found == [2]
    route.uninstall()
    with OpCalls() as calls:
        m(tok)
    assert calls.fwd == 0  # outside a run: torch's own SDPA


def test_sdpa_calls_the_kernel_cannot_serve_go_to_torch_or_are_refused(use_route):
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 4, 16, 16, generator=g) for _ in range(3))
    mask = torch.ones(16, 16, dtype=torch.bool).tril()
    cases = {"non-causal attention": dict(is_causal=False), "an attention mask": dict(attn_mask=mask),
             "attention dropout 0.1": dict(is_causal=True, dropout_p=0.1)}
    for why, kw in cases.items():
        use_route("auto", strict=False)
        torch.manual_seed(3)
        want = route._TORCH_SDPA(q, k, v, **kw)
        with OpCalls() as calls:
            torch.manual_seed(3)
            got = F.scaled_dot_product_attention(q, k, v, **kw)
        assert calls.fwd == 0 and torch.equal(got, want)
        use_route("dettrain")
        with pytest.raises(UserError, match=f"cannot serve {why}"):
            F.scaled_dot_product_attention(q, k, v, **kw)
    with OpCalls() as calls:
        F.scaled_dot_product_attention(q, k[:, :2], v[:, :2], is_causal=True, enable_gqa=True, scale=0.3)
    assert calls.fwd == 1


def test_a_custom_sdpa_model_trains_compiled_with_the_kernel(tmp_path):
    train(tmp_path / "c", "model=custom", "model._target_=attention_models.SDPALM", "+model.dim=64",
          "model.seq_len=32", "train.steps=3", "train.global_batch=4", "train.micro_batch=2",
          "data.max_bytes=300000", "log.wandb.mode=disabled", "log.every=1", "det.attention=dettrain",
          "train.compile=true", tiny=False, env={"PYTHONPATH": f"{REPO / 'tests'}:{REPO}"})
    h, steps = read_ledger(tmp_path / "c")
    assert h["compile"]["enabled"] is True and h["attention"]["resolved"] == "dettrain"
    assert len(steps) == 3 and all(math.isfinite(s["loss"]) for s in steps)


# ---- the op: scale, and the zero-padded head sizes ------------------------------------------------------------------
def test_the_default_scale_keeps_the_references_bits():
    # dettrain's LLaMA passes no scale: the reference divides by sqrt(D) as it always did (computed here apart)
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 4, 24, 64, generator=g) for _ in range(3))
    s = (q @ k.transpose(-1, -2)) / math.sqrt(64)
    s = s.masked_fill(~torch.ones(24, 24, dtype=torch.bool).tril(), float("-inf"))
    lse = torch.logsumexp(s, -1)
    assert torch.equal(kernel.attention(q, k, v), torch.exp(s - lse[..., None]) @ v)
    # HF's scaling for head size 64 (0.125, exact) gives the same bits as the default
    assert torch.equal(kernel.attention(q, k, v, 64 ** -0.5), kernel.attention(q, k, v))


@pytest.mark.parametrize("D", [48, 80, 96, 112])
def test_padded_head_sizes_equal_a_float64_reference(D):
    g = torch.Generator().manual_seed(D)
    q = torch.randn(2, 4, 40, D, generator=g, requires_grad=True)
    k, v = (torch.randn(2, 2, 40, D, generator=g, requires_grad=True) for _ in range(2))
    do = torch.randn(2, 4, 40, D, generator=g)
    assert kernel.padded_head_size(D) == 1 << math.ceil(math.log2(D))
    out = kernel.attention(q, k, v, 0.7 / math.sqrt(D))
    grads = torch.autograd.grad(out, (q, k, v), do)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = route.reference_attention(qd, kd, vd, 0.7 / math.sqrt(D))
    ref_grads = torch.autograd.grad(ref, (qd, kd, vd), do.double())
    assert out.shape == q.shape
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    for a, b in zip(grads, ref_grads):
        assert a.shape == b.shape
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-5)
    # exact: the padded columns of the op's own output are zeros (v's padding), so slicing drops nothing
    P = kernel.padded_head_size(D)
    pad = lambda t: F.pad(t.detach(), (0, P - D))  # noqa: E731
    raw = kernel.attention_op(pad(q), pad(k), pad(v), 0.7 / math.sqrt(D))[0]
    assert torch.count_nonzero(raw[..., D:]) == 0 and torch.equal(raw[..., :D], out.detach())


def test_unsupported_head_sizes_are_refused_with_the_fix():
    assert kernel.head_size_problem(64) is None and kernel.head_size_problem(80) is None
    q = torch.randn(1, 2, 8, 72)
    with pytest.raises(ValueError, match=r"head size 72 .*det.attention=torch"):
        kernel.attention(q, q, q)
    assert "head size 72" in route.problem(q, q, q, causal=True, mask=None, dropout=0.0)


def test_the_launch_order_puts_the_block_on_the_axis_it_names(monkeypatch):
    # kernels/attention.py ``_launch``: the grid and the block's axis each order gives, and auto's rule (longest
    # first with at most 8 programs an SM); that both orders give the same bits is tests/test_attention_bwd_gpu.py's
    assert kernel._launch(16, 384, {"launch": "per-head"}) == ((16, 384), 0)
    assert kernel._launch(16, 384, {"launch": "longest-first"}) == ((384, 16), 1)
    monkeypatch.setattr(kernel, "_sm_count", lambda index: 132)
    gpu0 = torch.device("cuda", 0)
    assert kernel._launch(32, 16, {}, gpu0) == ((16, 32), 1)      # the 1b backward's dK/dV pass: 512 programs
    assert kernel._launch(32, 128, {}, gpu0) == ((32, 128), 0)    # its dQ pass: 4,096
    assert kernel._launch(33, 32, {}, gpu0) == ((32, 33), 1)      # 1,056 = 8 x 132
    assert kernel._launch(16, 384, {}, gpu0) == ((16, 384), 0)    # the 125m shape's 384 heads
    assert kernel._launch(32, 16, {}, CPU) == ((32, 16), 0)       # no SMs to fill (the interpreter)
    with pytest.raises(ValueError, match="'longest-first' or 'per-head'"):
        kernel._launch(16, 384, {"launch": "zigzag"})


def test_ds_slices_cover_every_sample_and_kv_head_once_within_the_cap():
    # kernels/attention.py ``_ds_slices``: the slices the dS backward runs one after another; that they give the
    # bits of one launch is tests/test_attention_bwd_gpu.py's
    def covered(slices):
        return [(b, g) for b0, b1, g0, g1 in slices for b in range(b0, b1) for g in range(g0, g1)]

    for B, HKV in ((1, 32), (2, 32), (5, 4), (3, 7)):
        for kv_bytes, cap in ((10, 10**6), (10, 10 * HKV), (10, 10 * HKV + 9), (10, 30), (10, 10), (10, 25)):
            slices = kernel._ds_slices(B, HKV, kv_bytes, cap)
            assert covered(slices) == [(b, g) for b in range(B) for g in range(HKV)], (B, HKV, cap)
            for b0, b1, g0, g1 in slices:
                assert (b1 - b0) * (g1 - g0) * kv_bytes <= cap
                assert (g0, g1) == (0, HKV) or b1 == b0 + 1  # contiguous lse rows: samples, or heads of one
            if cap >= B * HKV * kv_bytes:
                assert slices == [(0, B, 0, HKV)]  # the whole batch fits: one launch, as before slicing
    assert kernel._ds_slices(4, 8, 11, 10) is None  # one kv head over the cap: dQ recomputes dS
    # the 7B shape (32 heads, T 4096, dK/dV key blocks of 64): 520 MiB of 16-bit dS a sample, so micro-batches of
    # one and two sequences run in one launch (the 2 GiB cap), one of four in two
    n = 4096 // 64
    kv_bytes = 64 * (n * 4096 - 64 * n * (n - 1) // 2) * 2
    assert kv_bytes * 32 == 545_259_520
    assert kernel._ds_slices(1, 32, kv_bytes, kernel.DS_MAX_BYTES) == [(0, 1, 0, 32)]
    assert kernel._ds_slices(2, 32, kv_bytes, kernel.DS_MAX_BYTES) == [(0, 2, 0, 32)]
    assert kernel._ds_slices(4, 32, kv_bytes, kernel.DS_MAX_BYTES) == [(0, 3, 0, 32), (3, 4, 0, 32)]


def test_the_kv_split_is_a_divisor_of_the_group_and_a_bad_setting_names_the_variable(monkeypatch):
    # kernels/attention.py ``kv_split``: the parts of a GQA group the dK/dV pass splits into; a function of the
    # group and the head size only (so of the model, never of the batch): by default KV_SPLIT_DEFAULT parts (as many
    # as divide the group) at head sizes up to 64 and none above, DETTRAIN_ATTN_KV_SPLIT=N asks for N at every head
    # size; that a split pass reruns bitwise, keeps batch invariance and is as accurate is
    # tests/test_attention_bwd_gpu.py's
    monkeypatch.delenv(kernel.KV_SPLIT_ENV, raising=False)
    k = kernel.KV_SPLIT_DEFAULT
    assert [kernel._attn_blocks(D, G)["split"] for D in (64, 128) for G in (1, 4, 8)] == [
        1, math.gcd(k, 4), math.gcd(k, 8), 1, 1, 1]
    assert kernel._attn_blocks(32, 2)["split"] == math.gcd(k, 2)  # head sizes below 64 split alike
    monkeypatch.setenv(kernel.KV_SPLIT_ENV, "1")
    assert [kernel._attn_blocks(D, G)["split"] for D in (64, 128) for G in (1, 4, 8)] == [1] * 6
    monkeypatch.setenv(kernel.KV_SPLIT_ENV, "4")
    assert [kernel.kv_split(G) for G in (1, 2, 4, 8, 6)] == [1, 2, 4, 4, 2]
    assert kernel._attn_blocks(64, 8)["split"] == 4 and kernel._attn_blocks(64, 1)["split"] == 1
    assert kernel._attn_blocks(128, 8)["split"] == 4  # asked for, head size 128 splits too
    assert kernel._attn_blocks_two_pass(64, 8)["split"] == 4  # the comparison backward splits alike
    # a run on the Triton kernel records the switch in its ledger header (dettrain.diff then names it), and a bad
    # value stops the run when the header is made, before its first step
    choice = route.AttentionChoice("auto", "dettrain", "triton", "test")
    assert choice.header()["kv_split"] == 4
    assert "kv_split" not in route.AttentionChoice("dettrain", "dettrain", "reference", "test").header()
    for bad in ("0", "two", "-2"):
        monkeypatch.setenv(kernel.KV_SPLIT_ENV, bad)
        with pytest.raises(UserError, match=r"DETTRAIN_ATTN_KV_SPLIT=.*positive integer"):
            kernel._attn_blocks(64, 8)
        with pytest.raises(UserError, match=r"DETTRAIN_ATTN_KV_SPLIT=.*positive integer"):
            choice.header()
    monkeypatch.delenv(kernel.KV_SPLIT_ENV)
    assert "kv_split" not in choice.header()


def test_auto_on_cpu_records_torch_and_no_routing_in_the_header(tmp_path):
    """det.attention=auto on a CPU-only machine resolves to torch's attention: the ledger header says so, and
    ``sdpa_routed`` is false (F.scaled_dot_product_attention is left as torch's)."""
    train(tmp_path / "d", "det.attention=auto", "train.steps=1")
    h, _ = read_ledger(tmp_path / "d")
    assert {k: h["attention"][k] for k in ("setting", "resolved", "kernel", "sdpa_routed")} == \
        {"setting": "auto", "resolved": "torch", "kernel": None, "sdpa_routed": False}
