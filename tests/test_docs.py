"""The Markdown documentation stands alone and names only what exists: every repository path, linked or in the
text, is a file or directory of this repository; no file of the repository cites a note that lives outside it (an
upper-case ``<NAME>.md`` that is not one of its files); module file names and ``dettrain.<module>`` names left from
an old layout fail.
Links to a heading find it, and every training command line the docs show composes and passes start-up
validation.  The checks read the files (``tests/test_layout.py`` does the same for the Python prose); only the last
imports dettrain, to compose the documented command lines with Hydra."""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

from conftest import REPO

# the Markdown every newcomer reads, and must find: a file missing here is a broken link in itself
REQUIRED = ("README.md", "BENCHMARKS.md", "slurm/README.md", "docs/architecture.md")


def _tracked() -> list[str]:
    """The repository's files as git lists them (tracked, and untracked ones not ignored: a new file counts)."""
    p = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    if p.returncode != 0:  # not a git checkout (an unpacked sdist): every file under the root
        return sorted(f.relative_to(REPO).as_posix() for f in REPO.rglob("*") if f.is_file() and ".git" not in f.parts)
    return sorted(set(p.stdout.splitlines()))


TRACKED = _tracked()
NOTES = {Path(rel).name for rel in TRACKED}  # the file names a note may have: those of the repository
MARKDOWN = [REPO / f for f in TRACKED if f.endswith(".md") and (REPO / f).is_file()]
PY_FILES = {f for f in TRACKED if f.endswith(".py")}

# a path of the repository named in the text: it starts with one of the top-level folders, or is a root Markdown file
_CITE = re.compile(r"(?<![\w./-])((?:docs|bench|tests|examples|dettrain|conf|launch|slurm)/[\w./*<>{}-]*"
                   r"|[A-Z][A-Z_]*\.md)")
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# an upper-case Markdown note named anywhere (README.md, BENCHMARKS.md): it must be a file of the repository; a
# doc states a fact kept in a note outside it, with its measurement, instead of citing the note
_NOTE = re.compile(r"(?<![\w./-])([A-Z][A-Z_]*\.md)\b")


def _is_placeholder(c: str) -> bool:
    """A glob, a ``<name>``, ``...``, or a path with a capitalised placeholder part (``conf/exp/NAME.yaml``)."""
    return (any(ch in c for ch in "*<>{}") or "..." in c
            or any(re.fullmatch(r"[A-Z][A-Z_]*(\.\w+)?", part) for part in c.split("/")[1:]))


def _text_citations(text: str) -> list[tuple[int, str]]:
    """(line, path) of every repository path in the text, relative to the repository root."""
    out = []
    for m in _CITE.finditer(text):
        c = m.group(1).rstrip(".,:;)'\"`")
        if c and not _is_placeholder(c):
            out.append((text.count("\n", 0, m.start()) + 1, c))
    return out


def _link_citations(f: Path, text: str) -> list[tuple[int, str]]:
    """(line, path relative to the root) of every relative Markdown link, resolved against the file's folder."""
    out = []
    for m in _LINK.finditer(text):
        target = m.group(1).split("#", 1)[0]
        if not target or re.match(r"[a-z][a-z0-9+.-]*:", target):  # an anchor in the same page, or a URL
            continue
        resolved = (f.parent / target).resolve()
        rel = resolved.relative_to(REPO).as_posix() if resolved.is_relative_to(REPO) else "../" + target
        out.append((text.count("\n", 0, m.start()) + 1, rel))
    return out


def test_the_docs_are_there():
    have = {f.relative_to(REPO).as_posix() for f in MARKDOWN}
    assert set(REQUIRED) <= have, f"missing: {sorted(set(REQUIRED) - have)}"
    assert any(f.startswith("docs/") for f in have)


def test_markdown_cites_only_files_of_the_repository():
    cited, bad = 0, []
    for f in MARKDOWN:
        text = f.read_text(encoding="utf-8")
        for line, c in _text_citations(text) + _link_citations(f, text):
            cited += 1
            if c.startswith("../") or not (REPO / c).exists():
                bad.append(f"{f.relative_to(REPO)}:{line}: {c}")
    assert cited > 100  # the scan finds the citations that are there
    assert not bad, "Markdown cites paths that are not in the repository:\n" + "\n".join(bad)


