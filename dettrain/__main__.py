"""Entry point: ``python -m dettrain [+exp=NAME] [key=value ...]`` or ``torchrun --nproc-per-node=N -m dettrain ...``.

Hydra composes the config (schema -> conf/config.yaml -> +exp -> CLI).  Every rank composes it itself; dettrain
then agrees on one run dir and only rank 0 writes Hydra's files (.hydra/), the resolved config and the ledger.
With Hydra's multirun (``-m key=a,b``) job N runs in ``<run dir>/<N>`` (dettrain/record/rundir.py).  ``--help`` prints
every config key with its documentation (dettrain/tools/keys.py; no torch import); Hydra's own help is
``--hydra-help``.  ``-sc install=bash`` prints dettrain's bash completion (dettrain/tools/completion.py).
``hydra.run.dir`` is refused with the key to use (``run_dir``), before Hydra creates the directory when it is on
the command line (Hydra's run dir would be one per rank and clock; dettrain's is agreed by every rank).

Exit status: 0 done; 2 bad input (a ``UserError``, or an override or config Hydra cannot parse or compose: one line
on stderr, no traceback); 3 stopped by the live check (det.on_divergence=stop); 4 non-finite loss or gradient norm
(dettrain/loop/nonfinite.py); 75 preempted after a checkpoint (SIGTERM, SIGUSR1 or a first Ctrl-C; requeue with
ckpt.resume=auto); 130 a second Ctrl-C (abort at once).  Any other exception is an internal error, or a bug in the
user's own model factory, and keeps its traceback.

Hydra prints its own errors over several lines and exits 1; ``hydra_main`` sets ``HYDRA_FULL_ERROR`` for the
call so that they reach it as exceptions, and turns them into one line (``hydra_error_line``) and exit 2.  A user
who exported ``HYDRA_FULL_ERROR=1`` gets Hydra's full traceback, as Hydra documents.
"""

from __future__ import annotations

# first, before the slow imports: a SIGTERM/SIGUSR1 from here on is a preemption request, never a kill mid-setup
from dettrain.signals import install_early_signal_flag

install_early_signal_flag()

import contextlib  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from dettrain.errors import EXIT_USAGE, UserError  # noqa: E402

_task_started = False  # set once Hydra has composed the config and called the task: later errors are not Hydra's


