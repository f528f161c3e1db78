"""The engines behind one seam (engines/): FSDP2 with the canonical reduce-scatter keeps tiers 3 and 4, and at tier 4
FSDP2 and the flat engine give the same bits on any power-of-two world size, also across a resume onto another one.

Every comparison is between real training runs (Gloo processes), whole step lines (all fields, grad_norm and lr
included)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import GradParts, gpu, train

from dettrain.errors import UserError
from dettrain.sync.engines import exact_sumsq, resolve_engine

# 4 micro-batches per step: 2 rounds of 2 on 2 ranks, 1 round of 4 on 4 ranks, 4 rounds on 1 rank
JOB = ("train.global_batch=8", "train.micro_batch=2", "model.dropout=0.1")


def step_lines(run_dir) -> list[dict]:
    lines = [json.loads(x) for x in (run_dir / "ledger.jsonl").read_text().splitlines()]
    return [x for x in lines if x.get("kind") == "step"]


@pytest.fixture(scope="module")
def flat_tier4(tmp_path_factory):
    d = tmp_path_factory.mktemp("flat") / "run"
    train(d, "det.tier=4", "dist.engine=flat", *JOB)
    return step_lines(d)


@pytest.mark.parametrize("nproc", [1, 2, 4])
def test_fsdp2_tier4_equals_flat_tier4_on_any_world_size(tmp_path, flat_tier4, nproc):
    d = tmp_path / "fsdp"
    train(d, "det.tier=4", "dist.engine=fsdp2", *JOB, nproc=nproc)
    got = step_lines(d)
    assert len(got) == 4
    assert got == flat_tier4  # every field of every step, dropout draws included
    header = json.loads((d / "ledger.jsonl").read_text().splitlines()[0])
    assert header["engine"] == "fsdp2" and header["world_size"] == nproc


def test_fsdp2_tier3_on_one_rank_equals_flat_tier3(tmp_path):
    """On one rank FSDP2 accumulates the micro-batches unsharded and reduces once (engines/fsdp2.py): the same left fold
    in fp32 as the flat engine's, so every field of every step must be the flat engine's (4 micro-batches)."""
    train(tmp_path / "flat", "det.tier=3", "dist.engine=flat", *JOB)
    train(tmp_path / "fsdp2", "det.tier=3", "dist.engine=fsdp2", *JOB)
    assert step_lines(tmp_path / "fsdp2") == step_lines(tmp_path / "flat")


@pytest.mark.parametrize("nproc", [2, 4])
def test_fsdp2_tier3_reruns_identical(tmp_path, nproc):
    # 4 ranks x 2 micro-batches of 1: the canonical reduce-scatter sums 4 operands per element
    job = ("train.global_batch=8", "train.micro_batch=1")
    a, b = tmp_path / "a", tmp_path / "b"
    train(a, "det.tier=3", "dist.engine=fsdp2", *job, nproc=nproc)
    # on 4 ranks the second run also keeps gathered parameters after forward (auto reshards on several ranks):
    # dist.reshard_after_forward moves no arithmetic, so the bits must not change either
    train(b, "det.tier=3", "dist.engine=fsdp2", *job, *(["dist.reshard_after_forward=false"] if nproc == 4 else []),
          nproc=nproc)
    la, lb = step_lines(a), step_lines(b)
    assert len(la) == 4 and la == lb


@pytest.mark.parametrize(("before", "after"), [(2, 4), (4, 1)])
def test_fsdp2_tier4_resume_onto_another_world_size(tmp_path, flat_tier4, before, after):
    d = tmp_path / "run"
    train(d, "det.tier=4", "dist.engine=fsdp2", *JOB, "train.stop_after=1", nproc=before)
    assert len(step_lines(d)) == 2
    # onto one rank the resume also turns dist.offload_partials on (the first pair's sum waits on the host): it moves no
    # bit and is outside the config hash, so the checkpoint resumes
    offload = ["dist.offload_partials=true"] if after == 1 else []
    train(d, "det.tier=4", "dist.engine=fsdp2", *JOB, *offload, "ckpt.resume=auto", nproc=after)
    assert step_lines(d) == flat_tier4  # the same bits as an uninterrupted run of either engine


@pytest.mark.parametrize(("overrides", "key"), [
    (("det.tier=3", "dist.engine=ddp"), "dist.engine=ddp"),
    (("dist.engine=zero3",), "dist.engine='zero3'"),
    (("det.tier=3", "dist.engine=fsdp2", "dist.shard_optimizer=true"), "dist.shard_optimizer"),
    (("det.tier=2", "dist.shard_optimizer=true"), "dist.shard_optimizer"),
    (("det.tier=3", "dist.offload_partials=true"), "dist.offload_partials=true: det.tier=3"),
    (("det.tier=3", "dist.engine=fsdp2", "dist.offload_partials=true"), "dist.offload_partials=true: det.tier=3"),
    (("det.tier=2", "dist.engine=ddp", "dist.offload_partials=true"), "resolves to ddp"),
])
def test_engine_validation(tmp_path, overrides, key):
    p = train(tmp_path / "r", *overrides, check=False)
    assert p.returncode == 2, p.stderr[-2000:]
    assert key in p.stderr and "Traceback" not in p.stderr


def test_resolve_reshard():
    from dettrain.dist import resolve_reshard

    assert resolve_reshard("auto", 1) is False and resolve_reshard("auto", 2) is True
    assert resolve_reshard(True, 1) is True and resolve_reshard("false", 8) is False


def test_resolve_engine():
    assert resolve_engine("auto", 2) == "ddp" and resolve_engine("auto", 3) == "flat"
    assert resolve_engine("fsdp2", 0) == "fsdp2" and resolve_engine("flat", 1) == "flat"
    with pytest.raises(UserError, match="dist.engine=ddp"):
        resolve_engine("ddp", 4)


def test_exact_sumsq_is_split_invariant_and_accurate():
    """The canonical norm: the same bits for any split of the elements (shards, buckets, rows), and within the
    stated bound of an fp64 reference."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(300_001, generator=g) * torch.logspace(-6, 2, 300_001)
    whole = exact_sumsq([x], 1)
    for seed in range(5):
        cuts = sorted(torch.randint(0, x.numel(), (7,), generator=torch.Generator().manual_seed(seed)).tolist())
        pieces = [x[a:b] for a, b in zip([0, *cuts], [*cuts, x.numel()])]
        perm = torch.randperm(len(pieces), generator=torch.Generator().manual_seed(seed)).tolist()
        assert exact_sumsq([pieces[i] for i in perm], 1) == whole  # any order, any split: bitwise
    ref = float((x.double() ** 2).sum())
    assert abs(whole - ref) <= ref * x.numel() * 2.0**-52
    assert exact_sumsq([torch.zeros(10)], 1) == 0.0
    assert exact_sumsq([torch.tensor([1.0, float("inf")])], 1) == float("inf")
    # a different order of plain fp32 accumulation does change bits: the property is not free
    assert float(x.sum()) != float(x.flip(0).sum()) or float((x * x).sum()) != float((x * x).flip(0).sum())



