"""The tier policy (dettrain/tiers.py) is the one place that maps tier numbers to behaviour."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch
from conftest import train

from dettrain.errors import UserError
from dettrain.tiers import TIERS, TierPolicy, policy

REPO = Path(__file__).resolve().parent.parent
PROMISES = ("seeded", "deterministic_ops", "pin_threads", "canonical_sum", "world_invariant")


def test_every_tier_keeps_the_promises_of_the_tiers_below():
    for t in TIERS:
        for u in TIERS:
            if t < u:
                for f in PROMISES:
                    assert getattr(policy(u), f) or not getattr(policy(t), f), (t, u, f)
    # and each tier adds something: no two tiers are the same policy
    assert len({tuple(getattr(policy(t), f) for f in (*PROMISES, "fast_math")) for t in TIERS}) == len(TIERS)
    assert [policy(t).fast_math for t in TIERS] == [True, False, False, False, False]
    assert policy(2).backend_sums and not policy(3).backend_sums and not policy(1).backend_sums
    assert [policy(t).default_engine for t in TIERS] == ["ddp", "ddp", "ddp", "flat", "flat"]


def test_names_match_the_readme_tier_table():
    rows = re.findall(r"^\| (\d) \| (\w+) \|", (REPO / "README.md").read_text(), flags=re.M)
    assert {int(n): name for n, name in rows} == TIERS == {t: policy(t).name for t in TIERS}


@pytest.mark.parametrize("bad", [-1, 5, "x", "3", None, 2.5, 3.0, True])
def test_a_bad_tier_is_named(bad):
    with pytest.raises(UserError, match=r"det\.tier=.* is not a tier; use one of \[0, 1, 2, 3, 4\]"):
        policy(bad)


def test_a_bad_tier_on_the_command_line_is_one_line_and_exit_2(tmp_path):
    """The tier is resolved before the rest of the config is validated (the CUDA environment comes first): a bad
    one must still be a clear refusal, not a traceback."""
    p = train(tmp_path / "r", "det.tier=7", check=False)
    assert p.returncode == 2, p.stderr[-2000:]
    assert "det.tier=7 is not a tier; use one of [0, 1, 2, 3, 4]" in p.stderr
    assert "Traceback" not in p.stderr


def _tier_comparisons(tree: ast.AST) -> list[int]:
    """Lines comparing something named ``tier`` (a variable or attribute) with an integer literal or a literal
    tuple/list/set of them, e.g. ``tier >= 2``, ``cfg.det.tier == 4``, ``tier in (3, 4)``."""

    def is_tier(n: ast.AST) -> bool:
        return (isinstance(n, ast.Name) and n.id == "tier") or (isinstance(n, ast.Attribute) and n.attr == "tier")

    def is_int_literal(n: ast.AST) -> bool:
        if isinstance(n, ast.Constant):
            return isinstance(n.value, int) and not isinstance(n.value, bool)
        if isinstance(n, (ast.Tuple, ast.List, ast.Set)):
            return any(is_int_literal(e) for e in n.elts)
        return False

    out = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Compare):
            sides = [n.left, *n.comparators]
            if any(is_tier(s) for s in sides) and any(is_int_literal(s) for s in sides):
                out.append(n.lineno)
    return out


def test_no_module_but_tiers_compares_tier_numbers():
    """Behaviour follows the policy's named fields, never ``tier >= N`` scattered over modules."""
    found = []
    for path in sorted((REPO / "dettrain").rglob("*.py")):
        if path.name == "tiers.py" and path.parent.name == "dettrain":
            continue
        for line in _tier_comparisons(ast.parse(path.read_text(encoding="utf-8"))):
            found.append(f"{path.relative_to(REPO)}:{line}")
    assert not found, "tier numbers compared outside dettrain/tiers.py (use policy(tier).<field>):\n" + \
        "\n".join(found)
    # the check sees what it must: tiers.py itself is made of such comparisons
    assert _tier_comparisons(ast.parse((REPO / "dettrain" / "tiers.py").read_text()))
    assert _tier_comparisons(ast.parse("if cfg.det.tier in (3, 4): pass\nx = tier >= 2"))


def test_apply_tier_does_what_the_policy_says():
    """torch's own switches, read back after apply_tier, agree with the policy's fields at every tier."""
    from dettrain.determinism import DetConfig, apply_tier

    saved = (torch.are_deterministic_algorithms_enabled(), torch.get_float32_matmul_precision(),
             torch.get_num_threads(), torch.backends.cudnn.benchmark)
    try:
        for t in TIERS:
            pol: TierPolicy = policy(t)
            apply_tier(DetConfig(tier=t, threads=1))
            assert torch.are_deterministic_algorithms_enabled() == pol.deterministic_ops
            assert (torch.get_float32_matmul_precision() == "high") == pol.fast_math
            assert torch.backends.cudnn.benchmark == pol.fast_math
            if pol.pin_threads:
                assert torch.get_num_threads() == 1
    finally:
        torch.use_deterministic_algorithms(saved[0])
        torch.set_float32_matmul_precision(saved[1])
        torch.set_num_threads(saved[2])
        torch.backends.cudnn.benchmark = saved[3]
