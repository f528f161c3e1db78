"""``python -m dettrain.verify``: what varies on this device, and does the active tier stop it?

    python -m dettrain.verify [key=value ...] [--device auto|cpu|cuda] [--dtypes fp32,bf16] [--repeats K]
                              [--sizes 1,2,3,8,16,31,64] [--row-sizes 1,2,...,4096] [--batch B]
                              [--atomics-n N] [--atomics-bins N] [--atomics-reruns R] [--skip SECTION,...]
                              [--json PATH]

``key=value`` are the training config overrides (Hydra compose of conf/config.yaml), so ``model=125m`` checks the
125m model and ``det.tier=2`` the ops tier; the defaults check the default config (tiny model, tier 3).  Sections:

1. ``batch``: batch invariance.  One sample computed alone vs the same sample placed first, in the middle and last
   of batches of every size in ``--sizes`` (sequence ops: attention, the whole model) or ``--row-sizes`` (row ops:
   linear/matmul, RMSNorm, softmax, log-softmax, cross-entropy), compared bitwise; a table of which ops vary on this
   device and by how much (max |diff|, max ULPs, share of differing elements, the batch sizes that differ).  No tier
   promises batch invariance (tier 4 keeps the micro-batch size fixed instead); the table says what would break if
   the micro-batch size changed.
2. ``repeat``: run-to-run determinism of forward and backward of the configured model, ``--repeats`` times under the
   active tier (dropout reseeded as in training).  Forward hooks, full backward hooks and parameter-gradient hooks
   fingerprint every module output, every module input-gradient and every parameter gradient in execution order;
   the first module whose output or gradient differs between repeats is named.
3. ``atomics``: ``scatter_add_`` / ``index_add_`` of ``--atomics-n`` values into ``--atomics-bins`` bins, rerun
   ``--atomics-reruns`` times with torch's deterministic mode off and on, and ``dettrain.detops.scatter_add``.
4. ``control``: the negative control: the ``repeat`` check again under tier 0 settings (deterministic mode off, TF32
   and cudnn.benchmark on), and a change of CPU thread count, to show the variance the tiers remove wherever this
   device has any.

Exit status: 0 when the active tier's promise held on this device (at tiers >= 2: every repeat bitwise identical
and detops repeatable; tiers 0-1 promise no identical numerics and always exit 0), 1 when it did not, 2 on bad input.
Expected output on CPU and GPU: docs/determinism.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["DTYPES", "OpCase", "Options", "Recorder", "SECTIONS", "atomics_demo", "batch_invariance",
           "batch_invariant_cases", "check_op", "compare", "diff_runs", "format_atomics", "format_batch",
           "format_repeat", "fwd_bwd", "load_config", "main", "model_cases", "op_cases", "ordered", "run",
           "run_to_run", "thread_control"]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
SECTIONS = ("batch", "repeat", "atomics", "control")


@dataclass
class Options:
    device: str = "auto"
    dtypes: list[str] = field(default_factory=lambda: ["fp32", "bf16"])
    sizes: list[int] = field(default_factory=lambda: [1, 2, 3, 8, 16, 31, 64])
    row_sizes: list[int] = field(default_factory=lambda: [1, 2, 3, 8, 16, 31, 64, 128, 256, 1024, 4096])
    repeats: int = 5
    batch: int | None = None
    atomics_n: int = 1_000_000
    atomics_bins: int = 100
    atomics_reruns: int = 20
    skip: list[str] = field(default_factory=list)


# ---- config ---------------------------------------------------------------------------------------------------
def load_config(overrides: list[str]):
    """The training config with ``overrides`` applied (schema -> conf/config.yaml -> overrides), as a Config."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from dettrain.config import conf_dir, register, to_config

    register()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        dcfg = compose(config_name="config", overrides=list(overrides))
    return to_config(dcfg)


# ---- comparing tensors bit for bit ------------------------------------------------------------------------------
_INT_VIEW = {torch.float32: (torch.int32, 0x7FFFFFFF), torch.bfloat16: (torch.int16, 0x7FFF),
             torch.float16: (torch.int16, 0x7FFF), torch.float64: (torch.int64, 0x7FFFFFFFFFFFFFFF)}


def ordered(x: torch.Tensor) -> torch.Tensor:
    """Float bits as int64 on a line where adjacent floats are 1 apart (so a difference counts ULPs; +0 == -0)."""
    view, mag_mask = _INT_VIEW[x.dtype]
    i = x.contiguous().view(view).to(torch.int64)
    mag = i & mag_mask
    return torch.where(i < 0, -mag, mag)