def _sumsq_by_python_ints(parts: list[torch.Tensor]) -> float:
    """exact_sumsq's definition evaluated with Python integers and floats (an independent path): the global max sets
    s, every square times 2^s is rounded half to even, the integers are added exactly and the total rounded once."""
    import math

    vals = [v for p in parts for v in p.double().reshape(-1).tolist()]
    if not vals:
        return 0.0
    mx = max(abs(v) for v in vals)
    if not math.isfinite(mx):
        return mx * mx
    if mx == 0.0:
        return 0.0
    s = 52 - math.frexp(mx * mx)[1]
    return math.ldexp(float(sum(round(v * v * 2.0**s) for v in vals)), -s)  # round(): half to even


def test_exact_sumsq_on_the_device_is_the_definition_without_a_host_read():
    """The norm is computed where the gradient is, with no host read (the step stays queued ahead of the GPU):
    its value equals the definition evaluated with Python integers, for magnitudes from fp32's subnormals to its
    largest values, zeros, and non-finite inputs; and it runs on fake tensors, which have no value to read (any
    .item() or .tolist() would raise)."""
    import math

    from torch._subclasses.fake_tensor import FakeTensorMode

    from dettrain.sync.collectives import canonical_norm, exact_sumsq_tensor

    g = torch.Generator().manual_seed(1)
    cases = [[torch.randn(n, generator=g) * torch.logspace(-6, 2, n) * scale]
             for n in (1, 2, 3, 1000, 70_001) for scale in (1e-30, 1.0, 1e30)]
    cases += [[torch.tensor([3.4e38, -3.4e38, 1.0])], [torch.tensor([1.4e-45, 1.4e-45, 0.0])],
              [torch.zeros(7)], [torch.tensor([2.0, float("inf")])], [torch.tensor([float("nan"), 1.0])],
              [torch.randn(999, generator=g), torch.randn(5, 3, generator=g)[:, ::2], torch.zeros(0)]]
    for parts in cases:
        got, want = exact_sumsq_tensor(parts, 1), _sumsq_by_python_ints(parts)
        assert got.dtype == torch.float64 and got.dim() == 0
        assert float(got) == want or (math.isnan(want) and math.isnan(float(got))), (parts[0][:3], float(got), want)
        norm, ref = float(canonical_norm(parts, 1)), float(torch.sqrt(torch.tensor(want, dtype=torch.float64)))
        assert norm == ref or (math.isnan(norm) and math.isnan(ref))
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(torch.randn(4096))
        assert exact_sumsq_tensor([fake, fake[:17]], 1).shape == ()


