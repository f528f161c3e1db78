"""python -m dettrain.verify: batch-invariance table, run-to-run check with localisation, atomics, negative control."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch
from conftest import REPO, gpu, sums_with_1_and_2_threads
from torch import nn

from dettrain.models.llama import ModelConfig, build_model
from dettrain.tools.verify import OpCase, check_op, compare, run_to_run
from dettrain.tools.verify import main as verify_main

SMALL_MODEL = ["model.dim=32", "model.n_layers=2", "model.n_heads=2", "model.n_kv_heads=1", "model.ffn_dim=64",
               "model.seq_len=16", "train.micro_batch=4"]
SMALL_FLAGS = ["--sizes", "1,2,5", "--row-sizes", "1,2,8,33", "--repeats", "2", "--atomics-n", "20000",
               "--atomics-reruns", "3"]


def tiny_model() -> nn.Module:
    return build_model(ModelConfig(dim=32, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=64, seq_len=16), 0)


def tokens(b: int = 4, t: int = 16) -> torch.Tensor:
    return torch.randint(0, 256, (b, t + 1), generator=torch.Generator().manual_seed(1))


class Noise(nn.Module):
    """Adds tiny noise from an unseeded generator: differs on every call, whatever torch's seed."""

    def __init__(self) -> None:
        super().__init__()
        self.gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(7), "little"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1e-6 * torch.randn(x.shape, generator=self.gen)


class _GradNoise(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gen):
        ctx.gen = gen
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g + 1e-6 * torch.randn(g.shape, generator=ctx.gen), None