def compare(a: torch.Tensor, b: torch.Tensor) -> dict:
    """Bitwise comparison of two same-shape tensors: equal, elements differing, max |diff|, max ULPs."""
    a, b = a.detach(), b.detach()
    if a.dtype not in _INT_VIEW:
        ne = a != b
        return {"equal": not bool(ne.any()), "n": a.numel(), "n_diff": int(ne.sum()),
                "max_abs": float((a - b).abs().max()) if a.numel() else 0.0, "max_ulp": 0, "median_ulp": 0}
    view = _INT_VIEW[a.dtype][0]
    bits_ne = a.contiguous().view(view) != b.contiguous().view(view)  # raw bits: +0 and -0 differ too
    n_diff = int(bits_ne.sum())
    if n_diff == 0:
        return {"equal": True, "n": a.numel(), "n_diff": 0, "max_abs": 0.0, "max_ulp": 0, "median_ulp": 0}
    ulps = (ordered(a) - ordered(b)).abs()[bits_ne]
    return {"equal": False, "n": a.numel(), "n_diff": n_diff,
            "max_abs": float((a.double() - b.double()).abs().max()),
            "max_ulp": int(ulps.max()), "median_ulp": int(ulps.median())}


def _fp(x) -> int:
    """Fingerprint of a tensor or a tuple of them (None: 0)."""
    from dettrain.record.fingerprint import combine, fingerprint

    if x is None:
        return 0
    if isinstance(x, torch.Tensor):
        return fingerprint(x)
    if isinstance(x, (tuple, list)):
        return combine(_fp(t) * (i + 1) for i, t in enumerate(x))
    return 0


# ---- 1. batch invariance ------------------------------------------------------------------------------------------
@dataclass
class OpCase:
    name: str
    kind: str  # "row": a sample is one row; "seq": a sample is one sequence
    shape: str  # the sample, for the table
    make: Callable[[torch.Generator, int], tuple[torch.Tensor, ...]]  # n samples -> inputs with leading dim n
    fn: Callable[..., torch.Tensor]  # inputs of a batch -> outputs with leading dim = batch


def op_cases(mc, model: nn.Module | None, dtype: torch.dtype, device: torch.device, seed: int) -> list[OpCase]:
    """The model's building blocks at the model's sizes, in ``dtype``; and the model itself (autocast for 16-bit)."""
    from dettrain.models.llama import RMSNorm

    if not hasattr(mc, "dim"):  # model=custom
        return model_cases(mc, model, dtype, device)
    g = torch.Generator().manual_seed(seed)
    dim, ffn, vocab, H, T = mc.dim, mc.ffn_dim, mc.vocab_size, mc.n_heads, mc.seq_len
    hd = dim // H

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)

    w_ffn = randn(ffn, dim, scale=dim ** -0.5)
    w_voc = randn(vocab, dim, scale=dim ** -0.5)
    norm = RMSNorm(dim, mc.norm_eps).to(device)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(dim, generator=g))

    def rows(width, scale=1.0):
        return lambda gen, n: ((torch.randn(n, width, generator=gen) * scale).to(device=device, dtype=dtype),)

    def ce_make(gen, n):
        logits = (torch.randn(n, vocab, generator=gen) * 2).to(device=device, dtype=dtype)
        return logits, torch.randint(0, vocab, (n,), generator=gen).to(device)

    def qkv_make(gen, n):
        return tuple(torch.randn(n, H, T, hd, generator=gen).to(device=device, dtype=dtype) for _ in range(3))

    cases = [
        OpCase(f"linear {dim}->{ffn} (matmul)", "row", f"({dim},)", rows(dim), lambda x: F.linear(x, w_ffn)),
        OpCase(f"lm head {dim}->{vocab} (matmul)", "row", f"({dim},)", rows(dim), lambda x: F.linear(x, w_voc)),
        OpCase("rmsnorm", "row", f"({dim},)", rows(dim), lambda x: norm(x)),
        OpCase("softmax", "row", f"({vocab},)", rows(vocab, 3.0), lambda x: F.softmax(x, dim=-1)),
        OpCase("log_softmax", "row", f"({vocab},)", rows(vocab, 3.0), lambda x: F.log_softmax(x, dim=-1)),
        OpCase("cross_entropy", "row", f"({vocab},)+target", ce_make,
               lambda x, y: F.cross_entropy(x, y, reduction="none")),
        OpCase("attention (causal sdpa)", "seq", f"({H},{T},{hd})x3", qkv_make,
               lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)),
    ]
    cases += batch_invariant_cases(mc, device, dtype, w_ffn, norm, rows, ce_make, qkv_make)
    return cases + model_cases(mc, model, dtype, device)


def model_cases(mc, model: nn.Module | None, dtype: torch.dtype, device: torch.device) -> list[OpCase]:
    """The whole model's forward (autocast for 16-bit); the only case of a custom model, whose parts are its own."""
    if model is None:
        return []
    vocab, T = mc.vocab_size, mc.seq_len
    ac = (torch.autocast(device.type, dtype=dtype) if dtype != torch.float32 else contextlib.nullcontext())

    def model_fn(tok):
        with ac:
            return model(tok)

    return [OpCase("model forward (logits)", "seq", f"({T},) tokens",
                   lambda gen, n: (torch.randint(0, vocab, (n, T), generator=gen).to(device),), model_fn)]


