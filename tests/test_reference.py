"""One token changed in the data at a sample first consumed at step k: diff finds step k in the data, and the live
check (det.reference, det.on_divergence=stop) halts every rank of a 2-rank Gloo run at step k with the ledger
intact and the step's batch and per-tensor fingerprints in the run dir."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import REPO, train

from dettrain.data import SampleDataset, StepSampler
from dettrain.record.ledger import read_ledger, ulps
from dettrain.record.wandb_io import read_wandb_run

K = 2  # the step whose batch holds the changed token
T, G, MB = 64, 8, 2  # seq_len, global batch and micro batch of conftest.TINY
NPROC = 2


@pytest.fixture(scope="module")
def flipped(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("ref")
    text = root / "corpus.txt"
    text.write_bytes(b"".join(f"line {i}: the quick brown fox {i * 7919 % 1000} jumps\n".encode()
                              for i in range(400)))
    orig, flip = root / "orig.bin", root / "flip.bin"
    # --no-eot: raw bytes (uint8, vocabulary 256), edited below byte by byte
    subprocess.run([sys.executable, "-m", "dettrain.data", "prepare", str(text), "--out", str(orig), "--no-eot"],
                   cwd=REPO, check=True, capture_output=True)
    tok = np.fromfile(orig, dtype=np.uint8)
    sampler = StepSampler(SampleDataset(tok, T), seed=0, global_batch=G, micro_batch=MB)
    earlier = {int(i) for k in range(K) for i in sampler.global_step_ids(0, k * G).ravel()}
    sample = int(sampler.global_step_ids(0, K * G)[1][0])  # a sample of step K's second micro-batch
    assert sample not in earlier  # first consumed at step K
    pos = sample * T + T // 2  # inside the sample, away from the token it shares with its neighbours
    changed = tok.copy()
    changed[pos] = (int(tok[pos]) + 1) % 256
    changed.tofile(flip)
    shutil.copy(orig.with_name("orig.bin.json"), flip.with_name("flip.bin.json"))
    ref, live = root / "ref", root / "live"
    train(ref, f"data.path={orig}", nproc=NPROC)
    # with the wandb mirror on (offline, no network): its per-step match flag must show where the runs part
    wandb_env = {"HOME": str(root), "WANDB_MODE": "offline", "WANDB_API_KEY": "", "WANDB_SILENT": "true",
                 "WANDB_BASE_URL": "http://127.0.0.1:9"}
    p = train(live, f"data.path={flip}", f"det.reference={ref}", "det.on_divergence=stop", "log.wandb.mode=offline",
              nproc=NPROC, check=False, env=wandb_env)
    return {"ref": ref, "live": live, "flip": flip, "sample": sample, "pos": pos, "proc": p}


def test_one_token_changed_diverges_at_step_k_in_data(flipped):
    p = subprocess.run([sys.executable, "-m", "dettrain.diff", str(flipped["ref"]), str(flipped["live"]), "--json"],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    assert p.returncode == 1, p.stderr
    res = json.loads(p.stdout)
    assert res["first_divergence"] == K and res["first_field"] == "batch"
    assert "compared the 3 common steps only" in res["length_note"]  # the stopped run is shorter
    assert ["data.path", str(flipped["ref"].parent / "orig.bin"), str(flipped["flip"])] in res["config_differences"]


def test_live_check_stop_halts_every_rank_at_step_k(flipped):
    p, live = flipped["proc"], flipped["live"]
    assert p.returncode != 0, p.stdout[-3000:]
    assert f"live check: DIVERGED at step {K}" in p.stdout + p.stderr
    # the ledger is intact: every line parses, steps 0..K, then the divergence event
    lines = [json.loads(x) for x in (live / "ledger.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines if x["kind"] == "step"] == list(range(K + 1))
    assert lines[-1]["kind"] == "event" and lines[-1]["step"] == K and lines[-1]["first"] == "batch"
    assert "tensors" in lines[-2] and lines[-2]["step"] == K
    # before step K the run matched its reference bit for bit
    _, ref_steps = read_ledger(flipped["ref"])
    fields = ("batch", "loss_bits", "grad", "param", "opt")
    assert [[s[f] for f in fields] for s in lines[1:K + 1]] == [[s[f] for f in fields] for s in ref_steps[:K]]
    # every rank saved its micro-batches of step K; together they are step K's global batch of the changed data
    out = live / "divergence" / f"step_{K:06d}"
    saved = [torch.load(out / f"batch_rank{r}.pt") for r in range(NPROC)]
    assert [s["rank"] for s in saved] == list(range(NPROC)) and all(s["step"] == K for s in saved)
    by_index = {i: t for s in saved for i, t in zip(s["micro_indices"], s["tokens"])}
    ds = SampleDataset(np.fromfile(flipped["flip"], dtype=np.uint8), T)
    ids = StepSampler(ds, seed=0, global_batch=G, micro_batch=MB).global_step_ids(0, K * G)
    assert sorted(by_index) == list(range(G // MB))
    for i, row in enumerate(ids):
        assert torch.equal(by_index[i], ds[[int(x) for x in row]])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["step"] == K and summary["first"] == "batch" and summary["reference"] == str(flipped["ref"])
    assert json.loads((out / "tensors.json").read_text())["run"] == lines[-2]["tensors"]


def test_wandb_match_flag_marks_the_divergent_step(flipped):
    _, steps = read_ledger(flipped["live"])
    _, wsteps = read_wandb_run(flipped["live"] / "wandb")
    assert [s["ref_match"] for s in wsteps] == [1] * K + [0]
    # the loss distance in fp32 ULPs: 0 while the bits agree, then the distance diff reports at step K
    _, ref_steps = read_ledger(flipped["ref"])
    want = [ulps(r["loss_bits"], s["loss_bits"]) for r, s in zip(ref_steps, steps)]
    assert [s["ref_loss_ulps"] for s in wsteps] == want and want[:K] == [0] * K and want[K] > 0
    summary = json.loads((flipped["live"] / "divergence" / f"step_{K:06d}" / "summary.json").read_text())
    assert summary["loss_ulps"] == want[K]
    assert [{k: v for k, v in w.items() if not k.startswith("ref_")} for w in wsteps] == steps
