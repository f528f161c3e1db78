"""Entry point: ``python -m dettrain [+exp=NAME] [key=value ...]`` or ``torchrun --nproc-per-node=N -m dettrain ...``.

Hydra composes the config (schema -> conf/config.yaml -> +exp -> CLI).  Every rank composes it itself; dettrain
then agrees on one run dir and only rank 0 writes Hydra's files (.hydra/), the resolved config and the ledger.
With Hydra's multirun (``-m key=a,b``) job N runs in ``<run dir>/<N>`` (dettrain/rundir.py).

Exit status: 0 done; 2 bad input (a ``UserError``: one line on stderr, no traceback); 3 stopped by the live check
(det.on_divergence=stop); 4 non-finite loss or gradient norm (dettrain/nonfinite.py); 75 preempted after a
checkpoint (requeue with ckpt.resume=auto).  Any other exception is an internal error and keeps its traceback.
"""

from __future__ import annotations

# first, before the slow imports: a SIGTERM/SIGUSR1 from here on is a preemption request, never a kill mid-setup
from dettrain.rundir import install_early_signal_flag

install_early_signal_flag()

import sys  # noqa: E402

import hydra  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402

from dettrain.config import conf_dir, register  # noqa: E402
from dettrain.errors import EXIT_USAGE, UserError  # noqa: E402

register()


def _task(dcfg: DictConfig) -> None:
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
        run(OmegaConf.to_object(dcfg), files)
    except UserError as e:  # bad input: a clear message, no traceback
        print(f"dettrain: error: {e}", file=sys.stderr)
        sys.exit(EXIT_USAGE)
    except DivergenceStop as e:  # det.on_divergence=stop: every rank ends here at the same step, ledger closed
        print(f"dettrain: {e}", file=sys.stderr)
        sys.exit(EXIT_DIVERGED)
    except NonFiniteStop as e:  # every rank ends here at the same step, ledger closed
        print(f"dettrain: error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)


def main() -> None:
    hydra.main(version_base="1.3", config_path=str(conf_dir()), config_name="config")(_task)()


if __name__ == "__main__":
    main()