def batch_invariant_cases(mc, device, dtype, w_ffn, norm, rows, ce_make, qkv_make) -> list[OpCase]:
    """Rows for dettrain.kernels' batch-invariant ops when they are switched on (det.batch_invariant, CUDA only)."""
    from dettrain.kernels import attention as attn
    from dettrain.kernels import batch_invariant as bi

    if device.type != "cuda" or not bi.enabled():
        return []
    dim, vocab, H, T = mc.dim, mc.vocab_size, mc.n_heads, mc.seq_len
    return [
        OpCase(f"linear {dim}->{mc.ffn_dim} [batch_invariant]", "row", f"({dim},)", rows(dim),
               lambda x: bi.linear(x, w_ffn)),
        OpCase("rmsnorm [batch_invariant]", "row", f"({dim},)", rows(dim),
               lambda x: bi.rms_norm(x, norm.weight, norm.eps)),
        OpCase("cross_entropy [batch_invariant]", "row", f"({vocab},)+target", ce_make, bi.cross_entropy_rows),
        OpCase("attention [batch_invariant]", "seq", f"({H},{T},{mc.dim // H})x3", qkv_make, attn.attention),
    ]


def _positions(b: int) -> list[int]:
    return sorted({0, b // 2, b - 1})


@torch.no_grad()
def check_op(case: OpCase, sizes: list[int], seed: int) -> dict:
    """Sample 0 alone vs at positions first/middle/last of each batch size; the other slots hold other samples."""
    gen = torch.Generator().manual_seed(seed)
    probe = case.make(gen, 1)
    fill = case.make(gen, max(sizes))
    alone = case.fn(*probe)[0]
    cases = differ = n = n_diff = 0
    max_abs, max_ulp, med_ulp = 0.0, 0, 0
    sizes_differ, pos_disagree = [], []
    for b in sizes:
        batch = [f[:b].clone() for f in fill]
        pos = _positions(b)
        for t, p in zip(batch, probe):
            t[pos] = p
        out = case.fn(*batch)
        any_b = False
        for q in pos:
            c = compare(out[q], alone)
            cases += 1
            n += c["n"]
            n_diff += c["n_diff"]
            if not c["equal"]:
                differ += 1
                any_b = True
                max_abs = max(max_abs, c["max_abs"])
                max_ulp = max(max_ulp, c["max_ulp"])
                med_ulp = max(med_ulp, c["median_ulp"])
        if any_b:
            sizes_differ.append(b)
        if any(not torch.equal(out[q], out[pos[0]]) for q in pos[1:]):
            pos_disagree.append(b)
    return {"op": case.name, "kind": case.kind, "sample": case.shape, "cases": cases, "differ": differ,
            "max_abs": max_abs, "max_ulp": max_ulp, "median_ulp": med_ulp, "share": n_diff / max(n, 1),
            "sizes_differ": sizes_differ, "positions_disagree": pos_disagree}


def batch_invariance(mc, model, device: torch.device, opts: Options, seed: int) -> list[dict]:
    results = []
    for dname in opts.dtypes:
        for case in op_cases(mc, model, DTYPES[dname], device, seed):
            r = check_op(case, opts.sizes if case.kind == "seq" else opts.row_sizes, seed)
            r["dtype"] = dname
            results.append(r)
    return results


# ---- 2. run-to-run determinism with localisation -------------------------------------------------------------------
class Recorder:
    """Fingerprints, in execution order, every module output (forward hooks), every module's gradient with respect
    to its inputs (full backward hooks) and every parameter gradient (tensor hooks, before accumulation)."""

    def __init__(self, model: nn.Module) -> None:
        self.events: list[tuple[str, str, int]] = []
        self.handles = []
        for name, m in model.named_modules():
            label = name or "<model>"
            self.handles.append(m.register_forward_hook(partial(self._forward, label)))
            self.handles.append(m.register_full_backward_hook(partial(self._backward, label)))
        for name, p in model.named_parameters():
            if p.requires_grad:
                self.handles.append(p.register_hook(partial(self._grad, name)))

    def _forward(self, label, module, inputs, output) -> None:
        self.events.append(("forward", label, _fp(output)))

    def _backward(self, label, module, grad_input, grad_output) -> None:
        if any(g is not None for g in grad_input):
            self.events.append(("backward", label, _fp(grad_input)))

    def _grad(self, name, grad) -> None:
        self.events.append(("grad", name, _fp(grad)))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _describe(ev: tuple[str, str, int]) -> dict:
    kind, name, _ = ev
    if kind == "forward":
        return {"module": name, "what": "output"}
    if kind == "backward":
        return {"module": name, "what": "gradient wrt its input"}
    return {"module": name.rsplit(".", 1)[0] if "." in name else name, "what": f"gradient of {name}"}


def fwd_bwd(model: nn.Module, tokens: torch.Tensor, autocast=None, seed: int = 0) -> dict:
    """One training-style forward + backward on ``tokens`` (B, T+1): loss, logits and parameter gradients."""
    from dettrain.determinism import seed_micro_batch

    seed_micro_batch(seed, 0, 0)  # dropout draws keyed as in training: the same in every call
    model.zero_grad(set_to_none=True)
    x, y = tokens[:, :-1], tokens[:, 1:]
    with (autocast or contextlib.nullcontext)():
        logits = model(x)
    loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))
    with warnings.catch_warnings():
        # the root module's full backward hook has no input gradient (token ids): torch warns, we skip it
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return {"loss": loss.detach().clone(), "logits": logits.detach().clone(), "grads": grads}


