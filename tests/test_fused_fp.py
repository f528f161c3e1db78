"""``DETTRAIN_FP_FUSED=1`` (an experiment): the FSDP2 engine's AdamW launches (``kernels.optim.adamw_many_``) also
hash the parameters and moments they store, and the step line takes its param and opt fields from them.

The promise: the same ledger, every field of every step, as hashing the stored tensors again; and the same AdamW
bits as without it.  The kernel runs on CUDA; here on the CPU it runs under Triton's interpreter
(``TRITON_INTERPRET=1``, in a subprocess, since the setting is read at import), with Triton importable or in the
directory ``DETTRAIN_TEST_TRITON_SITE`` names: ``.ci/run`` installs it there, so that only these subprocesses import
it, and on CI (``CI=true``) a missing Triton fails these tests rather than skipping them; elsewhere they are skipped
without it.  The kernel is also compiled to sm_90 machine code (no GPU needed), which the interpreter does not do.
Without the kernel the setting changes nothing (the loop runs, and the step hashes as usual).  On a GPU (marked):
FSDP2 at tiers 3 and 4, fused against unfused ledgers.
"""

from __future__ import annotations

import collections
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, gpu, step_fields, train

# Triton for the interpreter tests: importable here, or in the directory DETTRAIN_TEST_TRITON_SITE names (.ci/run
# installs it there, so that only these tests' subprocesses import it)
SITE = os.environ.get("DETTRAIN_TEST_TRITON_SITE", "")
HAVE_TRITON = importlib.util.find_spec("triton") is not None or (bool(SITE) and (Path(SITE) / "triton").is_dir())
ON_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
needs_triton = pytest.mark.skipif(not HAVE_TRITON and not ON_CI,
                                  reason="needs Triton for its CPU interpreter (pip install triton, or "
                                  "DETTRAIN_TEST_TRITON_SITE=DIR holding it; .ci/run installs it there)")
PROBE = REPO / "tests" / "fused_fp_probe.py"
INTERPRET = {"TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(
    p for p in (SITE, str(REPO), os.environ.get("PYTHONPATH", "")) if p)}


def require_triton() -> None:
    """On CI (CI=true) the interpreter tests must run: a missing Triton fails them instead of skipping them."""
    if not HAVE_TRITON:
        pytest.fail("CI must run the fused-fingerprint tests, but Triton is missing: .ci/run installs it into "
                    ".ci/triton-site and exports DETTRAIN_TEST_TRITON_SITE")


KERNEL = r"""
import torch
from dettrain.kernels import optim as O
from dettrain.record.fingerprint import combine, fingerprint_torch

sizes = [5000, 2048, 17, 4096 * 2 + 3, 1, 0]  # whole blocks, tails, one element, an empty shard
wds = [0.1, 0.0, 0.1, 0.0, 0.1, 0.0]
bases = [0, 5000, 7048, 7065, 15260, 15261]
N = 20000  # the opt field's second moment starts N past the first


def state():
    g = torch.Generator().manual_seed(1)
    return ([torch.randn(n, generator=g) for n in sizes], [torch.randn(n, generator=g) for n in sizes],
            [torch.randn(n, generator=g) * 0.1 for n in sizes], [torch.rand(n, generator=g) * 0.01 for n in sizes])


import os

# the default launch shape, the unfused kernel's (the fused kernel's first form), and a small one: each stores the
# reference's bits and hashes them
for shape in ("", "2048x8", "256x2"):
    os.environ[O.FP_SHAPE_ENV] = shape
    ref, fused = state(), state()
    for step in (1, 2, 3):
        kw = dict(beta1=0.9, beta2=0.95, lr=1e-3 * step, weight_decays=wds, eps=1e-8, step=step)
        assert O.adamw_many_(*ref, **kw, impl="torch") is None  # the reference loop hashes nothing
        fp = O.adamw_many_(*fused, **kw, fp_bases=bases, fp_numel=N)
        for a, b in zip(ref, fused):  # the update's bits are the reference's
            assert all(torch.equal(x.view(torch.int32), y.view(torch.int32)) for x, y in zip(a, b)), shape
        p, _, m, v = fused  # and the partials are the fingerprints of what was stored, read again
        want = [combine([fingerprint_torch(t, o) for t, o in zip(p, bases)]),
                combine([fingerprint_torch(t, o) for t, o in zip(m, bases)]
                        + [fingerprint_torch(t, N + o) for t, o in zip(v, bases)])]
        assert [x & (2**64 - 1) for x in fp.tolist()] == want, (shape, fp, want)
print("fused ok")
"""


