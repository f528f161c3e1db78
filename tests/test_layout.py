"""The package layout keeps its promises: no import cycles, tools depend on the library and never the reverse, one
Triton guard (dettrain/kernels/_triton.py), every cited repo file exists, and every published ``python -m
dettrain.<tool>`` path still runs.  The checks read the source (ast, tokenize) and import nothing, except two that
run subprocesses: the kernels without Triton, and ``python -m ... --help`` of each published path."""

from __future__ import annotations

import ast
import io
import re
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest
from conftest import REPO

PKG = REPO / "dettrain"
TRITON_GUARD = "dettrain.kernels._triton"
# python -m paths published in README.md / docs / tests, and the module that holds each tool's code
PUBLISHED = {"dettrain.diff": "dettrain.tools.diff", "dettrain.verify": "dettrain.tools.verify",
             "dettrain.advise": "dettrain.tools.advise", "dettrain.audit": "dettrain.tools.audit",
             "dettrain.export": "dettrain.tools.export", "dettrain.memory": "dettrain.tools.memory",
             "dettrain.panel": "dettrain.tools.panel", "dettrain.trace": "dettrain.tools.trace"}
# entry points, allowed to import the tools: the dispatcher, and the thin modules at the published paths
ENTRY_POINTS = {"dettrain.cli", "dettrain.__main__", *PUBLISHED}


def _modules() -> dict[str, Path]:
    """Dotted name -> file of every module under dettrain/ (a package is its __init__.py)."""
    out = {}
    for f in sorted(PKG.rglob("*.py")):
        parts = f.relative_to(REPO).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


MODULES = _modules()


def _is_main_guard(node: ast.AST) -> bool:
    """``if __name__ == "__main__":`` (runs only when the module is run as a script, never on import)."""
    t = node.test if isinstance(node, ast.If) else None
    return (isinstance(t, ast.Compare) and isinstance(t.left, ast.Name) and t.left.id == "__name__"
            and len(t.comparators) == 1 and isinstance(t.comparators[0], ast.Constant)
            and t.comparators[0].value == "__main__")


def _is_type_checking(node: ast.AST) -> bool:
    t = node.test if isinstance(node, ast.If) else None
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imports(tree: ast.Module, *, top_level: bool, main_guard: bool = True):
    """Import nodes of a module.  ``top_level``: only those that run on import (module and class bodies, their
    if/try/with blocks; not function bodies, ``if TYPE_CHECKING:`` or, unless ``main_guard``, the
    ``if __name__ == "__main__":`` block)."""
    def walk(nodes, in_main):
        for n in nodes:
            if isinstance(n, (ast.Import, ast.ImportFrom)):
                yield n, in_main
            elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                if not top_level:
                    yield from walk(ast.iter_child_nodes(n), in_main)
            elif top_level and _is_type_checking(n):
                continue
            elif _is_main_guard(n):
                if main_guard:
                    yield from walk(n.body, True)
                yield from walk(n.orelse, in_main)
            else:
                yield from walk(ast.iter_child_nodes(n), in_main)

    return list(walk(tree.body, False))


def _targets(name: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The dettrain modules an import statement in module ``name`` imports (a name imported from a package that
    is a submodule counts as that submodule)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name == "dettrain" or a.name.startswith("dettrain.")]
    if node.level:  # relative: resolved against the importer's package
        pkg = name.split(".") if MODULES[name].name == "__init__.py" else name.split(".")[:-1]
        base = ".".join(pkg[: len(pkg) - node.level + 1] + ([node.module] if node.module else []))
    else:
        base = node.module or ""
    if base != "dettrain" and not base.startswith("dettrain."):
        return []
    subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in MODULES]
    return subs + ([base] if len(subs) < len(node.names) else [])


def _graph() -> dict[str, set[str]]:
    """Module -> modules it imports when it is imported (top level), with the packages each import initialises."""
    graph: dict[str, set[str]] = {}
    for name, f in MODULES.items():
        own = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}  # initialised before it runs
        edges: set[str] = set()
        for node, _ in _imports(ast.parse(f.read_text(encoding="utf-8")), top_level=True, main_guard=False):
            for t in _targets(name, node):
                parts = t.split(".")
                edges |= {m for m in (".".join(parts[:i]) for i in range(1, len(parts) + 1))
                          if m in MODULES and m not in own and m != name}
        graph[name] = edges
    return graph


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for t in sorted(graph.get(m, ())):
            if state.get(t) == 1:
                return stack[stack.index(t):] + [t]
            if t not in state:
                found = visit(t)
                if found:
                    return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_no_import_cycles_at_module_level():
    graph = _graph()
    assert "dettrain.kernels.batch_invariant" in graph["dettrain.models.llama"]  # the graph sees `from pkg import mod`
    assert "dettrain.kernels._triton" in graph["dettrain.kernels"]
    cycle = _find_cycle(graph)
    assert cycle is None, "import cycle at module level: " + " -> ".join(cycle)