def test_nothing_in_the_repository_cites_the_notes_outside_it():
    """A note that is not a file of the repository (an upper-case ``<NAME>.md`` that no tracked file is called) says
    nothing to a reader of the repository alone: no doc, docstring or comment may lean on one."""
    bad = []
    for rel in TRACKED:
        f = REPO / rel
        if rel == "tests/test_docs.py" or not f.is_file() or f.suffix not in (".md", ".py", ".sh", ".yaml", ".toml",
                                                                               ".sbatch", ".txt", ".cfg", ""):
            continue
        try:
            text = f.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for m in _NOTE.finditer(text):
            if m.group(1) in NOTES:
                continue
            bad.append(f"{rel}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)}")
    assert not bad, "files cite notes outside the repository (state the fact and its measurement instead):\n" + \
        "\n".join(bad)


def _slugs(md: Path) -> set[str]:
    """The anchors GitHub gives the headings of a Markdown file: lower case, punctuation but ``-`` and ``_``
    dropped, spaces to hyphens; a repeated heading gets ``-1``, ``-2`` ...  Headings inside code blocks are not
    headings."""
    out: set[str] = set()
    fenced = False
    for line in md.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        m = None if fenced else re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            n, base = 0, slug
            while slug in out:
                n += 1
                slug = f"{base}-{n}"
            out.add(slug)
    return out


def test_links_to_a_heading_find_it():
    """``[x](page.md#anchor)`` and ``[x](#anchor)``: the page has that heading (a renamed heading breaks links)."""
    checked, bad = 0, []
    for f in MARKDOWN:
        text = f.read_text(encoding="utf-8")
        for m in _LINK.finditer(text):
            target, _, frag = m.group(1).partition("#")
            if not frag or re.match(r"[a-z][a-z0-9+.-]*:", target):
                continue
            page = (f.parent / target).resolve() if target else f
            if page.suffix != ".md" or not page.is_file():
                continue  # a missing file is test_markdown_cites_only_files_of_the_repository's finding
            checked += 1
            if frag not in _slugs(page):
                bad.append(f"{f.relative_to(REPO)}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(1)}")
    assert checked >= 5
    assert not bad, "links to headings that are not there:\n" + "\n".join(bad)


# ---- names left from an old layout --------------------------------------------------------------------------
def _missing_py_files(text: str) -> list[tuple[int, str]]:
    """(line, name) of every ``.py`` file named in the text, bare or with some of its folders, that is not a file
    of this repository.  Files of other projects are named with their project's path (``torch/...``, ``triton/...``,
    ``transformers/...``); a capitalised name is a placeholder (a script of the reader's own)."""
    names = {Path(p).name for p in PY_FILES}
    out = []
    for m in re.finditer(r"(?<![\w./-])((?:[\w-]+/)*\w+\.py)\b", text):
        c = m.group(1)
        ok = c in names if "/" not in c else any(p == c or p.endswith("/" + c) for p in PY_FILES)
        if not (ok or c.startswith(("torch/", "triton/", "transformers/")) or re.fullmatch(r"[A-Z][A-Z_]*\.py", c)):
            out.append((text.count("\n", 0, m.start()) + 1, c))
    return out


def test_module_file_names_in_markdown_exist():
    """The old name of a moved module (the trainer's or the LLaMA model's file before the move) fails here."""
    bad = [f"{f.relative_to(REPO)}:{line}: {c}" for f in MARKDOWN
           for line, c in _missing_py_files(f.read_text(encoding="utf-8"))]
    assert not bad, "Markdown names .py files that are not in the repository:\n" + "\n".join(bad)


