"""Tokens/s and peak memory of the training CLI over a grid of shapes, beside the loop a user writes instead.

For each model and micro-batch size, in one session: the plain compiled loop (bench/plain_loop.py) and ``python -m
dettrain`` at each variant (tier 0, tier 3, tier 4, FSDP2 at tier 3; ``t4o``: tier 4 with its partial sums in host
memory, ``dist.offload_partials``, at the default copy streams (one per direction); ``t4o1``: the same with one copy
stream for both directions, ``DETTRAIN_OFFLOAD_STREAMS=1``; ``t4o2``: two named explicitly, as measured before two
became the default; FSDP2 at tier 3 with its units named: ``f3b`` one block a unit, ``DETTRAIN_FSDP2_UNITS=blocks``
(the default before units of several blocks), ``f3r`` the whole model as one unit, ``root``, ``f3x`` with its AdamW
hashing the parameters and moments it stores, ``DETTRAIN_FP_FUSED=1``; ``t3k1``, ``t3k2``,
``t3k4``, ``t3k8``, ``t4k1``, ``t4k4``: tiers 3 and 4 with the attention backward's dK/dV pass splitting each GQA
group into 1 (unsplit), 2, 4 or 8 parts, ``DETTRAIN_ATTN_KV_SPLIT``; 4 is the default at head size 64; ``t0p``,
``t3p``, ``t4p``: with ``train.overlap_steps=true`` (the default, auto, is on for CUDA since 2026-12-08, so on a GPU
these equal t0, t3, t4; runs recorded before then were serial), ``t0s``, ``t3s``, ``t4s``: with
``train.overlap_steps=false`` (serial steps), and ``t0pf``, ``t3pf`` with ``DETTRAIN_FP_STREAM=1`` too;
``t0w``, ``t3w``: with the wandb mirror at its default, offline, where every other run has
``log.wandb.mode=disabled``), each a fresh process, interleaved and repeated ``--rounds`` times. A CLI run's
tokens/s is the median of its progress lines after the compiling step (``log.every=1``), its peak is the ``peak
device memory`` of its done line. Writes one markdown table (tokens/s as median [min-max] over rounds, the ratios
the goals name, peak memory) to ``--out`` and prints it.

    python3 bench/bench_grid.py --models 125m hf125m 1b [--rounds 2] [--steps 12] --out grid.md     # one GPU
    python3 bench/bench_grid.py --cpu --out grid.md          # a tiny model on the CPU (keeps the script working)

Over several device calls (each has a time limit): ``--budget S`` starts no process after S seconds, and the
``.json`` beside ``--out`` is rewritten (atomically) after every process, so a call cut short keeps what it measured;
``--resume grid.json`` takes an earlier call's runs as measured, runs only the rounds each cell still lacks, and
keeps the earlier rows in the table. A cell is one model and micro-batch size on one card (``nvidia-smi``'s name,
``cpu`` with ``--cpu``): a call that lands on another card measures its own rows, so no ratio or spread mixes cards.
Rounds run round-major (``--order round``, the default: every cell's first round before any cell's second), so a
budget that runs out leaves every shape measured once; ``--plan`` prints the runs a call would start and starts none
(``--card NAME`` with it: the runs a call on that card would start, e.g. planned from a machine without a GPU). A
variant that ran out of device memory in a round is not started again in later rounds on that card while the code is
the same (the table shows its error); any other error, or the same after a code change, is retried.
Every run records ``code`` (``code_id``: a hash of dettrain's sources and configs and the plain loop, since the
device's copy of the tree has no git history); a row whose runs measured different code names each after the row:

    python3 bench/bench_grid.py --models 125m hf125m 1b --rounds 2 --budget 500 --out $OUT/grid.md      # call 1
    python3 bench/bench_grid.py --models 125m hf125m 1b --rounds 2 --budget 500 --resume OLD.json \
        --out $OUT/grid.md                                                                           # call 2, ...

Ratios: tier 0 / plain loop, tier 3 / tier 0, tier 4 / tier 0, FSDP2 tier 3 / flat tier 3; peaks of tiers 3-4 /
tier 0 (goals: >= 1.00, >= 0.97, >= 0.95, >= 0.97; peaks <= 1.10).
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
HF125M = ["model=hf_llama", "model.vocab_size=32000", "model.seq_len=1024", "model.hidden_size=768",
          "model.intermediate_size=2048", "model.num_hidden_layers=12", "model.num_attention_heads=12",
          "model.num_key_value_heads=12"]
# name: (CLI model overrides, plain_loop.py arguments, global batch, micro-batch sizes)
MODELS = {
    "125m": (["model=125m"], ["--model", "125m"], 64, [4, 8, 16, 32, 64]),
    "hf125m": (HF125M, ["--model", "125m", "--hf"], 64, [4, 8, 16, 32, 64]),
    "1b": (["model=1b"], ["--model", "1b"], 16, [1, 2, 4, 8, 16]),
    "tiny": (["model=tiny"], ["--model", "tiny"], 8, [1, 4]),
    "hftiny": (["model=hf_llama"], ["--model", "tiny", "--hf"], 8, [4]),
}
VARIANTS = {"t0": ["det.tier=0"], "t3": ["det.tier=3"], "t4": ["det.tier=4"],
            "f3": ["det.tier=3", "dist.engine=fsdp2"],
            "f3b": ["det.tier=3", "dist.engine=fsdp2"],  # ... one block a unit (DETTRAIN_FSDP2_UNITS=blocks)
            "f3r": ["det.tier=3", "dist.engine=fsdp2"],  # ... as one FSDP2 unit (DETTRAIN_FSDP2_UNITS=root)
            "f3x": ["det.tier=3", "dist.engine=fsdp2"],  # ... its AdamW hashing what it stores (DETTRAIN_FP_FUSED=1)
            "t4o": ["det.tier=4", "dist.offload_partials=true"],  # tier 4's partial sums in host memory
            "t4o1": ["det.tier=4", "dist.offload_partials=true"],  # ... with one copy stream for both directions
            "t4o2": ["det.tier=4", "dist.offload_partials=true"],  # ... with one per direction, named
            "t3k1": ["det.tier=3"], "t3k2": ["det.tier=3"], "t3k4": ["det.tier=3"],  # GQA groups split in
            "t3k8": ["det.tier=3"], "t4k1": ["det.tier=4"], "t4k4": ["det.tier=4"],  # the attention backward's
            # dK/dV pass (DETTRAIN_ATTN_KV_SPLIT; k1: unsplit)
            # p: pipelined steps, the next step's first micro-batch queued before a line is read
            # (train.overlap_steps=true); pf: and the parameter and optimizer hashes on a side stream beside it
            # (DETTRAIN_FP_STREAM=1)
            "t0p": ["det.tier=0", "train.overlap_steps=true"], "t3p": ["det.tier=3", "train.overlap_steps=true"],
            "t4p": ["det.tier=4", "train.overlap_steps=true"], "t0pf": ["det.tier=0", "train.overlap_steps=true"],
            "t3pf": ["det.tier=3", "train.overlap_steps=true"],
            # s: serial steps, every line read before the next step begins (the default before 2026-12-08)
            "t0s": ["det.tier=0", "train.overlap_steps=false"], "t3s": ["det.tier=3", "train.overlap_steps=false"],
            "t4s": ["det.tier=4", "train.overlap_steps=false"],
            # w: the wandb mirror at its default (offline: a row a step, files under the run dir), as a user runs;
            # every other variant turns it off (run_cli), as the grid did from the start
            "t0w": ["det.tier=0", "log.wandb.mode=offline"], "t3w": ["det.tier=3", "log.wandb.mode=offline"]}
KV_SPLIT_NAMES = ("t3k1", "t3k2", "t3k4", "t3k8", "t4k1", "t4k4")
VARIANT_ENV = {"t4o1": {"DETTRAIN_OFFLOAD_STREAMS": "1"}, "t4o2": {"DETTRAIN_OFFLOAD_STREAMS": "2"},
               "f3b": {"DETTRAIN_FSDP2_UNITS": "blocks"}, "f3r": {"DETTRAIN_FSDP2_UNITS": "root"},
               "f3x": {"DETTRAIN_FP_FUSED": "1"},
               **{k: {"DETTRAIN_ATTN_KV_SPLIT": k[3:]} for k in KV_SPLIT_NAMES},
               "t0pf": {"DETTRAIN_FP_STREAM": "1"}, "t3pf": {"DETTRAIN_FP_STREAM": "1"}}
FSDP2_NAMED = ("f3b", "f3r", "f3x")
OFFLOADED = ("t4o", "t4o1", "t4o2")
KV_SPLIT = KV_SPLIT_NAMES
PIPELINED = ("t0p", "t3p", "t4p", "t0pf", "t3pf")
SERIAL = ("t0s", "t3s", "t4s")
MIRRORED = ("t0w", "t3w")
# other forms of tiers 0-4: each one's ratio to tier 0 and its peak get a column
OTHER_FORMS = (*OFFLOADED, *KV_SPLIT, *PIPELINED, *SERIAL, *MIRRORED)
SPEED = re.compile(r"\| ([\d,]+) tok/s \|")
PEAK = re.compile(r"peak device memory ([\d.]+) GiB")


# what a run's speed depends on: dettrain's sources and configs and the plain loop (not this script's bookkeeping)
CODE_PATHS = ("dettrain", "conf", "bench/plain_loop.py", "pyproject.toml")
CODE_SUFFIXES = (".py", ".yaml", ".toml")


def code_id(root: Path = REPO) -> str:
    """A short hash of the files under ``CODE_PATHS`` (their paths and bytes, ``__pycache__`` left out).  Every run
    records it: the tree a device call runs is a copy without git history, so this is what says which code a run
    measured, and the table marks a cell whose runs measured different code (rounds resumed across changes)."""
    files: list[Path] = []
    for rel in CODE_PATHS:
        q = root / rel
        if q.is_dir():
            files += [f for f in q.rglob("*") if f.is_file() and f.suffix in CODE_SUFFIXES
                      and "__pycache__" not in f.parts]
        elif q.is_file():
            files.append(q)
    h = hashlib.sha256()
    for f in sorted(files, key=lambda f: f.relative_to(root).as_posix()):
        h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This checkout first on the path, keeping what the caller put there; ``extra``: a variant's variables."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, **(extra or {})}


def run_cli(model_args: list[str], gb: int, mb: int, variant: list[str], steps: int, extra: list[str],
            timeout: int, env: dict[str, str] | None = None) -> dict:
    """One ``python -m dettrain`` run in a fresh process and run dir: tokens/s (median of the progress lines after
    the first, compiling, step) and peak device memory (None on the CPU); ``wandb``: true when the run mirrored
    to wandb (the ``t0w``/``t3w`` variants; left out otherwise, as in the runs recorded before it existed)."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "dettrain", *model_args, f"train.global_batch={gb}", f"train.micro_batch={mb}",
               # the mirror off unless a variant turns it on (t0w, t3w: Hydra takes a key's last value)
               f"train.steps={steps}", "log.every=1", "ckpt.final=false", "log.wandb.mode=disabled",
               f"run_dir={tmp}/run", *variant, *extra]
        p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                           env=_env(env))
        mirrored = (Path(tmp) / "run" / "wandb").is_dir()  # the wandb mirror wrote its offline run there
    text = p.stdout + p.stderr
    if p.returncode != 0:
        return {"error": f"exit {p.returncode}: {text.strip().splitlines()[-1] if text.strip() else ''}"}
    speeds = [float(s.replace(",", "")) for s in SPEED.findall(text)]
    peak = PEAK.search(text)
    # the first progress line after the compile covers the first steady steps; skip one more for warm-up
    steady = speeds[2:] if len(speeds) > 3 else speeds[1:] or speeds
    rec = {"tokens_per_s": statistics.median(steady), "peak_GiB": float(peak.group(1)) if peak else None}
    return {**rec, "wandb": True} if mirrored else rec