def _bits_hex(x: torch.Tensor) -> str:
    return f"{int(x.float().view(torch.int32).item()) & 0xFFFFFFFF:08x}"


def run_to_run(model: nn.Module, tokens: torch.Tensor, repeats: int, autocast=None, seed: int = 0) -> dict:
    """Forward + backward ``repeats`` times on the same batch; name the first module whose output or gradient
    differs from the first repeat.  ``tokens`` is (B, T+1): inputs tokens[:, :-1], targets tokens[:, 1:]."""
    rec = Recorder(model)
    runs = []
    error = None
    try:
        for _ in range(repeats):
            rec.events = []
            run = fwd_bwd(model, tokens, autocast, seed)
            run["events"] = rec.events
            runs.append(run)
    except RuntimeError as e:  # e.g. deterministic mode refusing an op that has no deterministic kernel
        error = str(e).split("\n")[0]
    finally:
        rec.remove()
        model.zero_grad(set_to_none=True)
    out: dict = {"repeats": repeats, "error": error, "identical": error is None, "differing_repeats": 0,
                 "first_forward": None, "first_backward": None, "n_forward": 0, "n_backward": 0,
                 "loss": None, "loss_bits": [], "loss_max_ulp": 0, "logits_max_abs": 0.0, "grad_max_abs": 0.0,
                 "grads_differing": 0}
    if not runs:
        return out
    base = runs[0]
    out["loss"] = float(base["loss"])
    out["n_forward"] = sum(1 for e in base["events"] if e[0] == "forward")
    out["n_backward"] = len(base["events"]) - out["n_forward"]
    first_f = first_b = None  # (event index, repeat)
    differing_params = set()
    for r, run in enumerate(runs[1:], start=1):
        ev0, ev = base["events"], run["events"]
        same = len(ev0) == len(ev) and all(a[:2] == b[:2] for a, b in zip(ev0, ev))
        diffs = [i for i, (a, b) in enumerate(zip(ev0, ev)) if a[2] != b[2]] if same else [0]
        d = diff_runs(base, run)
        if diffs or not d["identical"]:
            out["differing_repeats"] += 1
        out["loss_max_ulp"] = max(out["loss_max_ulp"], d["loss_ulp"])
        out["logits_max_abs"] = max(out["logits_max_abs"], d["logits_max_abs"])
        out["grad_max_abs"] = max(out["grad_max_abs"], d["grad_max_abs"])
        differing_params |= set(d["grads_differing"])
        fwd = [i for i in diffs if ev0[i][0] == "forward"]
        bwd = [i for i in diffs if ev0[i][0] != "forward"]
        if fwd and (first_f is None or fwd[0] < first_f[0]):
            first_f = (fwd[0], r)
        if bwd and (first_b is None or bwd[0] < first_b[0]):
            first_b = (bwd[0], r)
    out["loss_bits"] = sorted({_bits_hex(run["loss"]) for run in runs})
    out["grads_differing"] = len(differing_params)
    out["identical"] = out["differing_repeats"] == 0
    ev0 = base["events"]

    def before(i: int, backward: bool) -> dict | None:
        # the last event of the same pass, which matched: the culprit ran between it and event i
        j = i - 1
        if j < 0 or (ev0[j][0] != "forward") == (not backward):
            return None
        return _describe(ev0[j])

    if first_f is not None:
        out["first_forward"] = {**_describe(ev0[first_f[0]]), "repeat": first_f[1],
                                "last_equal": before(first_f[0], False)}
    if first_b is not None:
        out["first_backward"] = {**_describe(ev0[first_b[0]]), "repeat": first_b[1],
                                 "after_forward_difference": first_f is not None,
                                 "last_equal": before(first_b[0], True)}
    return out