def test_exact_sumsq_rounds_the_integer_total_once_to_nearest_even():
    """The limbs' total (hi * 2^26 + lo, up to 86 bits) becomes an fp64 on the device exactly as Python's float()
    rounds an int: random totals of every size and exact ties between two fp64 values, each way of splitting them
    into limbs."""
    import random

    from dettrain.sync.collectives import _round_limbs

    r = random.Random(3)
    cases = [(r.getrandbits(r.randint(1, 61)), r.getrandbits(r.randint(1, 61))) for _ in range(3000)]
    for _ in range(1000):
        k, top = r.randint(1, 33), r.getrandbits(53) | (1 << 52)
        for v in ((top << k) + (1 << (k - 1)), (top << k) + (1 << (k - 1)) - 1, (top << k) + (1 << (k - 1)) + 1):
            cases += [(v >> 26, v & ((1 << 26) - 1)), ((v >> 26) - 1, (v & ((1 << 26) - 1)) + (1 << 26))]
    cases += [(0, 0), (0, 1), (0, (1 << 52) - 1), (1, 0), ((1 << 61) - 1, (1 << 61) - 1)]
    for hi, lo in cases:
        assert float(_round_limbs(torch.tensor([hi, lo], dtype=torch.int64))) == float((hi << 26) + lo), (hi, lo)


def test_clip_with_a_device_norm_gives_the_host_decisions_bits():
    """Engine.clip_ with the norm as a device tensor (no sync) leaves every bit as the host decision does: the
    coefficient when it is below 1, nothing otherwise (NaN norm: nothing; inf: zero), for fp32 and bf16 parts."""

    g = torch.Generator().manual_seed(2)
    base = [torch.randn(10_001, generator=g) * 30, torch.randn(7, 5, generator=g), torch.randn(333, generator=g)]
    base.append(base[2].to(torch.bfloat16))
    for max_norm, norm in [(1.0, 123.456789), (1.0, 0.999), (0.5, 0.5), (1.0, 1.0 - 1e-7), (1.0, float("inf")),
                           (1.0, float("nan")), (0.0, 5.0), (3.0, 1e-30)]:
        host, dev = GradParts([t.clone() for t in base]), GradParts([t.clone() for t in base])
        host.clip_(max_norm, norm)
        dev.clip_(max_norm, torch.tensor(norm, dtype=torch.float64))
        for a, b in zip(host.parts, dev.parts):
            ints = torch.int16 if a.dtype == torch.bfloat16 else torch.int32
            assert torch.equal(a.view(ints), b.view(ints)), (max_norm, norm, a.dtype)
    moved = GradParts([t.clone() for t in base])
    moved.clip_(1.0, torch.tensor(4.0, dtype=torch.float64))
    assert not torch.equal(moved.parts[0], base[0])  # the clip did act where the coefficient is below 1