@needs_triton
def test_fused_adamw_stores_the_reference_bits_and_hashes_them():
    require_triton()
    p = subprocess.run([sys.executable, "-c", KERNEL], cwd=REPO, capture_output=True, text=True, timeout=600,
                       env={**os.environ, **INTERPRET})
    assert p.returncode == 0 and "fused ok" in p.stdout, p.stdout[-2000:] + p.stderr[-3000:]


COMPILE = r"""
import os, re, subprocess, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from dettrain.kernels import optim as O

scalars = {n: "fp32" for n in ("b1", "c1", "b2", "c2", "decay", "inv_sqrt_bc2", "eps", "step_size")}
base = {"meta_ptr": "*i64", "ent_ptr": "*i32", "n_ent": "i32", "n_tensors": "i32"}
consts = {"BLOCK": "constexpr", "ALIGNED": "constexpr"}
cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def resources(fn, sig, block, warps, aligned):
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs={"BLOCK": block, "ALIGNED": aligned}),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "enable_fp_fusion": False})
    assert k.asm["cubin"], aligned
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        out = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    regs, stack = (int(x) for x in re.search(r"REG:(\d+).*?STACK:(\d+)", out).groups())
    # warps resident on an sm_90 SM by registers: 64 Ki of them, given out per warp in units of 256, at most 64
    # warps (the block's shared memory, a few KiB for the sums, allows more)
    per_warp = -(-regs * 32 // 256) * 256
    return regs, stack, min(64 // warps, 65536 // (per_warp * warps)) * warps


block, warps = O.fp_launch_shape()
for aligned in (True, False):
    fused = resources(O._adamw_many_fp_kernel, {**base, "part_ptr": "*i64", **scalars, **consts}, block, warps, aligned)
    plain = resources(O._adamw_many_kernel, {**base, **scalars, **consts}, O.ADAMW_BLOCK, 8, aligned)
    print(f"aligned={aligned}: fused {block}x{warps}: {fused}; unfused {O.ADAMW_BLOCK}x8: {plain} "
          "(registers, stack bytes, resident warps an SM)")
    # the fused launch spills nothing and keeps as many warps resident as the unfused one, so its loads overlap
    # its hashing as well
    assert fused[1] == 0 and fused[2] >= plain[2], (fused, plain)
print("compiled")
"""