def diff_runs(a: dict, b: dict) -> dict:
    """Compare two ``fwd_bwd`` results bit for bit."""
    lc = compare(b["loss"], a["loss"])
    lg = compare(b["logits"], a["logits"])
    gc = {n: compare(g, a["grads"][n]) for n, g in b["grads"].items()}
    bad = sorted(n for n, c in gc.items() if not c["equal"])
    return {"identical": lc["equal"] and lg["equal"] and not bad, "loss_ulp": lc["max_ulp"],
            "logits_max_abs": lg["max_abs"], "grad_max_abs": max([gc[n]["max_abs"] for n in bad], default=0.0),
            "grads_differing": bad}


# ---- 3. atomics -------------------------------------------------------------------------------------------------
def atomics_demo(device: torch.device, n: int, bins: int, reruns: int, seed: int) -> list[dict]:
    """scatter_add_/index_add_ into few bins, rerun: torch with deterministic mode off and on, and detops."""
    from dettrain import detops

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g).to(device)
    idx = torch.randint(0, bins, (n,), generator=g).to(device)
    ref = torch.zeros(bins, dtype=torch.float64).index_add_(0, idx.cpu(), x.cpu().double())
    variants = [
        ("torch scatter_add_, deterministic mode off", False, lambda: torch.zeros(bins, device=device)
         .scatter_add_(0, idx, x)),
        ("torch index_add_, deterministic mode off", False, lambda: torch.zeros(bins, device=device)
         .index_add_(0, idx, x)),
        ("torch scatter_add_, deterministic mode on", True, lambda: torch.zeros(bins, device=device)
         .scatter_add_(0, idx, x)),
        ("detops.scatter_add (sorted, fixed order)", None, lambda: detops.scatter_add(
            torch.zeros(bins, device=device), 0, idx, x, deterministic=True)),
    ]
    was, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    out = []
    try:
        for name, det, fn in variants:
            if det is not None:
                torch.use_deterministic_algorithms(det)
            first = fn()
            n_diff, max_abs = 0, 0.0
            t0 = time.perf_counter()
            for _ in range(reruns):  # each rerun compared with the first call
                c = compare(fn(), first)
                n_diff += not c["equal"]
                max_abs = max(max_abs, c["max_abs"])
            if device.type == "cuda":
                torch.cuda.synchronize()
            ms = (time.perf_counter() - t0) * 1e3 / reruns
            err = float((first.double().cpu() - ref).abs().max())
            out.append({"variant": name, "reruns": reruns, "differ": n_diff, "max_abs": max_abs,
                        "max_err_vs_fp64": err, "ms_per_call": ms})
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn_only)
    return out


# ---- 4. negative control -------------------------------------------------------------------------------------------
def thread_control(model: nn.Module | None, tokens: torch.Tensor | None, seed: int) -> dict | None:
    """The same CPU work with 1 and 2 threads (None on a one-core machine)."""
    if (os.cpu_count() or 1) < 2:
        return None
    old = torch.get_num_threads()
    x = torch.randn(10_000_000, generator=torch.Generator().manual_seed(seed))
    res: dict = {"threads": [1, 2]}
    try:
        sums = []
        for t in (1, 2):
            torch.set_num_threads(t)
            sums.append(x.sum())
        res["sum_1e7"] = compare(sums[0], sums[1])
        if model is not None and tokens is not None and tokens.device.type == "cpu":
            runs = []
            for t in (1, 2):
                torch.set_num_threads(t)
                runs.append(fwd_bwd(model, tokens, None, seed))
            d = diff_runs(runs[0], runs[1])
            res["model"] = {"identical": d["identical"], "loss_bits": [_bits_hex(r["loss"]) for r in runs],
                            "grads_differing": len(d["grads_differing"]), "grad_max_abs": d["grad_max_abs"]}
    finally:
        torch.set_num_threads(old)
    return res


# ---- the report ------------------------------------------------------------------------------------------------
def _g(x: float) -> str:
    return "0" if x == 0 else f"{x:.1e}"


def _sizes(xs: list[int]) -> str:
    return ",".join(map(str, xs)) if xs else "-"


def format_batch(rows: list[dict]) -> list[str]:
    w = max(len(r["op"]) for r in rows)
    ws = max(len(r["sample"]) for r in rows)
    lines = [f"  {'op':<{w}}  dtype  {'sample':<{ws}}  cases  differ  max|diff|  ULP med/max  elems   batch sizes "
             "that differ"]
    for r in rows:
        ulp = f"{r['median_ulp']}/{r['max_ulp']}" if r["max_ulp"] < 10 ** 6 else f"{r['median_ulp']}/{r['max_ulp']:.0e}"
        lines.append(f"  {r['op']:<{w}}  {r['dtype']:<5}  {r['sample']:<{ws}}  {r['cases']:>5}  {r['differ']:>6}  "
                     f"{_g(r['max_abs']):>9}  {ulp:>11}  {100 * r['share']:>5.1f}%  {_sizes(r['sizes_differ'])}")
    dis = sorted({f"{r['op']} {r['dtype']}" for r in rows if r["positions_disagree"]})
    lines.append("  positions first/middle/last of one batch agreed with each other for every op"
                 if not dis else f"  positions inside one batch disagreed for: {', '.join(dis)}")
    return lines