def _top_level_names(path: Path) -> set[str]:
    """Names a module defines or imports at its top level (and its ``_LAZY`` exports, as ``dettrain`` has)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out: set[str] = set()
    for n in ast.walk(tree):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(n.name)
        elif isinstance(n, (ast.Assign, ast.AnnAssign)):
            targets = n.targets if isinstance(n, ast.Assign) else [n.target]
            out |= {t.id for t in targets if isinstance(t, ast.Name)}
            if any(isinstance(t, ast.Name) and t.id == "_LAZY" for t in targets) and isinstance(n.value, ast.Dict):
                out |= {k.value for k in n.value.keys if isinstance(k, ast.Constant)}
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            out |= {(a.asname or a.name).split(".")[0] for a in n.names}
    return out


def _module_file(dotted: str) -> Path | None:
    base = REPO / Path(*dotted.split("."))
    for f in (base.with_suffix(".py"), base / "__init__.py"):
        if f.is_file():
            return f
    return None


_FILE_SUFFIXES = {"json", "jsonl", "yaml", "lock", "log", "bin", "txt", "md", "py", "pt"}


def _unresolved_dettrain_name(dotted: str) -> str | None:
    """The part of ``dettrain.a.b.c`` that names nothing: each part is a module of the package, until one is a name
    defined in the module before it (what lies beyond that, attributes of a class or function, is not checked)."""
    parts = dotted.split(".")
    for i in range(1, len(parts)):
        mod = _module_file(".".join(parts[:i]))
        if _module_file(".".join(parts[: i + 1])) is not None:
            continue
        if mod is not None and parts[i] in _top_level_names(mod):
            return None
        return ".".join(parts[: i + 1])
    return None


def _unresolved_dettrain_names(text: str) -> tuple[int, list[tuple[int, str, str]]]:
    """(how many names were checked, [(line, name, the part that names nothing)])."""
    seen, out = 0, []
    for m in re.finditer(r"(?<![\w./-])dettrain(?:\.[A-Za-z_]\w*)+", text):
        dotted = m.group(0)
        if dotted.rsplit(".", 1)[1] in _FILE_SUFFIXES:  # a file name such as dettrain.json
            continue
        seen += 1
        wrong = _unresolved_dettrain_name(dotted)
        if wrong is not None:
            out.append((text.count("\n", 0, m.start()) + 1, dotted, wrong))
    return seen, out


def test_dettrain_module_names_in_markdown_exist():
    """``dettrain.<module>[.<name>]`` in the docs (``python -m`` paths, imports, functions) resolves against the
    package as it is: ``dettrain.hf`` after the move to ``dettrain.models.hf`` fails here."""
    bad, seen = [], 0
    for f in MARKDOWN:
        n, found = _unresolved_dettrain_names(f.read_text(encoding="utf-8"))
        seen += n
        bad += [f"{f.relative_to(REPO)}:{line}: {dotted} ({wrong})" for line, dotted, wrong in found]
    assert seen > 30
    assert not bad, "Markdown names dettrain modules or functions that do not exist:\n" + "\n".join(bad)


def test_the_checks_catch_what_they_promise_to():
    """Each check finds its bad case and passes its good one (a check that quietly matches nothing fails here)."""
    def missing(text: str) -> list[str]:
        return [c for _, c in _text_citations(text) if not (REPO / c).exists()]

    assert missing("see `dettrain/loop/nowhere.py` and docs/nowhere.md") == ["dettrain/loop/nowhere.py",
                                                                             "docs/nowhere.md"]
    assert missing("`dettrain/loop/trainer.py`, docs/engines.md, conf/exp/NAME.yaml, tests/test_*.py") == []
    assert [c for _, c in _link_citations(REPO / "docs" / "x.md", "[a](../README.md) [b](nowhere.md) [c](#k) "
                                          "[d](https://x.org/a.md) [e](../../outside.md)")] == [
        "README.md", "docs/nowhere.md", "../../../outside.md"]
    assert [m.group(1) for m in _NOTE.finditer("details in TEAM_NOTES.md, see README.md, docs/guide.md")] == [
        "TEAM_NOTES.md", "README.md"]
    assert "TEAM_NOTES.md" not in NOTES and "README.md" in NOTES
    assert [c for _, c in _missing_py_files("the loop in `train.py`, `model.py`; python SCRIPT.py; "
                                            "`loop/trainer.py`, torch/_inductor/codegen/triton.py")] == [
        "train.py", "model.py"]
    guide = _slugs(REPO / "docs" / "guide.md")  # GitHub's anchors: `/` and `:` dropped, spaces to hyphens
    assert {"run-dir-safety", "bring-your-own-model--data", "step-numbers"} <= guide
    assert "python--m-dettrainadvise-four-questions-to-a-tier" in _slugs(REPO / "docs" / "determinism.md")
    assert [w for _, _, w in _unresolved_dettrain_names(
        "`dettrain.hf.from_config`, dettrain.models.hf.from_config, dettrain.GradSync, python -m dettrain.diff, "
        "dettrain.json, dettrain.launch")[1]] == ["dettrain.hf", "dettrain.launch"]


# ---- the documented command lines are valid -----------------------------------------------------------------
_USER_PATHS = {"data.path", "data.val_path", "det.reference", "ckpt.resume", "model.pretrained"}
_PLACEHOLDER = re.compile(r"NAME|RUN_?[A-Z]*\b|<|\[|\.\.\.|KEY|\bN\b")


def _documented_runs() -> list[tuple[str, list[str], int]]:
    """(where, overrides, world size) of every training command line in the Markdown's code blocks:
    ``python -m dettrain ...``, ``dettrain train ...`` and ``torchrun --nproc-per-node=N -m dettrain ...``.
    Lines with placeholders, sweeps (``-m``), another config dir or completion flags are left out."""
    import shlex

    out = []
    for f in MARKDOWN:
        fenced, pending = False, ""
        for i, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
            if line.lstrip().startswith("```"):
                fenced, pending = not fenced, ""
                continue
            if not fenced:
                continue
            if line.rstrip().endswith("\\"):
                pending += line.rstrip()[:-1] + " "
                continue
            line, pending = pending + line, ""
            try:
                words = shlex.split(line, comments=True)
            except ValueError:
                continue
            while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):  # VAR=value before the command
                words = words[1:]
            world = 1
            if words[:3] in (["python", "-m", "dettrain"], ["python3", "-m", "dettrain"]):
                args = words[3:]
            elif words[:2] == ["dettrain", "train"]:
                args = words[2:]
            elif words[:1] == ["torchrun"] and "-m" in words and words[words.index("-m") + 1:][:1] == ["dettrain"]:
                launcher, args = words[: words.index("-m")], words[words.index("-m") + 2:]
                n = [w.split("=", 1)[1] for w in launcher if w.startswith("--nproc-per-node=")]
                if not n or not n[0].isdigit():
                    continue
                world = int(n[0])
            else:
                continue
            if any(_PLACEHOLDER.search(a) for a in args) or {"-m", "--config-dir", "-sc", "--help", "-h"} & set(args):
                continue
            overrides = [a for a in args if "=" in a and not a.startswith("-")]
            out.append((f"{f.relative_to(REPO)}:{i}", overrides, world))
    return out


def test_documented_training_command_lines_compose_and_validate():
    """Every ``python -m dettrain`` / ``torchrun ... -m dettrain`` line the docs show composes with Hydra and passes
    start-up validation for its world size: an example with 4 ranks and a global batch that 4 ranks cannot split,
    or a key the schema does not have, fails here.  An error about a file the reader supplies (data.path,
    data.val_path, det.reference, ckpt.resume, model.pretrained: a directory or a Hub id in their cache) is not the
    example's."""
    from hydra import compose, initialize_config_dir

    from dettrain.config import conf_dir, register, to_config, validate
    from dettrain.errors import UserError

    register()
    runs = _documented_runs()
    assert len(runs) >= 20 and any(w > 1 for _, _, w in runs)
    bad = []
    with initialize_config_dir(str(conf_dir()), version_base="1.3"):
        for where, overrides, world in runs:
            # the files a reader brings (their data, an earlier run) are not in the repository
            theirs = [a.split("=", 1)[1] for a in overrides if a.split("=", 1)[0] in _USER_PATHS]
            try:
                validate(to_config(compose("config", overrides=overrides)), world)
            except UserError as e:
                if not any(path in str(e) for path in theirs):
                    bad.append(f"{where}: {' '.join(overrides)} on {world} rank(s): {e}")
            except Exception as e:  # Hydra: an unknown key, a bad group option
                bad.append(f"{where}: {' '.join(overrides)}: {type(e).__name__}: {str(e).splitlines()[0]}")
    assert not bad, "documented command lines that do not start:\n" + "\n".join(bad)
