"""Shared test helpers: real training runs in subprocesses (python -m dettrain, torchrun on Gloo)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# every subprocess (python -m dettrain, torchrun workers, worker scripts under tests/) imports the tree under test
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)

# The files whose tests take longest, longest first (the sum of their tests' `--durations=0`, 281 s down to 42 s,
# on the 2-core machine, 2026-12-07).  They are collected first, the other files after them in name order, so that
# the two pytest-xdist workers of the README's command (`--dist loadfile`: a worker takes the next file in
# collection order whenever it runs out) start with the long files and end on short ones, instead of one worker
# running a long file at the end while the other waits.  Only the order of whole files changes; a file's tests
# keep their order.
LONG_FILES = ("test_checkpoint.py", "test_export.py", "test_custom_model.py", "test_collectives.py", "test_rundir.py",
              "test_engines.py", "test_data.py", "test_trace.py", "test_own_loop.py", "test_compile.py", "test_hf.py",
              "test_memory.py", "test_checkpoint_names.py", "test_interrupt.py", "test_determinism.py",
              "test_slurm.py", "test_bench_grid.py", "test_wandb_io.py", "test_exit_codes.py", "test_diff.py",
              "test_eval.py", "test_launch.py", "test_engine_registry.py", "test_attention.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONG_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONG_FILES)))  # stable: name order after, and within


# a tiny, fast job: 2 layers of width 64 on 64-token samples of the embedded corpus
TINY = [
    "model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=128",
    "model.seq_len=64", "train.steps=4", "train.global_batch=8", "train.micro_batch=2",
    "data.max_bytes=300000", "log.wandb.mode=disabled", "log.every=1",
]


def train(run_dir: Path | str, *overrides: str, nproc: int = 1, env: dict | None = None, check: bool = True,
          timeout: int = 600, tiny: bool = True, unset_env: tuple[str, ...] = (),
          script: Path | str | None = None, module: tuple[str, ...] = ("dettrain",),
          config_dir: Path | str | None = None) -> subprocess.CompletedProcess:
    """Run one training job as real processes; ``nproc`` > 1 goes through torchrun (Gloo on this CPU).

    The environment pins OMP_NUM_THREADS=1 unless ``unset_env`` names it (variables in ``unset_env`` are removed
    after ``env`` is applied).  ``script``: a Python file to run instead of ``-m dettrain`` (it runs dettrain);
    ``module``: the entry point after ``-m`` (e.g. ``("dettrain.cli", "train")``); ``config_dir``: Hydra's
    ``--config-dir`` (a user's own YAML directory, for ``+exp=NAME`` defined there)."""
    args = [*(["--config-dir", str(config_dir)] if config_dir else []), *(TINY if tiny else []),
            f"run_dir={run_dir}", *overrides]
    entry = [str(script)] if script is not None else ["-m", *module]
    if nproc == 1:
        cmd = [sys.executable, *entry, *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               *entry, *args]
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    full_env.pop("DETTRAIN_RUN_ID", None) if env is None or "DETTRAIN_RUN_ID" not in env else None
    for k in unset_env:
        full_env.pop(k, None)
    if script is not None:
        full_env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), full_env.get("PYTHONPATH", "")) if p)
    p = subprocess.run(cmd, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"training failed ({p.returncode}): {' '.join(cmd)}\n--- stdout\n{p.stdout[-4000:]}"
                             f"\n--- stderr\n{p.stderr[-6000:]}")
    return p


# the fields first (positional access s[0] == step, s[2] == batch, ... keeps working), then every other field
HEAD_FIELDS = ("step", "loss_bits", "batch", "grad", "param", "opt")


def step_fields(run_dir: Path | str, fields: tuple[str, ...] | None = None) -> list[tuple]:
    """The ledger's step lines as tuples.  Default: the WHOLE line (HEAD_FIELDS, then every other field, loss,
    lr, grad_norm and tensors included, as sorted (key, value) pairs), so identity tests compare every field;
    ``fields``: only those."""
    from dettrain.record.ledger import read_ledger

    _, steps = read_ledger(run_dir)
    if fields is not None:
        return [tuple(s[f] for f in fields) for s in steps]
    return [tuple(s[f] for f in HEAD_FIELDS) + tuple(sorted((k, v) for k, v in s.items() if k not in HEAD_FIELDS))
            for s in steps]


def run_script(script: Path, out: Path, nproc: int, *args: str) -> str:
    """Run an example script (``script --out OUT ...``) in one process or under torchrun with ``nproc`` Gloo ranks,
    OMP_NUM_THREADS=1; fails the test with its output unless it exits 0; returns its stdout."""
    cmd = [sys.executable, str(script), "--out", str(out), *args] if nproc == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", str(script),
         "--out", str(out), *args]
    p = subprocess.run(cmd, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    return p.stdout


def has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        return False


gpu = pytest.mark.skipif(not has_cuda(), reason="needs a CUDA GPU; CI has none (results recorded in BENCHMARKS.md)")


def sums_with_1_and_2_threads(seed: int):
    """x.sum() of 1e7 fp32 values drawn from ``seed``, with torch on 1 and on 2 threads (the CPU thread trap)."""
    import torch

    x = torch.randn(10_000_000, generator=torch.Generator().manual_seed(seed))
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        a = x.sum()
        torch.set_num_threads(2)
        b = x.sum()
    finally:
        torch.set_num_threads(old)
    return a, b


class GradParts:
    """The least an ``Engine.clip_`` needs: ``grad_parts()`` returning the given tensors (the clip tests call the
    base class's method on it)."""

    def __init__(self, parts):
        from dettrain.sync.engines.base import Engine

        self.parts = parts
        self._clip = Engine.clip_

    def clip_(self, max_norm, norm):
        self._clip(self, max_norm, norm)

    def grad_parts(self):
        return self.parts


def hub_repo(home: Path, repo_id: str, src: Path, repo_type: str = "model",
             rev: str = "0123456789abcdef0123456789abcdef01234567") -> Path:
    """Put the files under ``src`` into ``home`` (an HF_HOME) as huggingface_hub's cache lays them out:
    hub/<type>s--org--name/{blobs/<sha256>, refs/main, snapshots/<rev>/<path> -> blob}.  Returns the snapshot."""
    import hashlib
    import shutil

    repo = home / "hub" / (f"{repo_type}s--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / rev
    (repo / "blobs").mkdir(parents=True)
    (repo / "refs").mkdir()
    for f in sorted(p for p in src.rglob("*") if p.is_file()):
        rel = f.relative_to(src)
        digest = hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copyfile(f, repo / "blobs" / digest)
        link = snap / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(repo / "blobs" / digest, link.parent))
    (repo / "refs" / "main").write_text(rev)
    return snap


@contextlib.contextmanager
def tmpfs(path: Path, options: str = "size=1m", leave: int | None = None):
    """A tmpfs mounted at ``path`` (made here) with mount ``options`` for the block, unmounted after; ``leave``:
    fill it with a file ``filler`` until at most that many bytes are free.  Skips the test where it cannot mount
    (not root, no mount)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a tmpfs")
    path.mkdir(exist_ok=True)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)]).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        if leave is not None:
            try:
                with open(path / "filler", "wb") as f:
                    while (st := os.statvfs(path)).f_bavail * st.f_frsize > leave:
                        f.write(b"\0" * 4096)
                        f.flush()
            except OSError:
                pass  # full
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)])