def format_repeat(r: dict, label: str) -> list[str]:
    if r["error"]:
        return [f"  {label}: stopped: {r['error']}",
                "  -> an op without a deterministic kernel: route it through dettrain.detops (docs/determinism.md)"]
    if r["identical"]:
        return [f"  {label}: identical in all {r['repeats']} runs (loss {r['loss']:.6f}, bits {r['loss_bits'][0]}; "
                f"{r['n_forward']} module outputs and {r['n_backward']} gradients fingerprinted per run)"]
    lines = [f"  {label}: {r['differing_repeats']} of {r['repeats'] - 1} reruns differ from the first "
             f"(loss bits {', '.join(r['loss_bits'])}; logits max|diff| {_g(r['logits_max_abs'])}; "
             f"{r['grads_differing']} parameter gradients differ, max|diff| {_g(r['grad_max_abs'])})"]

    def where(e: dict) -> str:
        last = e.get("last_equal")
        return f"; last equal before it: {last['module']} ({last['what']})" if last else ""

    if r["first_forward"]:
        f = r["first_forward"]
        lines.append(f"    first forward difference:  {f['module']} ({f['what']}){where(f)}")
    else:
        lines.append("    forward: every module output identical")
    if r["first_backward"]:
        b = r["first_backward"]
        after = " (after the forward difference)" if b["after_forward_difference"] else where(b)
        lines.append(f"    first backward difference: {b['module']} ({b['what']}){after}")
    return lines


def format_atomics(rows: list[dict], n: int, bins: int) -> list[str]:
    w = max(len(r["variant"]) for r in rows)
    lines = [f"  {n:,} fp32 values into {bins} bins", f"  {'variant':<{w}}  differ  max|diff|  err vs fp64  ms/call"]
    for r in rows:
        lines.append(f"  {r['variant']:<{w}}  {r['differ']:>2}/{r['reruns']:<3}  {_g(r['max_abs']):>9}  "
                     f"{_g(r['max_err_vs_fp64']):>11}  {r['ms_per_call']:>7.2f}")
    return lines


def run(cfg, opts: Options, device: torch.device, print_fn=print) -> dict:
    """Run the sections of ``opts`` for the configured model on ``device``; returns the results dict."""
    from dettrain.determinism import apply_tier

    apply_tier(cfg.det)
    try:
        built = _build(cfg, device)
    except RuntimeError as e:  # batch-invariant kernels wanted where they cannot run
        if "det.batch_invariant" not in str(e):
            raise
        built, bi_note = _build(cfg, device, batch_invariant=False), f"det.batch_invariant requested but not " \
            f"available: {e}"
    else:
        bi_note = None
    with built:
        return _run(cfg, opts, device, built, bi_note, print_fn)


def _build(cfg, device: torch.device, batch_invariant: bool | None = None):
    """The model as the trainer builds it (``build_run``, loop/build.py: the resolved precision, batch-invariant
    kernels and attention route), without an engine (one process, no process group) and eager: the checks hook
    every module, which a compiled block would run inside its graph."""
    import dataclasses

    from dettrain.dist import DistInfo
    from dettrain.loop.build import build_run

    if batch_invariant is not None:
        cfg = dataclasses.replace(cfg, det=dataclasses.replace(cfg.det, batch_invariant=batch_invariant))
    info = DistInfo(rank=0, world=1, local_rank=0, device=device, backend=None)
    return build_run(cfg, info, with_engine=False, compile=False)


