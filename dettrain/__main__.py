"""Entry point: ``python -m dettrain [+exp=NAME] [key=value ...]`` or ``torchrun --nproc-per-node=N -m dettrain ...``.

Hydra composes the config (schema -> conf/config.yaml -> +exp -> CLI).  Every rank composes it itself; dettrain
then agrees on one run dir and only rank 0 writes Hydra's files (.hydra/), the resolved config and the ledger.
"""

from __future__ import annotations

import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from dettrain.config import conf_dir, register, to_config

register()


def _task(dcfg: DictConfig) -> None:
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


def main() -> None:
    hydra.main(version_base="1.3", config_path=str(conf_dir()), config_name="config")(_task)()


if __name__ == "__main__":
    main()
