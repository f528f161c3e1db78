"""``python -m dettrain.advise``: four questions -> a determinism tier, its overrides and environment lines.

    python -m dettrain.advise [--bitwise yes|no] [--across yes|no] [--scale gpu|node|multi]
                              [--nondet-ops no|yes|unknown] [--json] [--tree]

The tree (also drawn in docs/determinism.md, whose leaf table the tests check against this code):

    Q1 --bitwise     Must reruns match bit for bit?
       no  -> tier 1 seeded (same data order, init and random draws; fast kernels; numerics may drift)
       yes -> Q2
    Q2 --across      ... also across different GPU counts, or after resuming onto another layout?
       yes -> tier 4 invariant
       no  -> Q3
    Q3 --scale       One GPU, one node, or many nodes?
       gpu   -> tier 2 ops
       node  -> tier 3 collectives
       multi -> tier 3 collectives
    Q4 --nondet-ops  (bitwise leaves) Does the model use ops without deterministic kernels?
       no      -> nothing to add
       yes     -> route them through dettrain.detops (table printed), tier unchanged
       unknown -> run python -m dettrain.verify under the tier: torch raises at the first such op

A question left out is asked on the terminal; without a terminal (CI, scripts) a missing answer that the path
needs is an error (exit 2) that names the flag.  Questions the path does not reach are not asked.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, field

from dettrain.determinism import CUBLAS_WORKSPACE
from dettrain.tiers import TIERS, policy

__all__ = ["Advice", "COSTS", "MissingAnswer", "QUESTIONS", "SUBSTITUTES", "TREE", "advise", "format_advice", "main"]

QUESTIONS: dict[str, tuple[str, tuple[str, ...]]] = {
    "bitwise": ("Must reruns of the same job match bit for bit (losses, gradients, parameters)?", ("yes", "no")),
    "across": ("Must they also match across different GPU counts, or after resuming onto another number of GPUs?",
               ("yes", "no")),
    "scale": ("One GPU, one node (several GPUs), or many nodes?", ("gpu", "node", "multi")),
    "nondet_ops": ("Does the model use ops without deterministic kernels (scatter_add/index_add/bincount with "
                   "weights in counting or routing code, histc, ...)?", ("no", "yes", "unknown")),
}

# ops whose CUDA kernels sum with atomics, and what to call instead at tiers >= 2
SUBSTITUTES = [
    ("x.scatter_add_(d, i, s) / torch.scatter_add", "x = detops.scatter_add(x, d, i, s)"),
    ("x.index_add_(d, i, s) / torch.index_add", "x = detops.index_add(x, d, i, s)"),
    ("torch.bincount(i, weights=w)", "detops.bincount(i, w)  (raises RuntimeError on CUDA in deterministic mode)"),
    ("x.index_select(d, i) with repeated i (token -> expert gather)", "detops.index_select(x, d, i)"),
    ("F.embedding(i, w) (only to pin the order across torch versions)", "detops.embedding(i, w)"),
]

COSTS = {t: policy(t).cost for t in TIERS}
"""What each tier costs, by tier (the policy's ``cost``: dettrain/tiers.py)."""


@dataclass
class Advice:
    tier: int
    name: str
    path: list[str]
    """the answers that led here, as 'question=answer'"""
    overrides: list[str]
    """Hydra overrides for python -m dettrain / torchrun -m dettrain"""
    env: list[str]
    """shell lines (dettrain sets the first ones itself; scripts of your own need all of them)"""
    command: str
    notes: list[str] = field(default_factory=list)
    substitutes: list[tuple[str, str]] = field(default_factory=list)
    cost: str = ""
    check: list[str] = field(default_factory=list)


class MissingAnswer(ValueError):
    pass


def _answer(name: str, given: str | None, ask) -> str:
    if given is None:
        if ask is None:
            raise MissingAnswer(f"--{name.replace('_', '-')} is needed on this path ({QUESTIONS[name][0]}); pass "
                                f"one of {'|'.join(QUESTIONS[name][1])}")
        given = ask(name)
    if given not in QUESTIONS[name][1]:
        raise ValueError(f"--{name.replace('_', '-')}={given!r}: answer one of {'|'.join(QUESTIONS[name][1])}")
    return given


def advise(bitwise: str | None = None, across: str | None = None, scale: str | None = None,
           nondet_ops: str | None = None, ask=None) -> Advice:
    """Walk the tree.  ``ask(name) -> answer`` is called for a question the path reaches and no argument answers;
    without ``ask`` a missing answer raises MissingAnswer naming the flag."""
    path: list[str] = []

    def q(name: str, given: str | None) -> str:
        a = _answer(name, given, ask)
        path.append(f"{name}={a}")
        return a

    if q("bitwise", bitwise) == "no":
        tier = 1
        scale_a = scale if scale in QUESTIONS["scale"][1] else "node"
    elif q("across", across) == "yes":
        tier = 4
        scale_a = q("scale", scale)
    else:
        scale_a = q("scale", scale)
        tier = 2 if scale_a == "gpu" else 3
    pol = policy(tier)
    nd = q("nondet_ops", nondet_ops) if pol.deterministic_ops else "no"

    overrides = [f"det.tier={tier}"]
    env: list[str] = []
    notes: list[str] = []
    if pol.pin_threads:
        overrides.append("det.threads=1")
    if pol.deterministic_ops:
        env += [f"export CUBLAS_WORKSPACE_CONFIG={CUBLAS_WORKSPACE}", "export NCCL_NVLS_ENABLE=0"]
        notes.append("dettrain exports CUBLAS_WORKSPACE_CONFIG and NCCL_NVLS_ENABLE itself when they are unset, "
                     "turns on torch.use_deterministic_algorithms, turns TF32 and cudnn.benchmark off and pins "
                     "det.threads; a script of your own needs the lines in docs/determinism.md")
    env.append("export PYTHONHASHSEED=0")
    if pol.pin_threads:
        env.append("export OMP_NUM_THREADS=1")
    if pol.seeded and not pol.deterministic_ops:
        notes.append("tier 0 (fast) differs from tier 1 only by TF32 and cudnn.benchmark: use it for speed "
                     "benchmarks, not for experiments you want to rerun")
    if pol.world_invariant:
        overrides += ["train.global_batch=<2^k x train.micro_batch>"]
        notes.append("tier 4 needs a power-of-two world size and a power-of-two number of micro-batches per step "
                     "(train.global_batch / train.micro_batch); keep train.micro_batch fixed when changing GPUs")
        notes.append("tier 4 keeps partial sums where a rank runs L micro-batches a step: up to log2(L/2) whole "
                     "fp32 gradients on the flat engine, log2(L) gradient shards of 1/W on FSDP2 (one fewer on one "
                     "rank); run few, larger micro-batches per rank (L <= 2 keeps none on the flat engine), or set "
                     "dist.offload_partials=true to keep them in host memory (tier 3's device memory, at about "
                     "0.85x the speed where L is large)")
    if scale_a == "multi":
        notes.append("every node must run the same GPU type, driver, CUDA, NCCL and torch versions; compare with "
                     "python -m dettrain.audit --reference <earlier run>")
    if pol.canonical_sum and not pol.world_invariant and scale_a != "gpu":
        notes.append("NCCL_ALGO / NCCL_PROTO need no pinning at tier 3: no floating-point sum happens inside NCCL")

    nproc = {"gpu": "1", "node": "8", "multi": "8"}[scale_a]
    launch = ("python -m dettrain" if scale_a == "gpu" and not pol.world_invariant else
              f"torchrun --nproc-per-node={nproc} -m dettrain" if scale_a != "multi" else
              f"srun torchrun --nnodes=$SLURM_NNODES --nproc-per-node={nproc} --rdzv-backend=c10d "
              "--rdzv-endpoint=$MASTER_ADDR:29500 -m dettrain")
    command = f"{launch} {' '.join(o for o in overrides if '<' not in o)}"

    substitutes: list[tuple[str, str]] = []
    check = [f"python -m dettrain.audit --tier {tier}"]
    if pol.deterministic_ops:
        check.append(f"python -m dettrain.verify det.tier={tier}")
    if nd == "yes":
        substitutes = list(SUBSTITUTES)
        notes.append("route the ops below through dettrain.detops (from dettrain import detops): they follow "
                     "torch's deterministic mode, so the same code runs fast kernels at tiers 0-1 and fixed-order "
                     "sums at tiers >= 2")
    elif nd == "unknown":
        notes.append("run the verify command below: under det.tier>=2 torch raises RuntimeError at the first op "
                     "that has no deterministic kernel, and verify names it; then route it through dettrain.detops")
    return Advice(tier=tier, name=TIERS[tier], path=path, overrides=overrides, env=env, command=command,
                  notes=notes, substitutes=substitutes, cost=COSTS[tier], check=check)


TREE = """\
Q1 Must reruns match bit for bit?                                       --bitwise
|-- no  ------------------------------------------------------------- tier 1 seeded
`-- yes
    Q2 ... also across GPU counts or after resuming onto another layout?  --across
    |-- yes --------------------------------------------------------- tier 4 invariant
    `-- no
        Q3 One GPU, one node, or many nodes?                             --scale
        |-- gpu   --------------------------------------------------- tier 2 ops
        |-- node  --------------------------------------------------- tier 3 collectives
        `-- multi --------------------------------------------------- tier 3 collectives
Q4 (tiers 2-4) Does the model use ops without deterministic kernels?    --nondet-ops
    no: nothing more | yes: route them through dettrain.detops | unknown: run dettrain.verify first"""


def format_advice(a: Advice) -> str:
    lines = [f"answers: {', '.join(a.path)}", "",
             f"=> det.tier={a.tier} ({a.name})", "",
             "overrides:", f"  {' '.join(a.overrides)}", "",
             "environment:", *(f"  {e}" for e in a.env), "",
             "command:", f"  {a.command}", "",
             f"cost: {a.cost}"]
    if a.notes:
        lines += ["", "notes:", *(f"  - {n}" for n in a.notes)]
    if a.substitutes:
        w = max(len(x) for x, _ in a.substitutes)
        lines += ["", "substitutes (dettrain.detops):", *(f"  {x:<{w}}  ->  {y}" for x, y in a.substitutes)]
    lines += ["", "check:", *(f"  {c}" for c in a.check)]
    return "\n".join(lines)


def _prompt(name: str) -> str:
    text, choices = QUESTIONS[name]
    while True:
        sys.stderr.write(f"{text} [{'/'.join(choices)}] ")
        sys.stderr.flush()
        line = sys.stdin.readline()
        if not line:
            raise MissingAnswer(f"no answer for --{name.replace('_', '-')} (stdin closed)")
        a = line.strip().lower()
        if a in choices:
            return a


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dettrain.advise", description=__doc__.split("\n\n")[0])
    for name, (text, choices) in QUESTIONS.items():
        ap.add_argument(f"--{name.replace('_', '-')}", dest=name, choices=choices, default=None, help=text)
    ap.add_argument("--json", action="store_true", help="print the advice as JSON")
    ap.add_argument("--tree", action="store_true", help="print the decision tree and exit")
    args = ap.parse_args(argv)
    if args.tree:
        print(TREE)
        return 0
    ask = _prompt if sys.stdin.isatty() else None
    try:
        a = advise(args.bitwise, args.across, args.scale, args.nondet_ops, ask=ask)
    except ValueError as e:
        print(f"dettrain.advise: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(asdict(a), indent=1) if args.json else format_advice(a))
    return 0


if __name__ == "__main__":
    sys.exit(main())
