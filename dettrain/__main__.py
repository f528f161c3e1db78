"""Entry point: ``python -m dettrain [+exp=NAME] [key=value ...]`` or ``torchrun --nproc-per-node=N -m dettrain ...``.

Hydra composes the config (schema -> conf/config.yaml -> +exp -> CLI).  Every rank composes it itself; dettrain
then agrees on one run dir and only rank 0 writes Hydra's files (.hydra/), the resolved config and the ledger.
``--help`` prints every config key with its documentation (dettrain.cli.train_help; no torch import), Hydra's own
help is ``--hydra-help``.
"""

from __future__ import annotations

import sys


def _task(dcfg) -> None:
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    from dettrain.config import to_config
    from dettrain.train import run

    try:
        cfg = to_config(dcfg)
    except ValueError as e:  # a UserError: the model node names no usable factory, a key has the wrong type
        print(f"dettrain: error: {e}", file=sys.stderr)
        sys.exit(2)
    files = {}
    try:
        hc = HydraConfig.get()
        files = {"config.yaml": OmegaConf.to_yaml(dcfg), "overrides.yaml": OmegaConf.to_yaml(hc.overrides.task),
                 "hydra.yaml": OmegaConf.to_yaml(OmegaConf.create({"hydra": OmegaConf.to_container(hc)}))}
    except ValueError:
        pass
    from dettrain.reference import EXIT_DIVERGED, DivergenceStop

    try:
        run(cfg, files)
    except ValueError as e:  # bad input: a clear message, no traceback
        print(f"dettrain: error: {e}", file=sys.stderr)
        sys.exit(2)
    except DivergenceStop as e:  # det.on_divergence=stop: every rank ends here at the same step, ledger closed
        print(f"dettrain: {e}", file=sys.stderr)
        sys.exit(EXIT_DIVERGED)


def hydra_main() -> None:
    """Hydra's main over sys.argv[1:] (imports torch through the schema)."""
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
