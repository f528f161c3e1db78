"""Entry point: ``python -m dettrain [+exp=NAME] [key=value ...]`` or ``torchrun --nproc-per-node=N -m dettrain ...``.

Hydra composes the config (schema -> conf/config.yaml -> +exp -> CLI).  Every rank composes it itself; dettrain
then agrees on one run dir and only rank 0 writes Hydra's files (.hydra/), the resolved config and the ledger.
With Hydra's multirun (``-m key=a,b``) job N runs in ``<run dir>/<N>`` (dettrain/rundir.py).  ``--help`` prints
every config key with its documentation (dettrain.cli.train_help; no torch import); Hydra's own help is
``--hydra-help``.  ``-sc install=bash`` prints dettrain's bash completion (dettrain/completion.py).

Exit status: 0 done; 2 bad input (a ``UserError``: one line on stderr, no traceback); 3 stopped by the live check
(det.on_divergence=stop); 4 non-finite loss or gradient norm (dettrain/nonfinite.py); 75 preempted after a
checkpoint (requeue with ckpt.resume=auto).  Any other exception is an internal error and keeps its traceback.
"""

from __future__ import annotations

# first, before the slow imports: a SIGTERM/SIGUSR1 from here on is a preemption request, never a kill mid-setup
from dettrain.rundir import install_early_signal_flag

install_early_signal_flag()

import sys  # noqa: E402

from dettrain.errors import EXIT_USAGE, UserError  # noqa: E402


def _task(dcfg) -> None:
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    from dettrain.config import to_config
    from dettrain.nonfinite import NonFiniteStop
    from dettrain.reference import EXIT_DIVERGED, DivergenceStop
    from dettrain.train import run

    files = {}
    try:
        hc = HydraConfig.get()
        files = {"config.yaml": OmegaConf.to_yaml(dcfg), "overrides.yaml": OmegaConf.to_yaml(hc.overrides.task),
                 "hydra.yaml": OmegaConf.to_yaml(OmegaConf.create({"hydra": OmegaConf.to_container(hc)}))}
    except ValueError:  # no Hydra app running: nothing of Hydra's to write
        pass
    try:
        run(to_config(dcfg), files)  # to_config: the typed schema (model=custom: a typed CustomModelConfig)
    except UserError as e:  # bad input: a clear message, no traceback
        print(f"dettrain: error: {e}", file=sys.stderr)
        sys.exit(EXIT_USAGE)
    except DivergenceStop as e:  # det.on_divergence=stop: every rank ends here at the same step, ledger closed
        print(f"dettrain: {e}", file=sys.stderr)
        sys.exit(EXIT_DIVERGED)
    except NonFiniteStop as e:  # every rank ends here at the same step, ledger closed
        print(f"dettrain: error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)


def hydra_main() -> None:
    """Hydra's main over sys.argv[1:] (imports torch through the schema)."""
    from dettrain.completion import handle

    if handle(sys.argv[1:]):  # -sc install=bash: dettrain's script (dettrain/completion.py says why)
        return
    import hydra

    from dettrain.config import conf_dir, register

    register()
    hydra.main(version_base="1.3", config_path=str(conf_dir()), config_name="config")(_task)()


def main() -> None:
    if any(a in ("--help", "-h") for a in sys.argv[1:]):
        from dettrain.cli import train_help

        sys.stdout.write(train_help("python -m dettrain"))
        return
    hydra_main()


if __name__ == "__main__":
    main()