@gpu
@pytest.mark.parametrize("tier", [3, 4])
def test_fsdp2_compiled_reruns_identical_on_gpu(tmp_path, tier):
    """On CUDA (NCCL, bf16 compute through FSDP2's MixedPrecisionPolicy, train.compile on): two runs, same bits."""
    job = ("model.dim=256", "model.n_layers=2", "model.n_heads=4", "model.seq_len=256", "train.global_batch=8",
           "train.micro_batch=2", "train.compile=true", f"det.tier={tier}", "dist.engine=fsdp2")
    a, b = tmp_path / "a", tmp_path / "b"
    train(a, *job)
    train(b, *job)
    la, lb = step_lines(a), step_lines(b)
    assert len(la) == 4 and la == lb


@pytest.mark.parametrize("scale", [1e-3, 0.5, 0.999999, 1.0, 3.0])
def test_ddp_clip_matches_torch_bit_for_bit(scale):
    """The DDP engine clips on the device with torch's clamped coefficient (multiplying by 1.0 where it does not
    clip, so the step never reads the norm on the host); the gradients it leaves must be bit for bit what
    torch.nn.utils.clip_grads_with_norm_ gives, on either side of (and at) the threshold, for a float or a tensor
    norm."""
    from dettrain import dist as D
    from dettrain.sync.engines import DDPEngine
    from dettrain.sync.optim import OptimConfig

    def grads_after(clip) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Linear(5, 3))
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        norm = float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]))
        clip(model, norm * scale, norm)
        return [p.grad.clone() for p in model.parameters()]

    def ours(model, max_norm, norm):
        info = D.DistInfo(0, 1, 0, torch.device("cpu"), None)
        DDPEngine(model, info, 2, OptimConfig(), lr=1e-3, bucket_mb=25.0).clip_(max_norm, norm)

    def theirs(model, max_norm, norm):
        torch.nn.utils.clip_grads_with_norm_(model.parameters(), max_norm, torch.tensor(norm))

    a, b = grads_after(ours), grads_after(theirs)
    assert all(torch.equal(x.view(torch.int32), y.view(torch.int32)) for x, y in zip(a, b))
    c = grads_after(lambda model, max_norm, norm: ours(model, max_norm, torch.tensor(norm)))
    assert all(torch.equal(x.view(torch.int32), y.view(torch.int32)) for x, y in zip(c, b))
    if scale < 0.99:  # well below the norm the gradients really are scaled (the test is not vacuous)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Linear(5, 3))
        raw = [torch.randn_like(p) for p in model.parameters()]
        assert not torch.equal(raw[0], a[0])


# 8 micro-batches per step: 4 rounds of 2 on 2 ranks, so the binary counter over rounds merges (r0 + r1) and
# (r2 + r3) before adding the two: swapping two rounds' partials changes the bits, which 2 rounds cannot show
JOB8 = ("train.global_batch=16", "train.micro_batch=2", "model.dropout=0.1")


@pytest.fixture(scope="module")
def flat_tier4_8(tmp_path_factory):
    d = tmp_path_factory.mktemp("flat8") / "run"
    train(d, "det.tier=4", "dist.engine=flat", *JOB8)
    return step_lines(d)


def test_fsdp2_tier4_four_rounds_equal_the_flat_engine(tmp_path, flat_tier4_8):
    """FSDP2 at tier 4 with 4 rounds per step on 2 ranks: every field of every step equals the flat engine's on 1
    rank (which sums the same balanced tree over 8 micro-batches in one block)."""
    train(tmp_path / "fsdp", "det.tier=4", "dist.engine=fsdp2", *JOB8, nproc=2)
    got = step_lines(tmp_path / "fsdp")
    assert len(got) == 4 and got == flat_tier4_8


@pytest.mark.parametrize("nproc", [1, 2])
def test_fsdp2_tier4_offloaded_partials_equal_the_flat_engine(tmp_path, flat_tier4_8, nproc):
    """dist.offload_partials on the FSDP2 engine: every entry of the tier-4 counters waits in host memory between
    rounds and comes back for the merges and the finish (sync/offload.py, ``HostCounter``).  2 ranks: 4 rounds, so
    round 1 merges with round 0's entry read back from the host and the finish reads two levels; 1 rank: 4 pairs,
    the same at levels 1-2.  Every field of every step equals the flat engine's (which keeps its tree on the
    device)."""
    train(tmp_path / "off", "det.tier=4", "dist.engine=fsdp2", "dist.offload_partials=true", *JOB8, nproc=nproc)
    got = step_lines(tmp_path / "off")
    assert len(got) == 4 and got == flat_tier4_8