def run_plain(plain_args: list[str], gb: int, mb: int, steps: int, cpu: bool, timeout: int) -> dict:
    cmd = [sys.executable, str(REPO / "bench" / "plain_loop.py"), *plain_args, "--global-batch", str(gb),
           "--micro-batch", str(mb), "--steps", str(max(steps - 4, 2)), "--warmup", "3", *(["--cpu"] if cpu else [])]
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                       env=_env())
    if p.returncode != 0:
        return {"error": f"exit {p.returncode}: {(p.stdout + p.stderr).strip().splitlines()[-1]}"}
    rec = json.loads(p.stdout.strip().splitlines()[-1])
    return {"tokens_per_s": rec["plain_tokens_per_s"], "peak_GiB": rec["peak_GiB"]}


def spread(vals: list[float]) -> str:
    if not vals:
        return "-"
    med = statistics.median(vals)
    return f"{med / 1e3:,.1f}k" + (f" [{min(vals) / 1e3:,.1f}-{max(vals) / 1e3:,.1f}]" if len(vals) > 1 else "")


def ratio(a: list[float], b: list[float]) -> str:
    """Median of the per-round ratios a_i / b_i (same round: the pair ran back to back), with their range."""
    rs = [x / y for x, y in zip(a, b) if y]
    if not rs:
        return "-"
    return f"{statistics.median(rs):.3f}" + (f" [{min(rs):.3f}-{max(rs):.3f}]" if len(rs) > 1 else "")