class GradNoise(Noise):
    """Identity forward; its backward adds tiny unseeded noise (a nondeterministic backward kernel)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _GradNoise.apply(x, self.gen)


def test_clean_model_is_identical_and_nothing_is_named():
    r = run_to_run(tiny_model(), tokens(), 3)
    assert r["identical"] and r["differing_repeats"] == 0 and r["error"] is None
    assert r["first_forward"] is None and r["first_backward"] is None
    assert r["n_forward"] > 10 and r["n_backward"] > 10 and len(r["loss_bits"]) == 1


def test_localises_a_module_with_noise_in_forward():
    model = tiny_model()
    model.layers[1].ffn = nn.Sequential(model.layers[1].ffn, Noise())
    r = run_to_run(model, tokens(), 3)
    assert not r["identical"] and r["differing_repeats"] == 2
    assert r["first_forward"]["module"] == "layers.1.ffn.1" and r["first_forward"]["what"] == "output"
    assert r["first_forward"]["last_equal"]["module"] == "layers.1.ffn.0"  # the wrapped FeedForward still matched
    assert r["first_backward"]["after_forward_difference"]


def test_localises_a_module_with_noise_in_backward():
    model = tiny_model()
    model.layers[0].ffn = nn.Sequential(GradNoise(), model.layers[0].ffn)
    r = run_to_run(model, tokens(), 3)
    assert not r["identical"]
    assert r["first_forward"] is None  # every module output identical
    assert r["first_backward"]["module"] == "layers.0.ffn.0" and not r["first_backward"]["after_forward_difference"]
    assert r["first_backward"]["last_equal"]["module"] == "layers.0.ffn.1"
    assert r["grads_differing"] > 0  # the parameters before it (layer 0 attention, embedding) got other gradients


def test_check_op_finds_batch_variance_and_position_disagreement():
    """check_op against ops whose batch dependence is known by construction."""
    rows = lambda gen, n: (torch.randn(n, 8, generator=gen),)  # noqa: E731
    sizes = [1, 2, 3, 8]
    inv = check_op(OpCase("invariant", "row", "(8,)", rows, lambda x: x * 3.0), sizes, 0)
    assert inv["differ"] == 0 and inv["sizes_differ"] == [] and inv["max_ulp"] == 0
    assert inv["cases"] == 1 + 2 + 3 + 3  # positions first/middle/last, deduplicated
    var = check_op(OpCase("batch-size dependent", "row", "(8,)", rows, lambda x: x + 1e-3 * x.shape[0]), sizes, 0)
    assert var["sizes_differ"] == [2, 3, 8] and var["differ"] == var["cases"] - 1 and var["share"] > 0.5
    assert var["positions_disagree"] == []
    pos = check_op(OpCase("position dependent", "row", "(8,)", rows,
                          lambda x: x + 1e-3 * torch.arange(x.shape[0])[:, None]), sizes, 0)
    assert pos["positions_disagree"] == [2, 3, 8] and 1 not in pos["sizes_differ"]


def test_compare_counts_ulps_and_signed_zero():
    one = torch.tensor([1.0])
    nxt = torch.nextafter(one, torch.tensor([2.0]))
    c = compare(one, nxt)
    assert not c["equal"] and c["max_ulp"] == 1 and c["n_diff"] == 1
    assert compare(torch.tensor([-1.0]), torch.tensor([1.0]))["max_ulp"] == 2 * 0x3F800000
    assert not compare(torch.tensor([0.0]), torch.tensor([-0.0]))["equal"]
    assert compare(one.bfloat16(), nxt.bfloat16())["equal"]  # both round to 1.0 in bf16


def run_verify(tmp_path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "verify.json"
    p = subprocess.run([sys.executable, "-m", "dettrain.verify", *SMALL_MODEL, *SMALL_FLAGS, *args, "--json",
                        str(out)], cwd=REPO, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode in (0, 1), p.stderr[-3000:]
    return p, json.loads(out.read_text())


def test_cli_runs_every_section_on_cpu(tmp_path):
    p, res = run_verify(tmp_path, "det.tier=2", "--device", "cpu")
    assert p.returncode == 0 and "verdict: PASS" in p.stdout
    ops = {(r["op"].split(" ")[0], r["dtype"]) for r in res["batch_invariance"]}
    for op in ("linear", "lm", "rmsnorm", "softmax", "log_softmax", "cross_entropy", "attention", "model"):
        assert (op, "fp32") in ops and (op, "bf16") in ops
    lin = next(r for r in res["batch_invariance"] if r["op"].startswith("linear") and r["dtype"] == "fp32")
    assert lin["cases"] == 1 + 2 + 3 + 3 and set(lin["sizes_differ"]) <= {2, 8, 33}
    assert res["tier"] == 2 and res["model"]["dim"] == 32 and res["run_to_run"]["identical"]
    atom = {a["variant"].split(",")[0].split(" (")[0]: a for a in res["atomics"]}
    assert atom["detops.scatter_add"]["differ"] == 0 and atom["detops.scatter_add"]["max_err_vs_fp64"] < 1e-3
    ctl = res["negative_control"]
    assert "tier0" in ctl and isinstance(ctl["variance_seen"], bool)
    # the thread-count control reports what a 1e7 fp32 sum does with 1 and 2 threads: recompute it here
    from dettrain.determinism import derive_seed

    if (os.cpu_count() or 1) >= 2:
        a, b = sums_with_1_and_2_threads(derive_seed(0, "verify"))
        assert ctl["threads"]["sum_1e7"]["equal"] == torch.equal(a, b)
        assert ctl["variance_seen"] or torch.equal(a, b)
    # every section ran and reported (the values are durations for the report; never compared)
    assert {"batch", "repeat", "atomics", "control"} <= set(res["seconds"])


def test_cli_tier0_never_fails_and_bad_flags_exit_2(tmp_path, capsys):
    p, res = run_verify(tmp_path, "det.tier=0", "--skip", "batch,atomics,control")
    assert p.returncode == 0 and "promises no identical numerics" in p.stdout
    assert "batch_invariance" not in res and res["tier"] == 0
    # bad input is refused before anything runs (in-process: nothing global is touched on these paths)
    assert verify_main(["--skip", "nope"]) == 2
    assert verify_main(["det.tier=9"]) == 2
    assert verify_main(["--repeats", "1"]) == 2
    err = capsys.readouterr().err
    assert "--skip: 'nope'" in err and "det.tier=9" in err and "--repeats" in err


@gpu
def test_cli_on_cuda(tmp_path):
    p, res = run_verify(tmp_path, "det.tier=2", "--device", "cuda")
    assert p.returncode == 0, p.stdout[-3000:]
    assert res["device"].startswith("cuda") and res["run_to_run"]["identical"]
    assert next(a for a in res["atomics"] if a["variant"].startswith("detops"))["differ"] == 0