_UNSHARDED_ALIVE = r"""
import contextlib, gc, sys, weakref
import torch
from dettrain import dist as D
from dettrain.sync.engines import FSDP2Engine, lookup
from dettrain.models.llama import build_model
from dettrain.tools.memory import compose_config, fake_group

cfg = compose_config(["det.tier=3", "train.compile=false"], 2)
dev = torch.device("cpu")
with fake_group(2, "cpu"):
    model = build_model(cfg.model, cfg.seed, dev)
    before = [weakref.ref(p) for p in model.parameters()]
    info = D.DistInfo(rank=0, world=2, local_rank=0, device=dev, backend="fake")
    engine = lookup(FSDP2Engine.name).from_config(cfg, model, info, mixed_precision=False)
    gc.collect()
    alive = [r() for r in before if r() is not None]
    print(len(before), sum(p.untyped_storage().nbytes() for p in alive))
"""


def test_fsdp2_engine_keeps_no_unsharded_parameter_alive():
    """After sharding, nothing of the engine holds the model's unsharded parameters: their storage would be the whole
    fp32 model on every rank (25 GiB at 7B, found when tools/memory.py began measuring the engine)."""
    import subprocess
    import sys

    from conftest import REPO

    p = subprocess.run([sys.executable, "-c", _UNSHARDED_ALIVE], cwd=REPO, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    n_params, alive_bytes = map(int, p.stdout.split()[-2:])
    assert n_params > 0
    assert alive_bytes == 0


def test_fsdp2_bf16_rows_equal_fp32_rows_bitwise(tmp_path):
    """With bf16 compute on several ranks the canonical reduce-scatter moves the gradients in bf16 and sums them in
    fp32 (engines/fsdp2.py ``bf16_rows``): every sharded gradient must be the one fp32 rows give, bit for bit, while
    the all_to_all moved bf16 (2 real Gloo ranks, real FSDP2, two micro-batches, a padded shard)."""
    import subprocess
    import sys

    from conftest import REPO

    out = tmp_path / "rows.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(REPO / "tests" / "fsdp_rows_worker.py"), str(out)]
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300,
                       env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-3000:]
    every = torch.load(out)
    assert len(every) == 2
    not_bf16 = 0
    for res in every:  # each rank's rows
        assert set(res["fp32"]["moved"]) == {"torch.float32"} and set(res["bf16"]["moved"]) == {"torch.bfloat16"}
        assert len(res["bf16"]["moved"]) == len(res["fp32"]["moved"]) == 2 * 4  # 2 micro-batches x 4 FSDP2 units
        wide, narrow = res["fp32"]["grads"], res["bf16"]["grads"]
        assert wide.keys() == narrow.keys() and len(wide) == 14
        for name in wide:
            a, b = wide[name], narrow[name]
            assert a.dtype == b.dtype == torch.float32 and a.numel() > 0
            assert torch.equal(a.view(torch.int32), b.view(torch.int32)), name
            not_bf16 += int((a != a.bfloat16().float()).sum())
    assert not_bf16 > 0  # the sums are fp32 values, not bf16 ones widened


def test_fsdp2_bf16_compute_tier4_is_world_size_invariant(tmp_path):
    """Tier 4 with bf16 compute: one rank (fp32 rows, FSDP2's unsharded fp32 accumulation of each pair) and two
    ranks (bf16 rows summed in fp32 by the canonical reduce-scatter) give the same step lines, every field."""
    job = ("det.tier=4", "dist.engine=fsdp2", "train.precision=bf16", *JOB)
    train(tmp_path / "one", *job)
    train(tmp_path / "two", *job, nproc=2)
    one = step_lines(tmp_path / "one")
    assert len(one) == 4 and step_lines(tmp_path / "two") == one
