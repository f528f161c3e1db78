"""The package layout keeps its promises: no import cycles (counting imports inside functions), tools depend on the
library and never the reverse, record/, checkpoint/, config.py and the gradient-sync package never import the loop
(but for the imports listed in LOOP_IMPORTS_LEFT), one Triton guard (dettrain/kernels/_triton.py), every cited repo
file exists, the command list is written once (dettrain/tools/__init__.py's ``COMMAND_TABLE``) and every published
``python -m dettrain.<tool>`` path still runs.  The checks read the source (ast, tokenize) and import nothing, except
two that run subprocesses: the kernels without Triton, and ``python -m ... --help`` of each published path."""

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


def _modules() -> dict[str, Path]:
    """Dotted name -> file of every module under dettrain/ (a package is its __init__.py)."""
    out = {}
    for f in sorted(PKG.rglob("*.py")):
        parts = f.relative_to(REPO).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


MODULES = _modules()


def _command_table() -> list[tuple[str, str, str, str]]:
    """dettrain/tools/__init__.py's COMMAND_TABLE, read as a literal from the source (nothing imported)."""
    tree = ast.parse(MODULES["dettrain.tools"].read_text(encoding="utf-8"))
    for n in tree.body:
        target = n.target if isinstance(n, ast.AnnAssign) else n.targets[0] if isinstance(n, ast.Assign) else None
        if getattr(target, "id", None) == "COMMAND_TABLE":
            return [tuple(row) for row in ast.literal_eval(n.value)]
    raise AssertionError("dettrain/tools/__init__.py defines no COMMAND_TABLE")


COMMAND_TABLE = _command_table()


def _runner(published: str) -> str:
    """The module ``python -m <published>`` runs: the module itself, or the package's __main__."""
    mod = published.split()[0]
    return f"{mod}.__main__" if MODULES[mod].name == "__init__.py" else mod


# published python -m path (with its leading arguments) -> the tool module holding the code, for every tool
PUBLISHED = {published: module for _, module, published, _ in COMMAND_TABLE if module.startswith("dettrain.tools.")}
# entry points, allowed to import the tools: the dispatcher, `python -m dettrain`, and the thin modules at the
# published paths
ENTRY_POINTS = {"dettrain.cli", "dettrain.__main__", *(_runner(p) for p in PUBLISHED)}


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


def _imports(tree: ast.Module, *, top_level: bool, main_guard: bool = True, type_checking: bool | None = None):
    """Import nodes of a module, with whether each sits in the ``if __name__ == "__main__":`` block.
    ``top_level``: only those that run on import (module and class bodies, their if/try/with blocks; not function
    bodies).  ``main_guard``: with the ``if __name__ == "__main__":`` block.  ``type_checking``: with the
    ``if TYPE_CHECKING:`` blocks (default: unless ``top_level``)."""
    if type_checking is None:
        type_checking = not top_level

    def walk(nodes, in_main):
        for n in nodes:
            if isinstance(n, (ast.Import, ast.ImportFrom)):
                yield n, in_main
            elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                if not top_level:
                    yield from walk(ast.iter_child_nodes(n), in_main)
            elif not type_checking and _is_type_checking(n):
                continue
            elif _is_main_guard(n):
                if main_guard:
                    yield from walk(n.body, True)
                yield from walk(n.orelse, in_main)
            else:
                yield from walk(ast.iter_child_nodes(n), in_main)

    return list(walk(tree.body, False))


def _base(name: str, node: ast.ImportFrom) -> str:
    """The module a ``from ... import`` statement in module ``name`` imports from (a relative one resolved against
    the importer's package)."""
    if not node.level:
        return node.module or ""
    pkg = name.split(".") if MODULES[name].name == "__init__.py" else name.split(".")[:-1]
    return ".".join(pkg[: len(pkg) - node.level + 1] + ([node.module] if node.module else []))


