"""python -m dettrain.advise: every leaf gives the tier documented in docs/determinism.md; flags run it headless."""

from __future__ import annotations

import itertools
import json
import re
import subprocess
import sys

import pytest
from conftest import REPO

from dettrain.tools.advise import QUESTIONS, MissingAnswer, advise

DOC = REPO / "docs" / "determinism.md"


def documented_leaves() -> list[tuple[list[str], list[str], list[str], int]]:
    """The leaf table between the advise-leaves markers: (bitwise, across, scale answers, tier) per row."""
    text = DOC.read_text()
    m = re.search(r"<!-- advise-leaves.*?-->(.*?)<!-- /advise-leaves -->", text, re.S)
    assert m, "docs/determinism.md lost its advise-leaves table"
    rows = []
    for line in m.group(1).strip().splitlines()[2:]:  # skip the header and the |---| line
        cells = [c.strip() for c in line.strip().strip("|").split("|")]

        def expand(cell: str, q: str) -> list[str]:
            return list(QUESTIONS[q][1]) if cell == "any" else [c.strip() for c in cell.split(",")]

        rows.append((expand(cells[0], "bitwise"), expand(cells[1], "across"), expand(cells[2], "scale"),
                     int(cells[3].split()[0])))
    return rows


def test_every_answer_combination_hits_exactly_one_documented_leaf_with_its_tier():
    leaves = documented_leaves()
    assert len(leaves) >= 5
    for b, a, s, nd in itertools.product(*(QUESTIONS[q][1] for q in ("bitwise", "across", "scale", "nondet_ops"))):
        matches = [tier for bs, as_, ss, tier in leaves if b in bs and a in as_ and s in ss]
        assert len(matches) == 1, (b, a, s)
        adv = advise(b, a, s, nd)
        assert adv.tier == matches[0], (b, a, s, nd)
        assert adv.overrides[0] == f"det.tier={adv.tier}"


def test_the_tree_asks_only_what_the_path_needs():
    assert advise("no").tier == 1  # nothing else asked
    with pytest.raises(MissingAnswer, match="--across"):
        advise("yes")
    with pytest.raises(MissingAnswer, match="--scale"):
        advise("yes", "no")
    with pytest.raises(MissingAnswer, match="--nondet-ops"):
        advise("yes", "no", "gpu")
    asked = []
    a = advise(ask=lambda q: asked.append(q) or {"bitwise": "yes", "across": "no", "scale": "node",
                                                  "nondet_ops": "unknown"}[q])
    assert asked == ["bitwise", "across", "scale", "nondet_ops"] and a.tier == 3
    assert any("dettrain.verify" in c for c in a.check)
    with pytest.raises(ValueError, match="--scale"):
        advise("yes", "no", "cluster", "no")


def test_leaf_contents_follow_the_answers():
    four = advise("yes", "yes", "multi", "yes")
    assert four.tier == 4 and any("power-of-two" in n for n in four.notes)
    assert any("dist.offload_partials=true" in n for n in four.notes)  # what its partial sums cost, and the way out
    assert not any("offload_partials" in n for n in advise("yes", "no", "node", "no").notes)
    assert [x for x, _ in four.substitutes] and "srun torchrun" in four.command
    two = advise("yes", "no", "gpu", "no")
    assert two.substitutes == [] and "export CUBLAS_WORKSPACE_CONFIG=:4096:8" in two.env
    assert two.command.startswith("python -m dettrain ")
    one = advise("no")
    assert not any("CUBLAS" in e for e in one.env)


@pytest.mark.parametrize("answers", [("yes", "no", "gpu", "no"), ("yes", "no", "node", "yes"),
                                     ("yes", "yes", "node", "no")])
def test_overrides_are_real_config_keys(answers):
    """The printed overrides (placeholders aside) compose and validate against the training schema."""
    from dettrain.config import validate
    from dettrain.tools.verify import load_config

    a = advise(*answers)
    cfg = load_config([o for o in a.overrides if "<" not in o])
    assert cfg.det.tier == a.tier
    validate(cfg, world=1)


def test_cli_runs_non_interactively_and_names_a_missing_flag():
    run = lambda *args: subprocess.run([sys.executable, "-m", "dettrain.advise", *args], cwd=REPO,  # noqa: E731
                                       capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=120)
    p = run("--bitwise", "yes", "--across", "no", "--scale", "node", "--nondet-ops", "no", "--json")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["tier"] == 3
    p = run("--bitwise", "yes", "--across", "no")
    assert p.returncode == 2 and "--scale" in p.stderr
    p = run("--tree")
    assert p.returncode == 0 and "tier 4 invariant" in p.stdout
    # the tree printed by the CLI is the one drawn in the docs
    assert p.stdout.strip() in DOC.read_text()