def _tool_references(name: str, tree: ast.Module) -> list[tuple[int, str]]:
    """(line, target) of every import of dettrain.tools outside ``if __name__ == "__main__":``, and of every
    importlib.import_module / __import__ call with a literal dettrain.tools name."""
    out = [(n.lineno, t) for n, in_main in _imports(tree, top_level=False) if not in_main
           for t in _targets(name, n)
           if t == "dettrain.tools" or t.startswith("dettrain.tools.")]
    for n in ast.walk(tree):
        if (isinstance(n, ast.Call) and n.args and isinstance(n.args[0], ast.Constant)
                and isinstance(n.args[0].value, str) and n.args[0].value.startswith("dettrain.tools")
                and (getattr(n.func, "attr", None) == "import_module" or getattr(n.func, "id", None) in
                     ("import_module", "__import__"))):
            out.append((n.lineno, n.args[0].value))
    return out


def test_library_never_imports_the_tools():
    library = [m for m in MODULES if m not in ENTRY_POINTS and m != "dettrain.tools"
               and not m.startswith("dettrain.tools.")]
    assert "dettrain.data" in library and "dettrain.record.reference" in library and "dettrain.kernels" in library
    bad = [f"{MODULES[m].relative_to(REPO)}:{line}: {t}" for m in library
           for line, t in _tool_references(m, ast.parse(MODULES[m].read_text(encoding="utf-8")))]
    assert not bad, "library modules import dettrain.tools (tools depend on the library, never the reverse):\n" + \
        "\n".join(bad)


def test_published_tool_paths_are_thin_modules():
    """Each old path only re-exports its tool and runs its main: no code of its own to drift."""
    for old, new in PUBLISHED.items():
        tree = ast.parse(MODULES[old].read_text(encoding="utf-8"))
        assert ast.get_docstring(tree) and new.replace(".", "/") + ".py" in ast.get_docstring(tree), old
        assert any(_is_main_guard(n) for n in tree.body), f"{old} does not run main() as __main__"
        for n in tree.body[1:]:
            if isinstance(n, ast.ImportFrom):
                assert n.module == new, (old, ast.unparse(n))
            else:
                assert _is_main_guard(n) and ast.unparse(n.body[0]) == "raise SystemExit(main())", (old, ast.unparse(n))
        tool = ast.parse(MODULES[new].read_text(encoding="utf-8"))
        assert any(isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in n.targets)
                   for n in tool.body), f"{new} declares no __all__ (what {old} re-exports)"


def _triton_imports(tree: ast.Module) -> list[int]:
    lines = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Import) and any(a.name == "triton" or a.name.startswith("triton.") for a in n.names):
            lines.append(n.lineno)
        elif isinstance(n, ast.ImportFrom) and not n.level and (n.module or "").split(".")[0] == "triton":
            lines.append(n.lineno)
    return lines


def test_one_triton_guard():
    guard = MODULES[TRITON_GUARD]
    tree = ast.parse(guard.read_text(encoding="utf-8"))
    tries = [n for n in tree.body if isinstance(n, ast.Try) and _triton_imports(ast.Module(body=n.body,
                                                                                         type_ignores=[]))]
    assert tries and any(any(isinstance(h.type, ast.Name) and h.type.id == "ImportError" for h in t.handlers)
                         for t in tries), "the guard must try `import triton` and catch ImportError"
    bad = [f"{f.relative_to(REPO)}:{line}" for m, f in MODULES.items() if m != TRITON_GUARD
           for line in _triton_imports(ast.parse(f.read_text(encoding="utf-8")))]
    assert not bad, f"only {guard.relative_to(REPO)} imports triton; use its HAVE_TRITON/triton/tl instead:\n" + \
        "\n".join(bad)


