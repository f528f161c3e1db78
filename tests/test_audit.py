"""python -m dettrain.audit and determinism.audit: wrong settings fail with their fix, right ones pass, and the
training run writes the same rows into its ledger header."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import REPO, train

from dettrain.determinism import audit, audit_failures, source_id, versions
from dettrain.record.ledger import read_ledger
from dettrain.tools.audit import main as audit_main


def audit_cli(*args: str, env: dict | None = None) -> tuple[int, dict]:
    p = subprocess.run([sys.executable, "-m", "dettrain.audit", *args, "--json", "-"], cwd=REPO, capture_output=True,
                       text=True, timeout=120, env={**os.environ, **(env or {})})
    assert p.returncode in (0, 1), p.stderr
    return p.returncode, json.loads(p.stdout)


def rows_by_name(out: dict) -> dict:
    return {r["name"]: r for r in out["rows"]}


def probe(code: str) -> list[dict]:
    """Run ``code`` in a fresh interpreter after dettrain's tier-2 start-up; it prints lists of audit rows as JSON."""
    prog = ("import json, torch\nfrom dettrain.determinism import DetConfig, apply_tier, audit\n"
            "apply_tier(DetConfig(tier=2, threads=1))\n" + code)
    p = subprocess.run([sys.executable, "-c", prog], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    return [{r["name"]: r for r in rows} for rows in json.loads(p.stdout)]


def test_right_settings_pass_and_every_row_has_the_schema():
    rc, out = audit_cli("--tier", "2")
    assert rc == 0 and out["pass"]
    for r in out["rows"]:
        assert set(r) == {"name", "value", "want", "ok", "fix", "level"}
        assert r["level"] in ("required", "advice", "info")
        assert r["ok"] or r["level"] != "required"
    names = set(rows_by_name(out))
    for must in ("torch.use_deterministic_algorithms", "CUBLAS_WORKSPACE_CONFIG", "TF32 matmul (cuBLAS)",
                 "cudnn.benchmark", "cudnn.deterministic", "torch threads (det.threads)", "OMP_NUM_THREADS",
                 "NCCL_ALGO", "NCCL_PROTO", "NCCL_NVLS_ENABLE", "PYTHONHASHSEED", "version torch", "version driver"):
        assert must in names


def test_untouched_process_fails_tier2_with_fixes_and_passes_tier0():
    rc, out = audit_cli("--tier", "2", "--as-is")
    rows = rows_by_name(out)
    assert rc == 1 and not out["pass"]
    r = rows["torch.use_deterministic_algorithms"]
    assert not r["ok"] and "use_deterministic_algorithms(True)" in r["fix"]
    assert not rows["cudnn.deterministic"]["ok"] and "cudnn.deterministic = True" in rows["cudnn.deterministic"]["fix"]
    rc0, out0 = audit_cli("--tier", "0", "--as-is")
    assert rc0 == 0 and all(r["ok"] or r["level"] != "required" for r in out0["rows"])


def test_settings_changed_after_startup_are_flagged():
    rows, tf = probe("torch.backends.cudnn.benchmark = True\ntorch.set_num_threads(2)\n"
                     "torch.use_deterministic_algorithms(True, warn_only=True)\na = audit(2, threads=1)\n"
                     "apply_tier(DetConfig(tier=2, threads=1))\ntorch.set_float32_matmul_precision('high')\n"
                     "print(json.dumps([a, audit(2, threads=1)]))")
    assert not rows["cudnn.benchmark"]["ok"] and "benchmark = False" in rows["cudnn.benchmark"]["fix"]
    assert not rows["torch threads (det.threads)"]["ok"] and rows["torch threads (det.threads)"]["value"] == 2
    assert not rows["deterministic warn_only"]["ok"]
    assert not tf["TF32 matmul (cuBLAS)"]["ok"] and tf["cudnn.benchmark"]["ok"]
    if "oneDNN fp32 matmul precision (CPU)" in tf:  # torch >= 2.9
        assert not tf["oneDNN fp32 matmul precision (CPU)"]["ok"]


def test_nccl_rows_are_checked_only_where_nccl_sums(monkeypatch):
    import torch

    for var in ("NCCL_ALGO", "NCCL_PROTO", "NCCL_NVLS_ENABLE"):
        monkeypatch.delenv(var, raising=False)
    cuda = torch.cuda.is_available()
    rows2 = {r["name"]: r for r in audit(2, threads=1, world=4)}
    rows3 = {r["name"]: r for r in audit(3, threads=1, world=4)}
    # tier 2 on 4 ranks: DDP all-reduces inside NCCL (when CUDA is present), so unset variables fail there only
    assert rows2["NCCL_ALGO"]["ok"] == (not cuda) and rows2["NCCL_NVLS_ENABLE"]["ok"] == (not cuda)
    assert rows3["NCCL_ALGO"]["ok"] and "no floating-point sum" in rows3["NCCL_ALGO"]["want"]
    assert {r["name"]: r for r in audit(2, threads=1, world=1)}["NCCL_ALGO"]["ok"]
    monkeypatch.setenv("NCCL_ALGO", "Ring")
    monkeypatch.setenv("NCCL_PROTO", "Simple")
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    rows = {r["name"]: r for r in audit(2, threads=1, world=4)}
    assert rows["NCCL_ALGO"]["ok"] and rows["NCCL_PROTO"]["ok"] and rows["NCCL_NVLS_ENABLE"]["ok"]
    monkeypatch.setenv("NCCL_ALGO", "NVLS")
    assert {r["name"]: r for r in audit(2, threads=1, world=4)}["NCCL_ALGO"]["ok"] == (not cuda)


def test_advice_rows_warn_without_failing(monkeypatch):
    monkeypatch.setenv("PYTHONHASHSEED", "random")
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    rows = {r["name"]: r for r in audit(2, threads=1)}
    for name in ("PYTHONHASHSEED", "OMP_NUM_THREADS"):
        assert not rows[name]["ok"] and rows[name]["level"] == "advice"
    assert "PYTHONHASHSEED=0" in rows["PYTHONHASHSEED"]["fix"] and "OMP_NUM_THREADS=1" in rows["OMP_NUM_THREADS"]["fix"]
    assert rows["PYTHONHASHSEED"] not in audit_failures(list(rows.values()))
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    rows = {r["name"]: r for r in audit(2, threads=1)}
    assert rows["PYTHONHASHSEED"]["ok"] and rows["OMP_NUM_THREADS"]["ok"]


def test_reference_versions_and_world_must_match(tmp_path):
    ours = versions()
    same = {r["name"]: r for r in audit(3, threads=1, world=1, reference={"versions": ours, "world_size": 1})}
    assert same["version torch"]["ok"] and same["version torch"]["level"] == "required" and same["world size"]["ok"]
    other = {r["name"]: r for r in audit(3, threads=1, world=1,
                                         reference={"versions": {**ours, "torch": "0.0.1"}, "world_size": 8})}
    assert not other["version torch"]["ok"] and "0.0.1" in other["version torch"]["fix"]
    assert not other["world size"]["ok"] and "det.tier=4" in other["world size"]["fix"]
    assert "world size" not in {r["name"] for r in audit(4, threads=1, world=1, reference={"world_size": 8})}
    # the CLI reads the reference from a ledger and exits 1 on the mismatch
    ledger = tmp_path / "ledger.jsonl"
    ledger.write_text(json.dumps({"kind": "header", "versions": {**ours, "torch": "0.0.1"}, "world_size": 1}) + "\n")
    rc, out = audit_cli("--tier", "3", "--reference", str(ledger))
    assert rc == 1 and not rows_by_name(out)["version torch"]["ok"]
    assert audit_main(["--reference", str(tmp_path / "nope")]) == 2  # bad input: refused before anything runs


def test_the_dettrain_code_is_a_version_a_reference_must_match_and_diff_names(tmp_path):
    """dettrain's own kernels set a run's bits (a change of a kernel's default changes them), so the header's
    versions carry ``dettrain``: its version and a hash of its sources, which follows an edit of any module and
    nothing else (not a bytecode cache, not where the package lies); a reference run of other dettrain code fails
    the audit, and dettrain.diff lists the difference."""
    import shutil

    from dettrain import __version__
    from dettrain.tools.diff import environment_differences

    pkg = tmp_path / "a" / "dettrain"
    for rel, text in [("__init__.py", "x = 1\n"), ("kernels/attention.py", "SPLIT = 4\n")]:
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(text)
    first = source_id(pkg)
    assert first.startswith(f"{__version__}+") and len(first.split("+")[1]) == 12
    (pkg / "kernels" / "__pycache__").mkdir()
    (pkg / "kernels" / "__pycache__" / "attention.cpython-311.pyc").write_bytes(b"\0")
    (pkg / "README.md").write_text("docs\n")
    assert source_id(pkg) == first
    shutil.copytree(pkg, tmp_path / "b" / "dettrain")
    assert source_id(tmp_path / "b" / "dettrain") == first
    (pkg / "kernels" / "attention.py").write_text("SPLIT = 1\n")
    assert source_id(pkg) != first
    # this process's versions hold the installed package's id, computed the same way
    import dettrain

    ours = versions()
    assert ours["dettrain"] == source_id(Path(dettrain.__file__).resolve().parent)
    other = {**ours, "dettrain": f"{__version__}+000000000000"}
    rows = {r["name"]: r for r in audit(3, threads=1, world=1, reference={"versions": other, "world_size": 1})}
    assert not rows["version dettrain"]["ok"] and rows["version dettrain"]["level"] == "required"
    assert "000000000000" in rows["version dettrain"]["fix"]
    same = {r["name"]: r for r in audit(3, threads=1, world=1, reference={"versions": ours, "world_size": 1})}
    assert same["version dettrain"]["ok"]
    old = {k: v for k, v in ours.items() if k != "dettrain"}  # a ledger written before the field: recorded only
    rows = {r["name"]: r for r in audit(3, threads=1, world=1, reference={"versions": old, "world_size": 1})}
    assert rows["version dettrain"]["ok"] and rows["version dettrain"]["level"] == "info"
    diffs = environment_differences({"kind": "header", "versions": ours}, {"kind": "header", "versions": other})
    assert [(k, a, b) for k, a, b in diffs if "dettrain" in k] == [("versions.dettrain", ours["dettrain"],
                                                                      other["dettrain"])]


def test_training_header_holds_the_same_audit(tmp_path):
    run = tmp_path / "r"
    train(run, "det.tier=2", "train.steps=1")
    header, _ = read_ledger(run)
    rows = {r["name"]: r for r in header["audit"]}
    assert set(rows) == {r["name"] for r in audit(2, threads=1, world=1)}  # the same checks as the CLI
    assert all(r["ok"] for r in rows.values() if r["level"] == "required")
    assert rows["torch threads (det.threads)"]["value"] == 1 and rows["torch.use_deterministic_algorithms"]["value"]