def _reexports() -> dict[str, dict[str, str]]:
    """Package -> {name its __init__.py imports at the top from one of its own modules: that module}."""
    out: dict[str, dict[str, str]] = {}
    for pkg, f in MODULES.items():
        if f.name == "__init__.py":
            for node, _ in _imports(ast.parse(f.read_text(encoding="utf-8")), top_level=True):
                base = _base(pkg, node) if isinstance(node, ast.ImportFrom) else ""
                if base.startswith(pkg + ".") and base in MODULES:
                    out.setdefault(pkg, {}).update({a.asname or a.name: base for a in node.names})
    return out


REEXPORTS = _reexports()


def _targets(name: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The dettrain modules an import statement in module ``name`` imports: a name imported from a package that
    is a submodule counts as that submodule, and one the package's __init__.py re-exports from its own module as
    that module too (so ``from dettrain.data import prepare`` inside dettrain/data/tokens.py ties tokens.py to
    tokenize.py, the module that defines it)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name == "dettrain" or a.name.startswith("dettrain.")]
    base = _base(name, node)
    if base != "dettrain" and not base.startswith("dettrain."):
        return []
    subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in MODULES]
    defined = [REEXPORTS[base][a.name] for a in node.names if a.name in REEXPORTS.get(base, {})]
    return subs + defined + ([base] if len(subs) < len(node.names) else [])


def _graph(*, inside_functions: bool = False) -> dict[str, dict[str, int]]:
    """Module -> {module it imports: line of the first such import}, with the packages each import initialises.
    By default the imports that run when the module is imported (top level); ``inside_functions``: every import
    that can run at all (function bodies and the ``if __name__ == "__main__":`` block too; ``if TYPE_CHECKING:``
    blocks never run and are left out)."""
    graph: dict[str, dict[str, int]] = {}
    for name, f in MODULES.items():
        own = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}  # initialised before it runs
        edges: dict[str, int] = {}
        tree = ast.parse(f.read_text(encoding="utf-8"))
        for node, _ in _imports(tree, top_level=not inside_functions, main_guard=inside_functions,
                                type_checking=False):
            for t in _targets(name, node):
                parts = t.split(".")
                for m in (".".join(parts[:i]) for i in range(1, len(parts) + 1)):
                    if m in MODULES and m not in own and m != name:
                        edges[m] = min(edges.get(m, node.lineno), node.lineno)
        graph[name] = edges
    return graph


def _cycle_text(graph: dict[str, dict[str, int]], cycle: list[str]) -> str:
    """Each module of ``cycle`` with the file and line of its import of the next one."""
    return " -> ".join(f"{a} ({MODULES[a].relative_to(REPO)}:{graph[a][b]})" for a, b in zip(cycle, cycle[1:])) \
        + f" -> {cycle[-1]}"


