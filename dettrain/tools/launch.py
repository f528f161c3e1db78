"""Helpers for the launch scripts (launch/*.sh, slurm/dettrain.sbatch).

``python -m dettrain.tools.launch env [key=value ...]`` builds the run's config exactly as ``python -m dettrain`` would
(schema -> conf/config.yaml -> +exp -> CLI) and prints, as shell ``export`` lines, the environment the run's tier
wants in place *before* torchrun starts its workers:

  DETTRAIN_TIER, DETTRAIN_THREADS   what the scripts print and pass on
  OMP_NUM_THREADS, MKL_NUM_THREADS  ``det.threads`` when pinned (tier >= 2, or det.threads > 0): the OpenMP pool is
                                    sized at process start, before dettrain can call torch.set_num_threads
  CUBLAS_WORKSPACE_CONFIG, NCCL_*   whatever ``determinism.set_env_before_cuda`` sets for the tier (one source of
                                    truth: the scripts and the trainer cannot disagree)
  DETTRAIN_GPUS                     visible CUDA devices (0 on CPU): the default processes per node
  DETTRAIN_RUN_DIR                  the run dir the trainers will use, when it is fixed before they start
                                    (``run_dir=...`` given or DETTRAIN_RUN_ID exported; rundir.resolve_run_dir)

A variable the user already exported keeps its value (like ``os.environ.setdefault`` in the trainer), except the
thread counts, which the tier pins.
"""

from __future__ import annotations

import os
import shlex
import sys

USAGE = "usage: python -m dettrain.tools.launch env [+exp=NAME] [key=value ...]"


def compose(overrides: list[str]):
    """The Config these overrides select (Hydra's own ``hydra.*``/``--flag`` args dropped: they change no key)."""
    from hydra import compose, initialize_config_dir

    from dettrain.config import conf_dir, register, to_config

    register()
    keep = [o for o in overrides if not o.startswith(("hydra.", "hydra/", "--", "-"))]
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3", job_name="dettrain"):
        cfg = compose(config_name="config", overrides=keep)
    return to_config(cfg)


def run_dir(cfg) -> str | None:
    """The run dir ``rundir.resolve_run_dir`` will pick, if it does not depend on the launch (None otherwise)."""
    if not (cfg.run_dir or os.environ.get("DETTRAIN_RUN_ID")):
        return None
    import torch

    from dettrain.dist import DistInfo
    from dettrain.record.rundir import resolve_run_dir

    return str(resolve_run_dir(cfg, DistInfo(0, 1, 0, torch.device("cpu"), None)))


def tier_env(tier: int, threads: int, environ: dict[str, str] | None = None) -> dict[str, str]:
    """Variables to export for ``tier``; ``environ`` (default os.environ) is what is already set."""
    from dettrain.determinism import set_env_before_cuda
    from dettrain.tiers import policy

    environ = dict(os.environ if environ is None else environ)
    out = {"DETTRAIN_TIER": str(tier), "DETTRAIN_THREADS": str(threads)}
    if policy(tier).pin_threads or threads > 0:
        out["OMP_NUM_THREADS"] = out["MKL_NUM_THREADS"] = str(max(threads, 1))
    # run the trainer's own function on a copy of the environment and export what it added
    saved = dict(os.environ)
    try:
        os.environ.clear()
        os.environ.update(environ)
        set_env_before_cuda(tier)
        added = {k: v for k, v in os.environ.items() if environ.get(k) != v}
    finally:
        os.environ.clear()
        os.environ.update(saved)
    out.update(added)
    return out


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] != "env":
        print(USAGE, file=sys.stderr)
        return 2
    try:
        cfg = compose(argv[1:])
    except Exception as e:  # noqa: BLE001 - Hydra raises several types; all mean "bad overrides"
        print(f"dettrain.tools.launch: cannot compose the config from {argv[1:]}: {e}", file=sys.stderr)
        return 2
    env = tier_env(cfg.det.tier, cfg.det.threads)
    env["DETTRAIN_GPUS"] = str(gpu_count())
    rd = run_dir(cfg)
    if rd is not None:
        env["DETTRAIN_RUN_DIR"] = rd
    for k, v in env.items():
        print(f"export {k}={shlex.quote(v)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
