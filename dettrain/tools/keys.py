"""The config key reference: every key of the schema with its type, default and documentation, for ``dettrain
train --help`` / ``python -m dettrain --help`` (``train_help``) and the hints of dettrain/__main__.py's error lines
(``config_keys``).

The documentation is the attribute docstring under each dataclass field, which Python does not keep at runtime, so
it is read from the source with ``ast``: printing help imports neither torch nor Hydra.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent  # dettrain/

__all__ = ["SCHEMA_MODULES", "conf_dir", "config_keys", "train_help"]

# the schema: where each config dataclass lives (read as source, never imported here)
SCHEMA_MODULES = ("config", "models/llama", "models/custom", "data/tokens", "dist", "determinism", "sync/optim")


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