def _cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Every import cycle, one per strongly connected component of more than one module (Tarjan's algorithm): a
    path through the component from its first module back to it, so each cycle is named once however many loops
    it holds."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components: list[set[str]] = []

    def connect(m: str) -> None:
        index[m] = low[m] = len(index)
        stack.append(m)
        for t in sorted(graph.get(m, ())):
            if t not in index:
                connect(t)
                low[m] = min(low[m], low[t])
            elif t in stack:
                low[m] = min(low[m], index[t])
        if low[m] == index[m]:  # m is the root of a component: pop it
            comp = set()
            while m not in comp:
                comp.add(stack.pop())
            if len(comp) > 1:
                components.append(comp)

    for m in sorted(graph):
        if m not in index:
            connect(m)
    return [_path_back(graph, comp) for comp in sorted(components, key=min)]


def _path_back(graph: dict[str, dict[str, int]], comp: set[str]) -> list[str]:
    """A shortest import path inside ``comp`` from its first module back to itself (breadth first)."""
    start = min(comp)
    came: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for m in frontier:
            for t in sorted(graph[m]):
                if t == start:
                    path = [m]
                    while path[-1] != start:
                        path.append(came[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if t in comp and t not in came:
                    came[t] = m
                    nxt.append(t)
        frontier = nxt
    raise AssertionError(f"{sorted(comp)} is no cycle")


def _cycles_text(graph: dict[str, dict[str, int]], cycles: list[list[str]]) -> str:
    return f"{len(cycles)} import cycle(s):\n" + "\n".join(_cycle_text(graph, c) for c in cycles)


def test_no_import_cycles_at_module_level():
    graph = _graph()
    assert "dettrain.kernels.batch_invariant" in graph["dettrain.models.llama"]  # the graph sees `from pkg import mod`
    assert "dettrain.kernels._triton" in graph["dettrain.kernels"]
    cycles = _cycles(graph)
    assert not cycles, "at module level, " + _cycles_text(graph, cycles)


def test_no_import_cycles_counting_imports_inside_functions():
    """An import inside a function (or under ``if __name__ == "__main__":``) still ties its module to the one it
    imports: a cycle through one means neither module can be understood, tested or moved without the other.  Break
    one by moving the shared piece to the lower module or a new small one, never by moving the import somewhere
    this scan does not look.  Imports under ``if TYPE_CHECKING:`` do not count: they never run, and an annotation
    names a type without needing its module to be importable first."""
    graph = _graph(inside_functions=True)
    assert "dettrain.models.custom" in graph["dettrain.models.llama"]  # build_model's import inside the function
    assert "dettrain.tools.checkpoint" in graph["dettrain.checkpoint.__main__"]  # the __main__ block's import
    assert "dettrain.sync.engines" not in graph["dettrain.checkpoint.state"]  # only under TYPE_CHECKING there
    assert "dettrain.data.tokens" in graph["dettrain.data.sampler"]  # the package's modules are nodes of their own
    cycles = _cycles(graph)
    assert not cycles, "counting imports inside functions, " + _cycles_text(graph, cycles)


def test_the_cycle_finder_names_every_cycle():
    """The finder itself: two separate cycles (one through a package) are both named, each once, and an import
    that only leads into a cycle is no cycle of its own."""
    graph = {"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3, "d": 4}, "d": {}, "e": {"a": 5},
             "p": {"p.x": 6}, "p.x": {"q": 7}, "q": {"p": 8}}
    assert _cycles(graph) == [["a", "b", "c", "a"], ["p", "p.x", "q", "p"]]
    assert _cycles({"a": {"b": 1}, "b": {}, "c": {"a": 2}}) == []


BELOW_THE_LOOP = ("dettrain.record", "dettrain.checkpoint", "dettrain.config", "dettrain.signals", "dettrain.sync")
"""Modules the loop builds on: they import nothing from dettrain.loop (the loop imports them).  ``dettrain.sync`` is
the gradient-sync package: engines, collectives, offload, FSDP wiring, the optimizer."""
LOOP_IMPORTS_LEFT: dict[tuple[str, str], str] = {}
"""The imports that still break the rule, each with what it is for: the list can only shrink (a new one fails, and
so does an entry whose import is gone)."""


def test_record_checkpoint_config_and_sync_import_nothing_from_the_loop():
    graph = _graph(inside_functions=True)  # ``if TYPE_CHECKING:`` imports never run: not counted
    assert "dettrain.dist" in graph["dettrain.record.fingerprint"]  # the scan sees function imports
    below = [m for m in graph if any(m == b or m.startswith(b + ".") for b in BELOW_THE_LOOP)]
    assert {"dettrain.config", "dettrain.record.ledger", "dettrain.checkpoint.state"} <= set(below)
    if (PKG / "sync").is_dir():
        assert any(m.startswith("dettrain.sync.") for m in below), "dettrain/sync/'s modules are not scanned"
    found = {(m, t) for m in below for t in graph[m] if t.startswith("dettrain.loop.")}
    found |= {(m, "dettrain.loop") for m in below if "dettrain.loop" in graph[m]
              and not any(t.startswith("dettrain.loop.") for t in graph[m])}
    new = [f"{MODULES[m].relative_to(REPO)}:{graph[m][t]}: {t}" for m, t in sorted(found - set(LOOP_IMPORTS_LEFT))]
    assert not new, "record/, checkpoint/, config.py, signals.py and sync/ import nothing from dettrain.loop (move " \
        "the shared piece below the loop):\n" + "\n".join(new)
    gone = sorted(set(LOOP_IMPORTS_LEFT) - found)
    assert not gone, f"no longer imported, drop from LOOP_IMPORTS_LEFT: {gone}"


def test_the_bottom_modules_import_what_they_say():
    """errors.py imports nothing of dettrain and tiers.py only errors.py (every module may use them); signals.py
    imports nothing of dettrain and, on import, not torch: ``python -m dettrain`` installs its early signal flag
    before torch loads."""
    graph = _graph(inside_functions=True)
    assert graph["dettrain.errors"] == {}
    assert set(graph["dettrain.tiers"]) == {"dettrain.errors"}
    assert graph["dettrain.signals"] == {}
    top = _imports(ast.parse(MODULES["dettrain.signals"].read_text(encoding="utf-8")), top_level=True)
    names = {a.name.split(".")[0] for n, _ in top for a in n.names} | {
        (n.module or "").split(".")[0] for n, _ in top if isinstance(n, ast.ImportFrom)}
    assert "torch" not in names, names


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


def test_command_table_is_the_one_list():
    """Every command has a module with a main; every module at the top level or a package's __main__.py that runs
    a tool is a published path of the table (a thin module nobody lists would be a second, drifting list)."""
    commands = [c for c, _, _, _ in COMMAND_TABLE]
    assert len(commands) == len(set(commands)) and {"train", "diff", "prepare", "checkpoint"} <= set(commands)
    for command, module, published, summary in COMMAND_TABLE:
        assert module in MODULES and summary, command
        assert any(isinstance(n, ast.FunctionDef) and n.name == "main"
                   for n in ast.parse(MODULES[module].read_text(encoding="utf-8")).body), f"{module} has no main()"
        assert published.split()[0] in MODULES, (command, published)
    runners = {_runner(p) for p in PUBLISHED}
    tool_runners = {m for m in MODULES if (m.count(".") == 1 or m.endswith(".__main__"))
                    and m not in ("dettrain.cli", "dettrain.__main__") and not m.startswith("dettrain.tools")
                    and any(t.startswith("dettrain.tools.") for n, _ in _imports(ast.parse(MODULES[m].read_text(
                        encoding="utf-8")), top_level=False) for t in _targets(m, n))}
    assert tool_runners == runners, f"thin modules not in COMMAND_TABLE: {sorted(tool_runners - runners)}; " \
        f"published paths without one: {sorted(runners - tool_runners)}"


def test_published_tool_paths_are_thin_modules():
    """Each published path only imports its tool and runs its main: no code of its own to drift.  A top-level
    ``dettrain/<tool>.py`` also re-exports the tool's ``__all__`` (``import dettrain.diff`` keeps its names); a
    package's ``__main__.py`` (never imported by the package) may import the tool under its ``__main__`` guard."""
    for published, new in PUBLISHED.items():
        old = _runner(published)
        tree = ast.parse(MODULES[old].read_text(encoding="utf-8"))
        assert ast.get_docstring(tree) and new.replace(".", "/") + ".py" in ast.get_docstring(tree), old
        guards = [n for n in tree.body if _is_main_guard(n)]
        assert len(guards) == 1, f"{old} does not run main() as __main__"
        for n in [*tree.body[1:], *guards[0].body]:
            if isinstance(n, ast.ImportFrom):
                assert n.module == new, (old, ast.unparse(n))
            elif isinstance(n, ast.Import):
                assert [a.name for a in n.names] == ["sys"], (old, ast.unparse(n))
            elif n is not guards[0]:
                assert n is guards[0].body[-1] and ast.unparse(n) in ("raise SystemExit(main())", "sys.exit(main())"), \
                    (old, ast.unparse(n))
        if not old.endswith(".__main__"):
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
@pytest.mark.parametrize("argv", [p.split() for p in PUBLISHED], ids=[p.split()[-1].split(".")[-1] for p in PUBLISHED])
def test_published_python_m_paths_still_run(argv):
    p = subprocess.run([sys.executable, "-m", *argv, "--help"], cwd=REPO, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.startswith(f"usage: python -m {' '.join(argv)}"), p.stdout[:200]