def table(rows: list[dict], variants: list[str]) -> str:
    peak_of = [k for k in ("t0", "t3", "t4", *OTHER_FORMS, "f3", *FSDP2_NAMED) if k in variants]
    named = [k for k in FSDP2_NAMED if k in variants]
    off = [k for k in OTHER_FORMS if k in variants]
    head = ["device", "model", "global batch", "micro", "plain", *variants, "t0/plain", "t3/t0", "t4/t0", "f3/t3",
            *(f"{k}/t3" for k in named), *(f"{k}/t0" for k in off), f"peak {' / '.join(peak_of)} GiB"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        tps = {k: [x["tokens_per_s"] for x in r["runs"].get(k, []) if "tokens_per_s" in x] for k in
               ["plain", *variants]}
        errs = sorted({x["error"] for v in r["runs"].values() for x in v if "error" in x})
        peaks = {k: [x["peak_GiB"] for x in r["runs"].get(k, []) if x.get("peak_GiB") is not None]
                 for k in peak_of}
        peak = " / ".join(f"{max(v):.2f}" if v else "-" for v in peaks.values())
        cells = [r.get("device", "unrecorded"), r["model"], r["shape"], str(r["mb"]), spread(tps["plain"]),
                 *(spread(tps[v]) for v in variants),
                 ratio(tps.get("t0", []), tps["plain"]), ratio(tps.get("t3", []), tps.get("t0", [])),
                 ratio(tps.get("t4", []), tps.get("t0", [])), ratio(tps.get("f3", []), tps.get("t3", [])),
                 *(ratio(tps[k], tps.get("t3", [])) for k in named),
                 *(ratio(tps[k], tps.get("t0", [])) for k in off), peak]
        codes = collections.Counter(x.get("code", "unrecorded") for v in r["runs"].values() for x in v)
        mixed = f" code: {', '.join(f'{c} ({n} runs)' for c, n in sorted(codes.items()))}" if len(codes) > 1 else ""
        out.append("| " + " | ".join(cells) + " |" + (f" errors: {'; '.join(errs)}" if errs else "") + mixed)
    return "\n".join(out)


def load_rows(path: str) -> list[dict]:
    """The rows an earlier ``--out`` wrote to its .json (``--resume``), checked enough to merge into."""
    p = Path(path)
    try:
        rows = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"bench_grid: --resume {path}: cannot read it as the .json an earlier --out wrote ({e}); "
                         "pass that file, or leave --resume out to start afresh") from None
    if not isinstance(rows, list) or not all(isinstance(r, dict) and {"model", "shape", "mb", "runs"} <= set(r)
                                              for r in rows):
        raise SystemExit(f"bench_grid: --resume {path}: not a list of rows with model, shape, mb and runs (the .json "
                         "an earlier --out wrote); pass that file, or leave --resume out to start afresh")
    return rows