@needs_triton
def test_fused_kernel_compiles_for_hopper():
    """The interpreter runs Python, not the compiler: the fused kernel must also compile (to sm_90 machine code,
    with Triton's bundled ptxas; no GPU needed), and at its launch shape (``optim.fp_launch_shape``) use few enough
    registers to keep as many warps on an SM as the unfused AdamW kernel (at the unfused shape it took 178
    registers a thread, a quarter of those warps, and ran slower at 7B: BENCHMARKS.md)."""
    require_triton()
    p = subprocess.run([sys.executable, "-c", COMPILE], cwd=REPO, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PYTHONPATH": INTERPRET["PYTHONPATH"]})
    assert p.returncode == 0 and "compiled" in p.stdout, p.stdout[-2000:] + p.stderr[-3000:]


@needs_triton
def test_fused_fingerprints_change_no_ledger_field_on_two_ranks(tmp_path):
    """FSDP2 on 2 Gloo ranks at tier 4 (each hashes its own shards, at their global offsets), the kernels
    interpreted: the fused step lines equal the unfused ones; per-tensor steps (log.tensor_every) hash as usual."""
    require_triton()
    args = ("train.steps=3", "det.tier=4", "dist.engine=fsdp2", "dist.backend=gloo", "log.tensor_every=2")
    log = tmp_path / "partials.log"
    train(tmp_path / "off", *args, nproc=2, env=INTERPRET)
    train(tmp_path / "on", *args, nproc=2, script=PROBE, env={**INTERPRET, "DETTRAIN_FP_FUSED": "1",
                                                              "FUSED_FP_LOG": str(log)})
    base = step_fields(tmp_path / "off")
    assert len(base) == 3 and step_fields(tmp_path / "on") == base
    # on each rank the fused partials stood in at step 1 only; steps 0 and 2 (per-tensor values), the final
    # checkpoint's fingerprints (a later call: consumed once) and every gradient hashed as usual
    calls = collections.Counter(log.read_text().splitlines())
    assert calls == {**{f"{r} fused param+opt": 1 for r in (0, 1)}, **{f"{r} hashed param+opt": 3 for r in (0, 1)},
                     **{f"{r} hashed grad": 3 for r in (0, 1)}}, calls


def test_fused_setting_without_the_kernel_changes_nothing(tmp_path):
    """Where the Triton kernel does not run (this CPU without the interpreter), the setting falls back to hashing
    the stored tensors: the same ledger."""
    args = ("train.steps=3", "det.tier=3", "dist.engine=fsdp2")
    env, log = {"TRITON_INTERPRET": "0"}, tmp_path / "partials.log"
    train(tmp_path / "off", *args, env=env)
    train(tmp_path / "on", *args, script=PROBE, env={**env, "DETTRAIN_FP_FUSED": "1", "FUSED_FP_LOG": str(log)})
    base = step_fields(tmp_path / "off")
    assert len(base) == 3 and step_fields(tmp_path / "on") == base
    # every call hashed: one a step, and the final checkpoint's
    assert collections.Counter(log.read_text().splitlines()) == {"0 hashed param+opt": 4, "0 hashed grad": 3}


def test_a_bad_fused_launch_shape_is_refused_naming_the_variable(tmp_path, monkeypatch):
    """DETTRAIN_FP_FUSED_SHAPE=BLOCKxWARPS: parsed as given, and anything else refused, by the engine before its
    first step, with the variable, the form and the default in the message."""
    from dettrain.kernels.optim import ADAMW_FP_SHAPE, FP_SHAPE_ENV, fp_launch_shape

    monkeypatch.delenv(FP_SHAPE_ENV, raising=False)
    assert fp_launch_shape() == ADAMW_FP_SHAPE
    monkeypatch.setenv(FP_SHAPE_ENV, "512X4")
    assert fp_launch_shape() == (512, 4)
    for bad in ("1000x4", "1024", "1024x64", "x"):
        monkeypatch.setenv(FP_SHAPE_ENV, bad)
        with pytest.raises(ValueError, match=rf"DETTRAIN_FP_FUSED_SHAPE='{bad}': give BLOCKxWARPS.*1024x16"):
            fp_launch_shape()
    p = train(tmp_path / "run", "train.steps=1", "dist.engine=fsdp2", check=False,
              env={"DETTRAIN_FP_FUSED": "1", FP_SHAPE_ENV: "3x3"})
    assert p.returncode != 0 and "DETTRAIN_FP_FUSED_SHAPE='3x3': give BLOCKxWARPS" in p.stderr + p.stdout
    assert "Traceback" not in p.stderr


@gpu
@pytest.mark.parametrize("tier", [3, 4])
def test_fused_fingerprints_change_no_ledger_field_on_the_gpu(tmp_path, tier):
    """The default config on a GPU (compile auto, CUDA graphs), FSDP2 on one rank: fused and unfused ledgers are
    equal, every field of every step, with the next step queued ahead (train.overlap_steps) too."""
    pytest.importorskip("triton", reason="the fused AdamW is a Triton kernel")
    args = ("train.steps=5", f"det.tier={tier}", "dist.engine=fsdp2", "train.global_batch=16", "train.micro_batch=4",
            "model.dropout=0.1")
    train(tmp_path / "off", *args, "train.overlap_steps=false")  # serial steps (auto overlaps them on CUDA)
    train(tmp_path / "on", *args, "train.overlap_steps=false", env={"DETTRAIN_FP_FUSED": "1"})
    train(tmp_path / "ahead", *args, "train.overlap_steps=true", env={"DETTRAIN_FP_FUSED": "1"})
    base = step_fields(tmp_path / "off")
    assert len(base) == 5 and step_fields(tmp_path / "on") == base and step_fields(tmp_path / "ahead") == base