def _run(cfg, opts: Options, device: torch.device, built, bi_note: str | None, print_fn) -> dict:
    from dettrain.determinism import DetConfig, apply_tier, audit, audit_failures, derive_seed, versions
    from dettrain.models.llama import num_params
    from dettrain.tiers import TIERS, policy

    t_start = time.perf_counter()
    det = cfg.det
    tier = det.tier
    mc = cfg.model
    prec = built.resolved.precision
    autocast = (lambda: built.autocast) if built.resolved.mixed_precision else None
    model = built.model
    model.train()
    custom = not hasattr(mc, "dim")  # model=custom: a CustomModelConfig
    seed = derive_seed(cfg.seed, "verify")
    rows = audit(tier, threads=det.threads)
    res: dict = {"device": str(device), "versions": versions(), "tier": tier, "tier_name": TIERS[tier],
                 "threads": torch.get_num_threads(), "model": mc.as_dict() if custom else {k: getattr(mc, k) for k in (
                     "name", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "seq_len")},
                 "n_params": num_params(model), "precision": prec, "audit_failures": audit_failures(rows),
                 "options": {k: getattr(opts, k) for k in opts.__dataclass_fields__}, "seconds": {}}
    v = res["versions"]
    print_fn(f"dettrain.verify: device {device} ({', '.join(v['devices'])}), torch {v['torch']}, tier {tier} "
             f"({TIERS[tier]}), {torch.get_num_threads()} thread(s)")
    shape = (f"{mc._target_}" if custom else f"dim {mc.dim}, {mc.n_layers} layers, {mc.n_heads} heads")
    print_fn(f"model {mc.name}: {shape}, seq {mc.seq_len}, vocab {mc.vocab_size} ({num_params(model) / 1e6:.2f}M "
             f"params); training precision {prec}")
    if bi_note:
        print_fn(bi_note)
    if built.resolved.compile:  # what training compiles runs eager here: the checks hook every module
        print_fn("train.compile: training compiles the blocks; these checks run them eager (hooks on every module)")
    bad = res["audit_failures"]
    print_fn(f"audit: {len(bad)} required check(s) failed" + (f": {', '.join(r['name'] for r in bad)}" if bad else "")
             + f" (python -m dettrain.audit --tier {tier} for the table)")
    active = [s for s in SECTIONS if s not in opts.skip]
    step = 0

    def header(text: str) -> None:
        nonlocal step
        step += 1
        print_fn("")
        print_fn(f"[{step}/{len(active)}] {text}")

    B = opts.batch or cfg.train.micro_batch
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, mc.vocab_size, (B, mc.seq_len + 1), generator=gen).to(device)

    if "batch" in active:
        t0 = time.perf_counter()
        header("batch invariance: a sample alone vs the same sample first/middle/last in batches of size "
               f"{_sizes(opts.sizes)} (sequences) and {_sizes(opts.row_sizes)} (rows)")
        res["batch_invariance"] = batch_invariance(mc, model, device, opts, seed)
        for line in format_batch(res["batch_invariance"]):
            print_fn(line)
        res["seconds"]["batch"] = time.perf_counter() - t0

    if "repeat" in active:
        t0 = time.perf_counter()
        header(f"run-to-run: forward + backward of the model x{opts.repeats} under tier {tier} ({TIERS[tier]}), "
               f"batch {B} x {mc.seq_len} tokens")
        res["run_to_run"] = run_to_run(model, tokens, opts.repeats, autocast, seed)
        for line in format_repeat(res["run_to_run"], f"tier {tier}"):
            print_fn(line)
        res["seconds"]["repeat"] = time.perf_counter() - t0

    if "atomics" in active:
        t0 = time.perf_counter()
        header(f"atomics: scatter_add_/index_add_ rerun {opts.atomics_reruns} times")
        res["atomics"] = atomics_demo(device, opts.atomics_n, opts.atomics_bins, opts.atomics_reruns, seed)
        for line in format_atomics(res["atomics"], opts.atomics_n, opts.atomics_bins):
            print_fn(line)
        res["seconds"]["atomics"] = time.perf_counter() - t0

    if "control" in active:
        t0 = time.perf_counter()
        header("negative control: determinism off (tier 0 settings), and a different CPU thread count")
        ctl: dict = {}
        try:
            apply_tier(DetConfig(tier=0, threads=torch.get_num_threads()))
            ctl["tier0"] = run_to_run(model, tokens, opts.repeats, autocast, seed)
        finally:
            apply_tier(det)
        for line in format_repeat(ctl["tier0"], "tier 0"):
            print_fn(line)
        atom = [a for a in res.get("atomics", []) if "off" in a["variant"]]
        if atom:
            ctl["atomics_off_differ"] = sum(a["differ"] for a in atom)
            print_fn(f"  atomics, deterministic mode off: {ctl['atomics_off_differ']} differing reruns (section "
                     "atomics)")
        th = thread_control(model if device.type == "cpu" else None, tokens if device.type == "cpu" else None,
                            seed)
        apply_tier(det)
        ctl["threads"] = th
        if th is None:
            print_fn("  threads: one core, no thread-count control")
        else:
            s = th["sum_1e7"]
            print_fn(f"  sum of 1e7 fp32 values, 1 vs 2 threads: {'identical' if s['equal'] else 'differs'}"
                     + ("" if s["equal"] else f" (|diff| {_g(s['max_abs'])}, {s['max_ulp']} ULP)"))
            if "model" in th:
                m = th["model"]
                print_fn("  model forward+backward, 1 vs 2 threads: " + (
                    "identical (loss, logits and every gradient)" if m["identical"] else
                    f"differs (loss bits {' vs '.join(m['loss_bits'])}; {m['grads_differing']} parameter gradients, "
                    f"max|diff| {_g(m['grad_max_abs'])})"))
        varied = (not ctl["tier0"]["identical"]) or ctl.get("atomics_off_differ", 0) > 0 or (
            th is not None and (not th["sum_1e7"]["equal"] or not th.get("model", {}).get("identical", True)))
        ctl["variance_seen"] = varied
        print_fn(f"  => variance with determinism off on this device: {'yes' if varied else 'none seen'}")
        res["negative_control"] = ctl
        res["seconds"]["control"] = time.perf_counter() - t0

    # the verdict: what the active tier promises on one device
    problems = []
    rr = res.get("run_to_run")
    promised = policy(tier).deterministic_ops  # one device: reruns identical from tier 2 on
    if promised and rr is not None and not rr["identical"]:
        problems.append("run-to-run " + ("stopped: " + rr["error"] if rr["error"] else "differs"))
    det_ops = [a for a in res.get("atomics", []) if a["variant"].startswith("detops")]
    if det_ops and det_ops[0]["differ"]:
        problems.append("detops.scatter_add was not repeatable")
    res["pass"] = not problems
    res["problems"] = problems
    res["seconds"]["total"] = time.perf_counter() - t_start
    print_fn("")
    if not promised:
        print_fn(f"verdict: tier {tier} ({TIERS[tier]}) promises no identical numerics; nothing to fail "
                 f"({res['seconds']['total']:.0f} s)")
    elif problems:
        print_fn(f"verdict: FAIL at tier {tier}: {'; '.join(problems)} ({res['seconds']['total']:.0f} s)")
    else:
        print_fn(f"verdict: PASS: tier {tier} ({TIERS[tier]}) reruns are bitwise identical on this device "
                 f"({res['seconds']['total']:.0f} s)")
    return res