def out_of_memory(rec: dict) -> bool:
    """A run that ended in torch's out-of-memory error (its last line, as ``run_cli``/``run_plain`` record it)."""
    err = rec.get("error", "")
    return "OutOfMemoryError" in err or "CUDA out of memory" in err


def device_name(cpu: bool) -> str:
    """The card the runs of this call measure (the first GPU's name), ``cpu`` for ``--cpu``."""
    if cpu:
        return "cpu"
    try:
        p = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                           text=True, timeout=60)
        names = p.stdout.strip().splitlines()
    except (OSError, subprocess.SubprocessError):
        names = []
    return names[0].strip() if names else "unknown GPU"


def save_rows(rows: list[dict], path: Path) -> None:
    """Write the rows' .json whole or not at all (a temporary file renamed over it)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(rows, indent=1))
    os.replace(tmp, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["125m", "hf125m", "1b"], choices=sorted(MODELS))
    ap.add_argument("--micro", type=int, nargs="+", default=None, help="micro-batch sizes (default: the model's)")
    ap.add_argument("--variants", nargs="+", default=["t0", "t3", "t4", "f3"], choices=sorted(VARIANTS))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--timeout", type=int, default=600, help="seconds per process")
    ap.add_argument("--cpu", action="store_true", help="the tiny models on the CPU, 3 steps (a smoke run)")
    ap.add_argument("--extra", nargs="*", default=[], help="more key=value for every CLI run")
    ap.add_argument("--no-plain", action="store_true", help="skip the plain loop (when only the CLI's ratios matter)")
    ap.add_argument("--out", default=None, help="write the markdown table (and a .json of every run) here")
    ap.add_argument("--resume", default=None,
                    help="an earlier --out's .json: its runs count toward --rounds and its rows stay in the table")
    ap.add_argument("--remeasure", nargs="+", default=[], choices=sorted(VARIANTS) + ["plain"], metavar="VARIANT",
                    help="with --resume: drop these variants' runs from the cells this call covers on its card, so "
                         "they are measured again (after a change to the code they measure)")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds: start no process after this (the table and .json hold what ran)")
    ap.add_argument("--order", choices=["round", "cell"], default="round",
                    help="round: every cell's first round before any second (default); cell: a cell's rounds together")
    ap.add_argument("--plan", action="store_true",
                    help="print the runs this call would start, in order (after --resume), and start none")
    ap.add_argument("--card", default=None,
                    help="with --plan: plan for this card's rows of --resume (its name as nvidia-smi gives it, e.g. "
                         "'NVIDIA H100 80GB HBM3') instead of this machine's")
    a = ap.parse_args()
    if a.remeasure and not a.resume:
        ap.error("--remeasure drops runs of an earlier call: name its .json with --resume")
    if a.card is not None and not a.plan:
        ap.error("--card only names the card to plan for (with --plan); the runs of a call are always keyed by the "
                 "card they ran on")
    start = time.monotonic()
    json_out = Path(a.out).with_suffix(".json") if a.out else None
    models = ["tiny", "hftiny"] if a.cpu and a.models == ap.get_default("models") else a.models
    steps = 5 if a.cpu else a.steps
    extra = [*a.extra, *(["dist.backend=gloo"] if a.cpu else [])]
    rows = load_rows(a.resume) if a.resume else []
    for r in rows:
        r.setdefault("device", "unrecorded")  # written before the card was recorded
    device = a.card if a.card is not None else device_name(a.cpu)
    code = code_id()
    earlier = sorted({x.get("code", "unrecorded") for r in rows if r["device"] == device
                      for v in r["runs"].values() for x in v} - {code})
    if earlier:
        print(f"bench_grid: --resume {a.resume} holds runs on {device} of other code ({', '.join(earlier)}) than "
              f"this call measures ({code}); a cell whose rounds mix them says so after its row")
    by_cell = {(r["device"], r["model"], r["mb"]): r for r in rows}
    not_started = 0
    cells = []  # (name, model_args, plain_args, gb, mb, row), in the table's order
    for name in models:
        model_args, plain_args, gb, mbs = MODELS[name]
        for mb in a.micro or mbs:
            if gb % mb:
                continue
            row = by_cell.get((device, name, mb))
            if row is None:
                row = by_cell[(device, name, mb)] = {"device": device, "model": name, "shape": str(gb), "mb": mb,
                                                     "runs": {}}
                rows.append(row)
            cells.append((name, model_args, plain_args, gb, mb, row))
            for v in a.remeasure:
                dropped = row["runs"].pop(v, [])
                if dropped:
                    print(f"{'plan: ' if a.plan else ''}remeasure: {device} {name} mb={mb} {v}: {len(dropped)} "
                          "earlier run(s) dropped", flush=True)
    # round-major (the default): every cell's first round before any cell's second, so a budget that ends early
    # leaves every shape measured once rather than some shapes twice and others not at all
    schedule = ([(c, rnd) for rnd in range(a.rounds) for c in cells] if a.order == "round"
                else [(c, rnd) for c in cells for rnd in range(a.rounds)])
    planned = 0
    for (name, model_args, plain_args, gb, mb, row), rnd in schedule:
        order = ["plain", *a.variants] if rnd % 2 == 0 else [*reversed(a.variants), "plain"]
        order = [v for v in order if not (a.no_plain and v == "plain")]
        for v in order:
            if len(row["runs"].get(v, [])) > rnd:
                continue  # this round of this variant was measured (--resume)
            if any(out_of_memory(x) and x.get("code") == code for x in row["runs"].get(v, [])):
                # the same process of the same code on the same card runs out of memory again: a later round would
                # spend its compile and start-up time to learn nothing new (the table shows the error)
                print(f"{'plan: ' if a.plan else ''}skip: {device} {name} mb={mb} round {rnd} {v}: ran out of "
                      "device memory in an earlier round", flush=True)
                continue
            if a.plan:
                planned += 1
                print(f"plan: {device} {name} mb={mb} round {rnd} {v}")
                continue
            if a.budget is not None and time.monotonic() - start >= a.budget:
                not_started += 1
                continue
            if v == "plain":
                rec = run_plain(plain_args, gb, mb, steps, a.cpu, a.timeout)
            else:
                rec = run_cli(model_args, gb, mb, VARIANTS[v], steps, extra, a.timeout, VARIANT_ENV.get(v))
            rec["code"] = code
            row["runs"].setdefault(v, []).append(rec)
            print(f"{name} mb={mb} round {rnd} {v}: {rec}", flush=True)
            if json_out is not None:
                save_rows(rows, json_out)
    if a.plan:
        print(f"plan: {planned} runs to start on {device}")
        return
    shown = list(dict.fromkeys([*a.variants, *(v for r in rows for v in r["runs"] if v != "plain")]))
    md = table(rows, shown)
    print(md)
    if not_started:
        print(f"bench_grid: --budget {a.budget:g} s reached: {not_started} runs not started; rerun with "
              f"--resume {json_out or 'OUT.json'} to add them")
    if a.out:
        Path(a.out).write_text(md + "\n")
        save_rows(rows, json_out)


if __name__ == "__main__":
    main()