def test_kernels_import_without_triton():
    """With triton made unimportable (as on a CPU install), every kernels module imports and reports why."""
    mods = sorted(m for m in MODULES if m.startswith("dettrain.kernels"))
    code = ("import sys; sys.modules['triton'] = None; sys.modules['triton.language'] = None\n"
            f"import importlib; [importlib.import_module(m) for m in {mods!r}]\n"
            "from dettrain.kernels import HAVE_TRITON, unavailable_reason\n"
            "assert not HAVE_TRITON and 'Triton is not importable' in unavailable_reason(), unavailable_reason()\n"
            "import torch\n"
            "from dettrain.kernels.optim import adamw_\n"
            "p, g, m, v = (torch.ones(5) for _ in range(4))\n"
            "adamw_(p, g, m, v, beta1=0.9, beta2=0.99, lr=0.1, weight_decay=0.0, eps=1e-8, step=1)\n"
            "print('ok')\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-3000:]


def test_every_subpackage_is_installed():
    """pyproject lists packages explicitly: a new subpackage missing there would be absent from a wheel."""
    listed = re.search(r"^packages\s*=\s*\[(.*?)\]", (REPO / "pyproject.toml").read_text(), re.M | re.S)
    assert listed
    names = set(re.findall(r'"([\w.]+)"', listed.group(1)))
    pkgs = {m for m, f in MODULES.items() if f.name == "__init__.py"}
    assert pkgs <= names, f"packages missing from pyproject.toml: {sorted(pkgs - names)}"


# ---- cited files exist --------------------------------------------------------------------------------------
SCANNED = ("dettrain", "bench", "examples", "tests")
_CITE = re.compile(r"(?<![\w./-])((?:docs|bench|tests|examples|dettrain|\.ci|conf|launch|slurm)/[\w./*<>{}-]*"
                   r"|[A-Z][A-Z_]*\.md)")


def _prose(f: Path) -> list[tuple[int, str]]:
    """(line, text) of every comment and docstring (any string statement) of a Python file; of a shell script,
    its comment lines."""
    text = f.read_text(encoding="utf-8")
    if f.suffix != ".py":
        return [(i, ln) for i, ln in enumerate(text.splitlines(), 1) if ln.lstrip().startswith("#")]
    out = [(t.start[0], t.string) for t in tokenize.generate_tokens(io.StringIO(text).readline)
           if t.type == tokenize.COMMENT]
    out += [(n.lineno, n.value.value) for n in ast.walk(ast.parse(text)) if isinstance(n, ast.Expr)
            and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)]
    return out


def _citations(text: str) -> list[tuple[str, int]]:
    """(cited path, line offset in ``text``) of every repo path cited in ``text``."""
    out = []
    for m in _CITE.finditer(text):
        c = m.group(1).rstrip(".,:;)")
        placeholder = any(ch in c for ch in "*<>{}") or "..." in c or "/" in c and any(
            re.fullmatch(r"[A-Z][A-Z_]*(\.\w+)?", part) for part in c.split("/"))  # glob, <x>, conf/exp/NAME.yaml
        if not placeholder:
            out.append((c, text.count("\n", 0, m.start())))
    return out


def _scanned_files() -> list[Path]:
    return sorted(f for d in SCANNED for f in (REPO / d).rglob("*") if f.suffix in (".py", ".sh") and f.is_file())


def test_citations_name_existing_files():
    cited, bad = 0, []
    for f in _scanned_files():
        for line, text in _prose(f):
            for c, offset in _citations(text):
                cited += 1
                if not (REPO / c).exists():
                    bad.append(f"{f.relative_to(REPO)}:{line + offset}: {c}")
    assert cited > 30  # the scan finds the citations that are there
    assert not bad, "docstrings/comments cite files that are not in the repo:\n" + "\n".join(bad)


def test_bare_module_file_names_exist():
    """A module file named in the prose, bare or with some of its directories, is a file of this repo: the old name
    of a moved module fails here.  Files of torch or Triton are cited with their ``torch/`` or ``triton/`` path."""
    files = {p.relative_to(REPO).as_posix() for p in REPO.rglob("*.py") if ".git" not in p.parts}
    names = {Path(p).name for p in files}
    bad = []
    for f in _scanned_files():
        for line, text in _prose(f):
            for m in re.finditer(r"(?<![\w./-])((?:\w+/)*\w+\.py)\b", text):
                c, line_at = m.group(1), line + text.count("\n", 0, m.start())
                ok = (c in names if "/" not in c else any(p == c or p.endswith("/" + c) for p in files))
                if not ok and not c.startswith(("torch/", "triton/")):
                    bad.append(f"{f.relative_to(REPO)}:{line_at}: {c}")
    assert not bad, "docstrings/comments name .py files that are not in the repo:\n" + "\n".join(bad)


# ---- published entry points -----------------------------------------------------------------------------------
@pytest.mark.parametrize("argv", [[m] for m in PUBLISHED] + [["dettrain.data", "prepare"]],
                         ids=[*(m.split(".")[1] for m in PUBLISHED), "data-prepare"])
def test_published_python_m_paths_still_run(argv):
    p = subprocess.run([sys.executable, "-m", *argv, "--help"], cwd=REPO, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.startswith(f"usage: python -m {' '.join(argv)}"), p.stdout[:200]
