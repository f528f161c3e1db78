"""One command line: ``dettrain <command> [args]``, each command the ``main`` of one module.

    dettrain train [+exp=NAME] [key=value ...]     python -m dettrain (Hydra); under torchrun keep ``-m dettrain``
    dettrain diff RUN_A RUN_B                      python -m dettrain.diff
    dettrain trace RUN --step K [--ops]            python -m dettrain.trace
    dettrain verify | advise | audit ...           python -m dettrain.verify | advise | audit
    dettrain prepare FILES|DIRS --out tokens.bin   python -m dettrain.data prepare
    dettrain export RUN --out DIR                  python -m dettrain.export
    dettrain memory +exp=NAME --nproc N            python -m dettrain.memory
    dettrain checkpoint list|status RUN_DIR        python -m dettrain.checkpoint (to-torch RUN --out FILE too)
    dettrain panel --entity E --project P          python -m dettrain.panel

The tools' code is in dettrain/tools/ (``COMMANDS`` names each module); the ``python -m`` paths on the right are
the published ones and stay.

``dettrain train --help`` (and ``python -m dettrain --help``) prints every config key with its type, default and
documentation.  The documentation is the attribute docstring under each dataclass field, which Python does not keep
at runtime, so it is read from the source with ``ast``: printing help imports neither torch nor Hydra.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parent

# command -> (module, argv prefix, one-line summary); modules are imported only when their command runs
COMMANDS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "train": ("dettrain.__main__", (), "train (Hydra overrides: +exp=NAME key=value ...; --help lists every key)"),
    "diff": ("dettrain.tools.diff", (), "compare two runs step by step (exit 0 identical, 1 diverged, 2 bad input)"),
    "trace": ("dettrain.tools.trace", (), "replay one step with per-module/per-op fingerprints: which op diverged"),
    "verify": ("dettrain.tools.verify", (), "check that this machine and model reproduce bit for bit"),
    "advise": ("dettrain.tools.advise", (), "which tier and settings to use (the decision tree)"),
    "audit": ("dettrain.tools.audit", (), "audit the determinism settings of this process"),
    "prepare": ("dettrain.tools.prepare", ("prepare",),
                "tokenize text files or directories into a token file for data.path"),
    "export": ("dettrain.tools.export", (), "write a Hugging Face directory from a checkpoint (LLaMA, HF models)"),
    "memory": ("dettrain.tools.memory", (), "peak memory per rank of a config on N devices, estimated on one"),
    "checkpoint": ("dettrain.tools.checkpoint", (), "list a run's checkpoints, its status, or a to-torch file"),
    "panel": ("dettrain.tools.panel", (), "save a wandb workspace comparing the step hashes of a run group"),
}

# the schema: where each config dataclass lives (read as source, never imported here)
SCHEMA_MODULES = ("config", "models/llama", "models/custom", "data", "dist", "determinism", "loop/optim")


# ---- config documentation from the dataclasses' source ------------------------------------------------------
def _dataclasses() -> dict[str, ast.ClassDef]:
    found: dict[str, ast.ClassDef] = {}
    for mod in SCHEMA_MODULES:
        tree = ast.parse((PKG / f"{mod}.py").read_text(encoding="utf-8"))
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and any(
                    (d.id if isinstance(d, ast.Name) else d.attr if isinstance(d, ast.Attribute) else "") ==
                    "dataclass" for d in node.decorator_list):
                found[node.name] = node
    return found


def _factory(value: ast.expr | None) -> str | None:
    """X of ``field(default_factory=X)``."""
    if isinstance(value, ast.Call) and getattr(value.func, "id", None) == "field":
        for kw in value.keywords:
            if kw.arg == "default_factory":
                return ast.unparse(kw.value)
    return None


def config_keys(root: str = "Config", prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(dotted key, type, default, documentation) of every key under dataclass ``root``, in source order."""
    classes = _dataclasses()
    out: list[tuple[str, str, str, str]] = []

    def walk(cls: ast.ClassDef, pre: str) -> None:
        body = cls.body
        for i, stmt in enumerate(body):
            if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
                continue
            name = stmt.target.id
            nxt = body[i + 1] if i + 1 < len(body) else None
            doc = (inspect.cleandoc(nxt.value.value) if isinstance(nxt, ast.Expr) and isinstance(nxt.value,
                   ast.Constant) and isinstance(nxt.value.value, str) else "")
            fac = _factory(stmt.value)
            if fac in classes and name != "model":
                walk(classes[fac], f"{pre}{name}.")
                continue
            if name == "model":  # two schemas: dettrain's LLaMA presets and your own model
                out.append((f"{pre}model", "group", "tiny|125m|1b|7b",
                            "dettrain's LLaMA (ModelConfig, models/llama.py)"))
                walk(classes["ModelConfig"], f"{pre}model.")
                out.append((f"{pre}model", "group", "custom|hf_llama|hf_qwen2|hf_mistral", "your own model through "
                            "Hydra instantiate (CustomModelConfig, models/custom.py; docs/custom_models.md)"))
                walk(classes["CustomModelConfig"], f"{pre}model.")
                continue
            if name == "kwargs" and cls.name == "CustomModelConfig":
                out.append((f"{pre}<key>", "any", "", "Any other key: a keyword argument of the factory (declare it "
                            "in your YAML, or add it with +model.<key>=value)."))
                continue
            default = {"list": "[]", "dict": "{}"}.get(fac or "", fac) if fac else (
                ast.unparse(stmt.value) if stmt.value is not None else "(required)")
            out.append((f"{pre}{name}", ast.unparse(stmt.annotation), default, doc))

    walk(classes[root], prefix)
    return out


