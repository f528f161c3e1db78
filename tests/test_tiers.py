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


def _is_tier(n: ast.AST) -> bool:
    """Something named ``tier`` (a variable or attribute), e.g. ``tier``, ``cfg.det.tier``."""
    return (isinstance(n, ast.Name) and n.id == "tier") or (isinstance(n, ast.Attribute) and n.attr == "tier")


def _is_int_literal(n: ast.AST) -> bool:
    """An integer literal, or a literal tuple/list/set holding one."""
    if isinstance(n, ast.Constant):
        return isinstance(n.value, int) and not isinstance(n.value, bool)
    if isinstance(n, (ast.Tuple, ast.List, ast.Set)):
        return any(_is_int_literal(e) for e in n.elts)
    return False


def _is_tier_number(n: ast.AST) -> bool:
    return isinstance(n, ast.Constant) and type(n.value) is int and n.value in TIERS


def _mentions_tiers(n: ast.AST) -> bool:
    """``TIERS`` itself, or an expression of it (``max(TIERS)``, ``sorted(TIERS)``, ``TIERS.keys()``)."""
    return any(isinstance(x, ast.Name) and x.id == "TIERS" for x in ast.walk(n))


def _tier_numbers_used(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, what) of every place that treats tiers as numbers instead of asking the policy:

    - a comparison of something named ``tier`` with an integer literal: ``tier >= 2``, ``cfg.det.tier in (3, 4)``;
    - ``max``/``min`` of a ``tier`` and an integer literal: ``max(tier, 3)``;
    - a range check against the tier table: ``x in TIERS``, ``t <= max(TIERS)``;
    - a check of a field called "tier" against a literal: ``need("tier", lambda v: v <= 4, ...)``;
    - a dict literal mapping to tier numbers (two or more values, all integer literals that are tiers), or keyed
      by them: ``{"fold": 3, "tree": 4}``, ``{0: ..., 1: ..., 2: ...}``."""
    out = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Compare):
            sides = [n.left, *n.comparators]
            if any(_is_tier(s) for s in sides) and any(_is_int_literal(s) for s in sides):
                out.append((n.lineno, "tier compared with a number"))
            elif any(_mentions_tiers(s) for s in sides):
                out.append((n.lineno, "range check against TIERS"))
        elif isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in ("max", "min"):
            if any(_is_tier(a) for a in n.args) and any(_is_int_literal(a) for a in n.args):
                out.append((n.lineno, f"{n.func.id}() of a tier and a number"))
        if isinstance(n, ast.Call) and any(isinstance(a, ast.Constant) and a.value == "tier" for a in n.args):
            for sub in n.args:
                if any(isinstance(c, ast.Compare) and any(_is_int_literal(x) for x in c.comparators)
                       for c in ast.walk(sub)):
                    out.append((n.lineno, 'a "tier" field checked against a number'))
                    break
        elif isinstance(n, ast.Dict) and len(n.values) >= 2:
            if all(_is_tier_number(v) for v in n.values) or all(k is not None and _is_tier_number(k)
                                                                 for k in n.keys):
                out.append((n.lineno, "dict of tier numbers"))
    return out


def _tier_comparisons(tree: ast.AST) -> list[int]:
    return [line for line, _ in _tier_numbers_used(tree)]


def test_no_module_but_tiers_compares_tier_numbers():
    """Behaviour follows the policy's named fields, never ``tier >= N``, ``max(tier, 3)``, a dict of tier numbers
    or a range check scattered over modules."""
    found = []
    for path in sorted((REPO / "dettrain").rglob("*.py")):
        if path.name == "tiers.py" and path.parent.name == "dettrain":
            continue
        for line, what in _tier_numbers_used(ast.parse(path.read_text(encoding="utf-8"))):
            found.append(f"{path.relative_to(REPO)}:{line}: {what}")
    assert not found, "tier numbers used outside dettrain/tiers.py (ask policy(tier).<field>, tiers.is_tier, " \
        "tiers.lowest):\n" + "\n".join(found)
    # the check sees what it must: tiers.py itself is made of such comparisons
    assert _tier_comparisons(ast.parse((REPO / "dettrain" / "tiers.py").read_text()))


@pytest.mark.parametrize("src", [
    "if cfg.det.tier in (3, 4): pass",
    "x = tier >= 2",
    "r = Reducer(model, max(tier, 3))",
    "r = Reducer(model, min(3, self.tier))",
    'ACCUMULATE = {"fold": 3, "tree": 4}',
    'NAMES = {0: "fast", 1: "seeded", 2: "ops"}',
    "ok = cfg.det.tier not in TIERS",
    "ok = 0 <= v <= max(TIERS)",
    'need("tier", lambda v: _is_int(v) and v <= 4, "a tier 0-4")',
])
def test_the_scan_catches(src):
    assert _tier_numbers_used(ast.parse(src)), src


@pytest.mark.parametrize("src", [
    "if policy(cfg.det.tier).canonical_sum: pass",
    'ACCUMULATE = {"fold": "canonical_sum", "tree": "world_invariant"}',
    "r = Reducer(model, lowest(ACCUMULATE[a]).tier)",
    'need("tier", is_tier, "a tier")',
    'sizes = {"a": 7, "b": 12}',
    'zero = {"ring": 0.0, "a2a": 0.0}',
    "n = max(world, 3)",
])
def test_the_scan_leaves_alone(src):
    assert not _tier_numbers_used(ast.parse(src)), src


def test_is_tier_lowest_and_summing_tier_follow_the_table():
    from dettrain.tiers import is_tier, lowest

    assert [v for v in (-1, 0, 4, 5, True, 3.0, "3", None) if is_tier(v)] == [0, 4]
    assert lowest("canonical_sum") is policy(3) and lowest("world_invariant") is policy(4)
    assert lowest("seeded") is policy(1) and lowest("fast_math") is policy(0)
    with pytest.raises(ValueError):
        lowest("name")
    # the flat reducer sums canonically at every tier: at this tier when it promises so, else the lowest that does
    assert [policy(t).summing_tier for t in TIERS] == [
        t if policy(t).canonical_sum else lowest("canonical_sum").tier for t in TIERS]
    assert all(policy(policy(t).summing_tier).canonical_sum for t in TIERS)


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
