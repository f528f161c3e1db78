"""examples/rl_grpo.py: on-policy RL with dettrain.generate, importance ratio exactly 1.0 for every token (the
example asserts it and exits non-zero otherwise), the same ledger, generation fingerprints included, on 1 and 2
ranks (tier 4) and on a rerun (tier 3)."""

from __future__ import annotations

import json

from conftest import REPO, run_script

EXAMPLE = REPO / "examples" / "rl_grpo.py"


def run_example(out, nproc: int, *args: str) -> str:
    return run_script(EXAMPLE, out, nproc, *args)


def steps(out) -> list[dict]:
    lines = [json.loads(x) for x in (out / "ledger.jsonl").read_text().splitlines()]
    return [x for x in lines if x["kind"] == "step"]


def test_rl_example_ratio_one_and_same_ledger_on_1_and_2_ranks(tmp_path):
    log = run_example(tmp_path / "one", 1, "--steps", "3")
    assert log.count("importance ratio 1.0") == 3
    run_example(tmp_path / "two", 2, "--steps", "3")
    a, b = steps(tmp_path / "one"), steps(tmp_path / "two")
    assert len(a) == 3 and a == b  # whole lines: trainer fingerprints and gen_prompts / gen_tokens / gen_logprobs
    assert all(len({s[k] for s in a}) == 3 for k in ("gen_prompts", "gen_tokens", "gen_logprobs"))


def test_rl_example_tier3_reruns_identical(tmp_path):
    run_example(tmp_path / "a", 1, "--tier", "3", "--steps", "2")
    run_example(tmp_path / "b", 1, "--tier", "3", "--steps", "2")
    assert steps(tmp_path / "a") == steps(tmp_path / "b")