def conf_dir() -> Path | None:
    """The YAML directory without importing dettrain.config (which imports torch): installed or in a checkout."""
    for p in (PKG / "conf", PKG.parent / "conf"):
        if (p / "config.yaml").is_file():
            return p
    return None


def train_help(prog: str = "dettrain train") -> str:
    import textwrap

    lines = [f"usage: {prog} [--config-dir DIR] [+exp=NAME] [model=PRESET] [key=value ...]",
             "       torchrun --nproc-per-node=N -m dettrain [same arguments]", "",
             "Train with the structured config below.  Merge order: schema defaults -> conf/config.yaml (+ the model",
             "group) -> +exp=NAME (conf/exp/NAME.yaml or your --config-dir) -> key=value on the command line.",
             "'--cfg job' prints the composed values, '--hydra-help' Hydra's own options.", ""]
    conf = conf_dir()
    if conf is not None:
        for group in ("model", "exp"):
            names = sorted(p.stem for p in (conf / group).glob("*.yaml"))
            how = "model=NAME" if group == "model" else "+exp=NAME"
            lines.append(f"{how:<12} {', '.join(names)}")
        lines.append("")
    lines.append("config keys (type = default):")
    for key, typ, default, doc in config_keys():
        if typ == "group":
            lines += ["", f"{key}={default}: {doc}"]
            continue
        lines.append(f"  {key}: {typ}" + (f" = {default}" if default else ""))
        for para in (doc or "(undocumented)").split("\n\n"):
            lines += textwrap.wrap(" ".join(para.split()), width=112, initial_indent=" " * 6,
                                   subsequent_indent=" " * 6)
    return "\n".join(lines) + "\n"


# ---- dispatch -------------------------------------------------------------------------------------------------
def _usage() -> str:
    w = max(map(len, COMMANDS))
    rows = "\n".join(f"  {name:<{w}}  {summary}" for name, (_, _, summary) in COMMANDS.items())
    return (f"usage: dettrain <command> [args]   (dettrain <command> --help for its options)\n\n"
            f"Reproducible distributed training: runs repeat bit for bit and diff step by step.\n\ncommands:\n{rows}\n")


def run_train(argv: list[str], prog: str = "dettrain train") -> int:
    """``python -m dettrain``: our help for --help/-h, else Hydra's main with these arguments."""
    if any(a in ("--help", "-h") for a in argv):
        sys.stdout.write(train_help(prog))
        return 0
    from dettrain.__main__ import hydra_main

    old = sys.argv
    sys.argv = [prog, *argv]  # Hydra parses sys.argv
    try:
        hydra_main()
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv = old
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        sys.stdout.write(_usage())
        return 0 if argv else 2
    if argv[0] == "--version":
        from dettrain import __version__

        print(f"dettrain {__version__}")
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd not in COMMANDS:
        sys.stderr.write(f"dettrain: unknown command {cmd!r}\n\n{_usage()}")
        return 2
    if cmd == "train":
        return run_train(rest)
    module, prefix, _ = COMMANDS[cmd]
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module:
            raise  # a dependency of the module is missing: its own traceback says which
        sys.stderr.write(f"dettrain {cmd}: this installation has no {module} (python -m {module} is not available "
                         f"here); update dettrain\n")
        return 2
    rc = mod.main([*prefix, *rest])
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