def _ints(s: str) -> list[int]:
    try:
        out = [int(x) for x in s.split(",") if x.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{s!r} is not a comma-separated list of integers") from e
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"{s!r}: sizes must be positive integers")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dettrain.verify", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("overrides", nargs="*", help="training config overrides, e.g. model=125m det.tier=2")
    ap.add_argument("--device", default="auto", help="auto (cuda when available), cpu, cuda or cuda:N")
    ap.add_argument("--dtypes", default="fp32,bf16", help="dtypes of the batch-invariance table")
    ap.add_argument("--sizes", type=_ints, default=Options().sizes, help="batch sizes for sequence ops")
    ap.add_argument("--row-sizes", type=_ints, default=Options().row_sizes, help="batch sizes for row ops")
    ap.add_argument("--repeats", type=int, default=5, help="forward+backward repeats (>= 2)")
    ap.add_argument("--batch", type=int, default=None, help="sequences per repeat (default train.micro_batch)")
    ap.add_argument("--atomics-n", type=int, default=1_000_000)
    ap.add_argument("--atomics-bins", type=int, default=100)
    ap.add_argument("--atomics-reruns", type=int, default=20)
    ap.add_argument("--skip", default="", help=f"comma-separated sections to skip: {','.join(SECTIONS)}")
    ap.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON")
    args = ap.parse_intermixed_args(argv)  # overrides may sit between flags
    try:
        dtypes = [d for d in args.dtypes.split(",") if d]
        for d in dtypes:
            if d not in DTYPES:
                raise ValueError(f"--dtypes: {d!r} is not one of {','.join(DTYPES)}")
        skip = [s for s in args.skip.split(",") if s]
        for s in skip:
            if s not in SECTIONS:
                raise ValueError(f"--skip: {s!r} is not a section; sections: {','.join(SECTIONS)}")
        if args.repeats < 2:
            raise ValueError("--repeats must be >= 2 (one run has nothing to compare with)")
        if args.atomics_reruns < 1:
            raise ValueError("--atomics-reruns must be >= 1")
        cfg = load_config(args.overrides)
        from dettrain.determinism import set_env_before_cuda
        from dettrain.tiers import is_tier, not_a_tier, policy

        if not is_tier(cfg.det.tier):
            raise ValueError(not_a_tier(cfg.det.tier))
        if policy(cfg.det.tier).pin_threads and cfg.det.threads <= 0:
            raise ValueError(f"det.threads={cfg.det.threads}: det.tier={cfg.det.tier} pins a positive thread count")
        set_env_before_cuda(cfg.det.tier)  # before anything touches CUDA
        dev = args.device
        if dev == "auto":
            dev = "cuda" if torch.cuda.is_available() else "cpu"
        device = torch.device(dev)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda: no CUDA device is visible; use --device cpu")
        if device.type == "cuda":
            if device.index is None:  # set_device needs an index on some torch versions
                device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(device)
    except ValueError as e:
        print(f"dettrain.verify: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - Hydra's override errors: a message, not a traceback
        if type(e).__module__.startswith(("hydra", "omegaconf")):
            print(f"dettrain.verify: error: {e}", file=sys.stderr)
            return 2
        raise
    opts = Options(device=dev, dtypes=dtypes, sizes=args.sizes, row_sizes=args.row_sizes, repeats=args.repeats,
                   batch=args.batch, atomics_n=args.atomics_n, atomics_bins=args.atomics_bins,
                   atomics_reruns=args.atomics_reruns, skip=skip)
    res = run(cfg, opts, device)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(res, f, indent=1, default=str)
    return 0 if res["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