def _task(dcfg) -> None:
    global _task_started
    _task_started = True
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from dettrain.config import to_config
    from dettrain.loop.nonfinite import NonFiniteStop
    from dettrain.loop.trainer import run
    from dettrain.record.reference import EXIT_DIVERGED, DivergenceStop

    files = {}
    try:
        hc = HydraConfig.get()
        if hc.mode is not None and hc.mode.name == "RUN" and hc.run.dir not in (".", ""):
            # set in a YAML of the user's: Hydra made the directory already; take it back if it holds nothing
            with contextlib.suppress(OSError):
                Path(hc.run.dir).rmdir()
            print(f"dettrain: error: {RUN_DIR_REFUSED.format(dir=hc.run.dir)}", file=sys.stderr)
            sys.exit(EXIT_USAGE)
        files = {"config.yaml": OmegaConf.to_yaml(dcfg), "overrides.yaml": OmegaConf.to_yaml(hc.overrides.task),
                 "hydra.yaml": OmegaConf.to_yaml(OmegaConf.create({"hydra": OmegaConf.to_container(hc)}))}
    except ValueError:  # no Hydra app running: nothing of Hydra's to write
        pass
    try:
        try:
            cfg = to_config(dcfg)  # the typed schema (model=custom: a typed CustomModelConfig)
        except OmegaConfBaseException as e:  # a value the schema cannot take, e.g. an interpolation to no key
            raise UserError(_omegaconf_line(e)) from None
        run(cfg, files)
    except UserError as e:  # bad input: a clear message, no traceback
        print(f"dettrain: error: {e}", file=sys.stderr)
        sys.exit(EXIT_USAGE)
    except DivergenceStop as e:  # det.on_divergence=stop: every rank ends here at the same step, ledger closed
        print(f"dettrain: {e}", file=sys.stderr)
        sys.exit(EXIT_DIVERGED)
    except NonFiniteStop as e:  # every rank ends here at the same step, ledger closed
        print(f"dettrain: error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)


def _omegaconf_line(e: BaseException) -> str:
    """One line of an OmegaConf error: its message, with the key it names."""
    msg = str(e).splitlines()[0] if str(e) else type(e).__name__
    key = getattr(e, "full_key", None)
    return f"{key}: {msg}" if key and key not in msg else msg


def _key_hint(key: str) -> str:
    """What ``dettrain train --help`` says about config key ``key``: its type, or the keys beside it."""
    import difflib

    from dettrain.tools.keys import config_keys

    own = _chosen_model_keys() if key.startswith("model.") else None
    if own is not None:  # model=<a YAML with _target_>: its keys, not dettrain's LLaMA's
        name, yaml_keys = own
        leaf = key.removeprefix("model.")
        if leaf in yaml_keys:
            return f"{key} is a key of model={name}"
        return (f"{key} is not a key of model={name} (its keys: {', '.join(sorted(yaml_keys))}); a keyword argument "
                f"of its factory not listed there is added with +{key}=VALUE")
    keys = {k: t for k, t, _, _ in config_keys() if t != "group"}
    if key in keys:
        return f"{key} is {keys[key]}"
    close = difflib.get_close_matches(key, list(keys), n=2, cutoff=0.8)
    parent = key.rpartition(".")[0]
    beside = sorted(k.rpartition(".")[2] for k in keys if k.rpartition(".")[0] == parent)
    return (f"{key} is not a config key" + (f"; did you mean {' or '.join(close)}?" if close else "")
            + (f" ({parent}.* keys: {', '.join(beside)})" if beside and not close else ""))


def _chosen_model_keys() -> tuple[str, list[str]] | None:
    """(name, top-level keys) of the model group chosen on the command line (``model=NAME``) when its YAML names a
    ``_target_`` (an HF or custom model, whose keys are its factory's, not dettrain's LLaMA's); else None."""
    import re

    from omegaconf import OmegaConf

    from dettrain.config import conf_dir

    names = [m.group(1) for a in sys.argv[1:] if (m := re.fullmatch(r"model=([\w.-]+)", a))]
    if not names:
        return None
    try:
        node = OmegaConf.load(conf_dir() / "model" / f"{names[-1]}.yaml")
    except (OSError, ValueError):
        return None
    return (names[-1], [str(k) for k in node]) if "_target_" in node else None


def hydra_error_line(e: BaseException) -> str:
    """The one line dettrain prints for an error Hydra raised while parsing the overrides or composing the config:
    what was wrong, the key or override it concerns, and the fix."""
    from hydra.errors import MissingConfigException, OverrideParseException

    help_ = "dettrain train --help lists every key"
    if isinstance(e, OverrideParseException):
        return (f"cannot parse the override {e.override!r}: write key=value (key+=value to append, +key=value to add, "
                f"~key to delete); quote a value that holds spaces or shell characters, e.g. 'exp_name=\"a b\"'")
    if isinstance(e, MissingConfigException):
        what = e.missing_cfg_file or "the config"
        group = what.rpartition("/")[0]
        opts = [o for o in sorted(e.options or []) if not o.endswith("_schema")]  # llama_schema: internal
        opts = f"; available in {group}: {', '.join(opts)}" if opts else ""
        flag = "+" if group == "exp" else ""
        return (f"{flag}{what.replace('/', '=', 1) if group else what}: no such config{opts} (a YAML of your own: "
                f"--config-dir DIR holding {what}.yaml)")
    cause = e.__cause__
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    head = lines[0] if lines else type(e).__name__
    key = getattr(cause, "full_key", None) if cause is not None else None
    if cause is not None:
        why = str(cause).splitlines()[0] if str(cause) else type(cause).__name__
        if "Could not override" in head or "Could not append" in head:  # a key the schema does not have
            return f"{head.rstrip('.')}: {_key_hint(key) if key else why}; {help_}"
        override = head.removeprefix("Error merging override ").strip()
        return f"{override}: {why}" + (f" ({_key_hint(key)}; {help_})" if key else "")
    return "; ".join(ln for ln in lines if not ln.startswith(("provider=", "Config search path")))


RUN_DIR_REFUSED = ("hydra.run.dir={dir}: dettrain picks one run dir for every rank itself and does not use Hydra's; "
                   "write run_dir={dir} instead (default outputs/<exp_name>/<run_id>)")


def _hydra_run_dir(argv: list[str]) -> str | None:
    """The value of a ``hydra.run.dir=`` override on the command line (also ``+``/``++``), else None."""
    for a in argv:
        key, eq, value = a.lstrip("+").partition("=")
        if eq and key == "hydra.run.dir":
            return value
    return None


def hydra_main() -> None:
    """Hydra's main over sys.argv[1:] (imports torch through the schema)."""
    from dettrain.tools.completion import handle

    if handle(sys.argv[1:]):  # -sc install=bash: dettrain's script (dettrain/tools/completion.py says why)
        return
    hydra_dir = _hydra_run_dir(sys.argv[1:])
    if hydra_dir not in (None, "."):  # refused before Hydra would create the directory
        print(f"dettrain: error: {RUN_DIR_REFUSED.format(dir=hydra_dir)}", file=sys.stderr)
        sys.exit(EXIT_USAGE)
    import hydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from dettrain.config import conf_dir, register

    register()
    global _task_started
    _task_started = False
    user_full = os.environ.get("HYDRA_FULL_ERROR")
    os.environ["HYDRA_FULL_ERROR"] = "1"  # run_and_report re-raises instead of printing and exiting 1
    try:
        hydra.main(version_base="1.3", config_path=str(conf_dir()), config_name="config")(_task)()
    except (HydraException, OmegaConfBaseException) as e:
        # composing failed before the task ran: bad overrides or YAML, the user's input.  After the task started
        # only an internal error gets here (the task turns every bad input into a UserError): keep its traceback
        if _task_started or user_full == "1":
            raise
        print(f"dettrain: error: {hydra_error_line(e)}", file=sys.stderr)
        sys.exit(EXIT_USAGE)
    finally:
        if user_full is None:
            os.environ.pop("HYDRA_FULL_ERROR", None)
        else:
            os.environ["HYDRA_FULL_ERROR"] = user_full


def main() -> None:
    if any(a in ("--help", "-h") for a in sys.argv[1:]):
        from dettrain.tools.keys import train_help

        sys.stdout.write(train_help("python -m dettrain"))
        return
    hydra_main()


if __name__ == "__main__":
    main()
