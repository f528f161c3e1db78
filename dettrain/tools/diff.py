"""Compare two runs step by step and say exactly where they part.

    python -m dettrain.diff RUN_A RUN_B [--plot out.png] [--context N] [--json] [--common-only]

Each argument is a run dir (its ``ledger.jsonl``; a run dir without a ledger falls back to its wandb offline run),
a ledger file, a wandb offline run (``run-<id>.wandb``, ``wandb/offline-run-*`` or a ``wandb/`` dir), or an online
wandb run (``wandb:ENTITY/PROJECT/RUN_ID``, a run URL, or ``ENTITY/PROJECT/RUN_ID`` when no such path exists; needs
an API key).

The report names the first step whose fingerprints differ and, of the fingerprints a step computes in this order
(as dettrain/record/schema.py declares them, with the labels and widths of the table's columns)::

    batch (data) -> loss_bits (loss) -> grad (gradients) -> param (parameters) -> opt (optimizer state)

the first that differs: everything before it was equal, so the cause lies in the stage that produced it.  It adds the
tensor names whose per-tensor fingerprints differ (when both runs have them at that step), the loss difference in
ULPs of fp32, a table of the steps around the divergence, and the differences of the two ledger headers (config,
versions, world size, threads, audit), which often explain the divergence.

Validation losses (``val_loss_bits`` on the step lines of evaluating steps, ``eval.every``) are compared too, after
the training fingerprints: runs whose every training fingerprint is equal but whose validation loss differs at some
step (another ``eval.batches`` or validation data, or a nondeterministic evaluation) are reported as a validation
divergence at that step, with the difference in ULPs, and are not identical; so are runs that evaluate at different
steps.

IDENTICAL means more than equal fingerprints at the common steps: both runs hold the same steps, each exactly once,
with no gap, and each is one run (a wandb dir stitched from two runs is not).  A shorter run, a gap, a duplicated
step or a stitched wandb run is reported and exits 1; ``--common-only`` compares only the steps both runs hold and
exits 0 when those are equal (the report still lists what it left out).  A step that one run holds twice with
different fingerprints is never identical.

When both arguments are the same file (after resolving paths and links), the report says so: equal by construction.

Exit status: 0 identical, 1 diverged or not the same steps, 2 bad input (missing or malformed run, a step line
without its fields, no common step).

Two trace files of ``dettrain trace`` (or the base names of their rank files) are compared record by record
instead: the first module and op whose output differs (dettrain/tools/trace.py, same exit codes).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dettrain.errors import UserError
from dettrain.record import schema
from dettrain.record.ledger import (
    LEDGER_NAME,
    config_differences,
    differing_fields,
    flatten,
    read_ledger,
    tensor_diff,
    ulps,
)

# STAGES, STAGE_NAME and WHY come from the module __getattr__ below
__all__ = ["STAGES", "STAGE_NAME", "WHY",  # noqa: F822
           "COMPILE_HINT", "Run", "compare", "compile_note", "config_differences", "differing_fields",
           "environment_differences", "integrity", "load_run", "main", "plot", "render", "tensor_diff", "ulps"]



def __getattr__(name: str) -> Any:
    """STAGES ((key, stage) pairs), STAGE_NAME ({key: stage}) and WHY ({key: likely cause}) of the fingerprint
    fields, read from record/schema.py when asked."""
    if name == "WHY":
        return {f.key: f.why for f in schema.FIELDS}
    if name in ("STAGES", "STAGE_NAME"):
        names = schema.stage_names()
        return names if name == "STAGE_NAME" else tuple(names.items())
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ---- loading ----------------------------------------------------------------------------------------------
@dataclass
class Run:
    arg: str
    source: str  # ledger | wandb offline | wandb online
    path: str
    header: dict
    steps: list[dict]


def load_run(arg: str) -> Run:
    """Read one argument of the CLI; ValueError with the argument and the fix on bad input."""
    from dettrain.record import wandb_io

    p = Path(arg)
    if p.exists() and not p.is_file() and not p.is_dir():
        raise ValueError(f"{arg} is not a regular file (a device, a pipe?); pass a run dir, a ledger file or a "
                         "wandb run")
    from dettrain.tools.trace import is_trace_arg

    if is_trace_arg(arg):
        raise ValueError(f"{arg} is a trace of one step (dettrain trace); diff compares two ledgers, or two traces: "
                         "pass a trace on both sides, or a run dir / ledger on both")
    if p.is_file():
        if p.suffix == ".wandb":
            return Run(arg, "wandb offline", str(p), *wandb_io.read_wandb_run(p))
        return Run(arg, "ledger", str(p), *read_ledger(p))
    if p.is_dir():
        if (p / LEDGER_NAME).is_file():
            return Run(arg, "ledger", str(p / LEDGER_NAME), *read_ledger(p))
        files = wandb_io.wandb_files(p)
        if files:
            return Run(arg, "wandb offline", str(files[-1]), *wandb_io.read_wandb_run(p))
        raise ValueError(f"{arg} is a directory without {LEDGER_NAME} or a wandb offline run; pass a dettrain run "
                         "dir, a ledger file or a wandb run")
    online = wandb_io.online_path(arg)
    if online is None:
        raise ValueError(f"{arg}: no such file or directory (expected a run dir, a ledger file, a wandb offline "
                         "run, or wandb:ENTITY/PROJECT/RUN_ID)")
    if not wandb_io.has_api_key():
        raise ValueError(f"{arg}: no such file or directory, and reading it as the online wandb run {online} needs "
                         "an API key ('wandb login' or WANDB_API_KEY)")
    return Run(arg, "wandb online", online, *wandb_io.read_wandb_online(online))


def _env(h: dict) -> dict[str, Any]:
    flat = flatten({k: v for k, v in h.items() if k not in ("kind", "config", "wandb", "audit")})
    audit = h.get("audit")
    for row in audit if isinstance(audit, list) else []:
        if isinstance(row, dict):
            flat[f"audit.{row.get('name')}"] = row.get("value")
    return flat


def environment_differences(ha: dict, hb: dict) -> list[tuple[str, Any, Any]]:
    """(key, A, B) for header fields outside the config that differ: versions, world size, threads, audit ..."""
    ea, eb = _env(ha), _env(hb)
    keys = list(ea) + [k for k in eb if k not in ea]
    return [(k, ea.get(k), eb.get(k)) for k in keys if ea.get(k) != eb.get(k)]


COMPILE_HINT = "compiled and eager runs may differ by an ulp (FMA contraction)"


def compile_note(ha: dict, hb: dict) -> str | None:
    """The hint when one run was compiled (train.compile) and the other not: their bits are not promised equal."""
    def enabled(h: dict):
        c = h.get("compile")
        if isinstance(c, dict) and "enabled" in c:
            return bool(c["enabled"])
        return ((h.get("config") or {}).get("train") or {}).get("compile")  # older headers: the configured value

    ea, eb = enabled(ha), enabled(hb)
    if ea == eb:
        return None
    side = lambda v: "compiled" if v is True else "eager" if v is False else repr(v)  # noqa: E731
    return f"train.compile differs (A {side(ea)}, B {side(eb)}): {COMPILE_HINT}"


# ---- the comparison ---------------------------------------------------------------------------------------
def _span(steps: list[int]) -> str:
    return f"steps {steps[0]}..{steps[-1]} ({len(steps)})" if steps else "no steps"


def _ranges(steps: list[int]) -> str:
    """Sorted step numbers as compact ranges: 3, 5..9, 12."""
    out, i = [], 0
    while i < len(steps):
        j = i
        while j + 1 < len(steps) and steps[j + 1] == steps[j] + 1:
            j += 1
        out.append(str(steps[i]) if i == j else f"{steps[i]}..{steps[j]}")
        i = j + 1
    shown = out[:10]
    return ", ".join(shown) + (f" ... ({len(out) - 10} more ranges)" if len(out) > 10 else "")


def integrity(run: Run, side: str) -> tuple[list[str], list[str]]:
    """(problems, conflicts) of one run's step list: duplicated steps, gaps, steps out of order, a stitched wandb
    run; conflicts are steps held twice with different fingerprints (never identical, even with --common-only)."""
    problems, conflicts = [], []
    seq = [s["step"] for s in run.steps]
    copies: dict[int, list[dict]] = {}
    for s in run.steps:
        copies.setdefault(s["step"], []).append(s)
    dups = sorted(k for k, v in copies.items() if len(v) > 1)
    clash = [k for k in dups if any(differing_fields(copies[k][0], c) for c in copies[k][1:])]
    if dups:
        problems.append(f"{side} holds steps more than once: {_ranges(dups)}")
    if clash:
        conflicts.append(f"{side} holds different fingerprints for the same step: {_ranges(clash)}")
    if run.source == "ledger" and any(b < a for a, b in zip(seq, seq[1:])):
        problems.append(f"{side}'s step lines are not in increasing order")
    if seq:
        have = set(seq)
        gaps = [k for k in range(min(have), max(have) + 1) if k not in have]
        if gaps:
            problems.append(f"{side} has gaps: steps {_ranges(gaps)} are missing")
    runs = (run.header.get("wandb") or {}).get("runs") if isinstance(run.header.get("wandb"), dict) else None
    if isinstance(runs, list) and len(runs) > 1:
        problems.append(f"{side} is stitched from {len(runs)} different wandb runs ({', '.join(map(str, runs))}); "
                        "pass one run-<id>.wandb file to read one run")
    return problems, conflicts


def _same_file(a: Run, b: Run) -> bool:
    """Both sides are one file (after resolving paths and links): equal by construction, which a report must say."""
    if "online" in a.source or "online" in b.source:
        return a.path == b.path
    try:
        return os.path.samefile(a.path, b.path)
    except OSError:
        return False


def compare(a: Run, b: Run, context: int = 3, common_only: bool = False) -> dict[str, Any]:
    """The comparison of two runs as a JSON-able dict (what the CLI prints, and prints with --json)."""
    sa = {s["step"]: s for s in a.steps}  # the last line of a step held twice (such runs are reported, below)
    sb = {s["step"]: s for s in b.steps}
    common = sorted(set(sa) & set(sb))
    res: dict[str, Any] = {
        "a": {"arg": a.arg, "source": a.source, "path": a.path, "steps": len(sa), "span": _span(sorted(sa))},
        "b": {"arg": b.arg, "source": b.source, "path": b.path, "steps": len(sb), "span": _span(sorted(sb))},
        "compared": len(common),
        "common_only": common_only,
        "config_differences": config_differences(a.header, b.header),
        "environment_differences": environment_differences(a.header, b.header),
    }
    note = compile_note(a.header, b.header)
    if note:
        res["compile_note"] = note
    res["same_file"] = _same_file(a, b)
    problems, conflicts = [], []
    for run, side in ((a, "A"), (b, "B")):
        p, c = integrity(run, side)
        problems += p
        conflicts += c
    if sorted(sa) != sorted(sb):
        res["length_note"] = (f"the runs have different steps (A: {_span(sorted(sa))}, B: {_span(sorted(sb))}); "
                              f"compared the {len(common)} common steps only")
        only_a, only_b = sorted(set(sa) - set(sb)), sorted(set(sb) - set(sa))
        problems.append("the runs hold different steps (" + "; ".join(
            [f"only in A: {_ranges(only_a)}"] * bool(only_a) + [f"only in B: {_ranges(only_b)}"] * bool(only_b))
            + f"); {len(common)} steps are common")
    res["problems"], res["conflicts"] = problems, conflicts
    if not common:
        raise ValueError(f"no common steps to compare (A: {_span(sorted(sa))}, B: {_span(sorted(sb))})")
    first = next((s for s in common if differing_fields(sa[s], sb[s])), None)
    # validation losses: the first common step where both evaluated and differ; steps where only one evaluated
    vfirst = next((s for s in common if "val_loss_bits" in sa[s] and "val_loss_bits" in sb[s]
                   and sa[s]["val_loss_bits"] != sb[s]["val_loss_bits"]), None)
    vonly = [s for s in common if ("val_loss_bits" in sa[s]) != ("val_loss_bits" in sb[s])]
    res["val_compared"] = sum("val_loss_bits" in sa[s] and "val_loss_bits" in sb[s] for s in common)
    res["val_divergence"] = None if vfirst is None else {
        "step": vfirst, "val_loss_a": sa[vfirst].get("val_loss"), "val_loss_b": sb[vfirst].get("val_loss"),
        "ulps": ulps(sa[vfirst]["val_loss_bits"], sb[vfirst]["val_loss_bits"])}
    res["val_note"] = (f"a validation loss in one run only at steps {_ranges(vonly)} (the runs evaluate at "
                       "different steps: eval.every)") if vonly else None
    # identical: equal fingerprints at every common step, and the same steps each once (or --common-only asked
    # to look at the common steps alone); a step held twice with different fingerprints is never identical;
    # nor are runs whose validation losses differ or were taken at different steps
    res["identical"] = (first is None and vfirst is None and not vonly and not conflicts
                        and (common_only or not problems))
    res["verdict"] = ("identical" if res["identical"] else "diverged" if first is not None else
                      "conflicting steps" if conflicts else "validation loss differs" if vfirst is not None else
                      "validation steps differ" if vonly else "different steps")
    res["first_divergence"] = first
    if first is not None:
        x, y = sa[first], sb[first]
        fields = differing_fields(x, y)
        stages, lead = schema.stage_names(), schema.field(fields[0])
        res.update(first_field=lead.key, first_stage=lead.stage, why=lead.why, fields=fields,
                   equal_before=[stages[f] for f in schema.keys()[: schema.keys().index(lead.key)]],
                   loss_a=x.get("loss"), loss_b=y.get("loss"), loss_ulps=ulps(x.get("loss_bits"), y.get("loss_bits")),
                   lr_a=x.get("lr"), lr_b=y.get("lr"), tensors=tensor_diff(x, y),
                   tensors_available={"a": bool(x.get("tensors")), "b": bool(y.get("tensors"))})
        i = common.index(first)
        window = common[max(0, i - context) : i + context + 1]
    else:
        window = common[-min(len(common), 2 * context + 1) :]
    res["table"] = [{"step": s, "equal": {f: sa[s].get(f) == sb[s].get(f) for f in schema.keys()},
                     "loss_a": sa[s].get("loss"), "loss_b": sb[s].get("loss"),
                     "ulps": ulps(sa[s].get("loss_bits"), sb[s].get("loss_bits"))} for s in window]
    return res


# ---- text report ------------------------------------------------------------------------------------------
def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return repr(v)
    return json.dumps(v) if not isinstance(v, str) else v


def _loss(v: Any) -> str:
    return "-" if v is None else f"{v:.9g}"  # 9 significant digits tell any two fp32 values apart


def _names(names: list[str], limit: int = 8) -> str:
    more = f" ... and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def render(res: dict[str, Any]) -> str:
    out = []
    for side in ("a", "b"):
        r = res[side]
        out.append(f"{side.upper()}: {r['arg']}  ({r['source']}: {r['path']}, {r['span']})")
    for title, key in (("config", "config_differences"), ("environment", "environment_differences")):
        diffs = res[key]
        if not diffs:
            out.append(f"{title}: identical")
            continue
        out.append(f"{title}: {len(diffs)} difference{'s' * (len(diffs) != 1)} (A | B)")
        width = min(max(len(k) for k, _, _ in diffs), 40)
        out += [f"  {k:<{width}}  {_fmt(va)} | {_fmt(vb)}" for k, va, vb in diffs[:30]]
        if len(diffs) > 30:
            out.append(f"  ... and {len(diffs) - 30} more")
    if res.get("compile_note"):
        out.append(f"hint: {res['compile_note']}")
    if res.get("same_file"):
        out.append(f"note: A and B are the same file ({res['a']['path']}): they are equal by construction, which "
                   "says nothing about reproducibility; compare two runs")
    for note in res["problems"] + res["conflicts"] + [res["val_note"]] * bool(res.get("val_note")):
        out.append(f"note: {note}")
    vd = res.get("val_divergence")
    if res["identical"]:
        scope = (f"the {res['compared']} common steps (--common-only)" if res["problems"] else
                 f"{res['compared']} compared steps")
        val = f", and the validation loss at {res['val_compared']} evaluations" if res.get("val_compared") else ""
        stages = ", ".join(schema.stage_names().values())
        out.append(f"IDENTICAL: every fingerprint ({stages}) equal over {scope}{val}")
    elif res["first_divergence"] is None and not res["conflicts"] and (vd or res.get("val_note")):
        if vd:
            u = vd["ulps"]
            out.append(f"DIVERGED in the validation loss at step {vd['step']}: every training fingerprint equal, "
                       "the validation loss differs (eval.batches, the validation data, or the evaluation itself)")
            out.append(f"  val loss: {vd['val_loss_a']!r} | {vd['val_loss_b']!r}  ({'?' if u is None else u} ULPs "
                       "of fp32)")
        else:
            out.append("NOT IDENTICAL: every training fingerprint equal, but the runs evaluate at different steps "
                       "(see the note)")
    elif res["first_divergence"] is None:
        out.append(f"NOT IDENTICAL: the fingerprints of the {res['compared']} common steps are equal, but "
                   + ("a run holds different results for one step" if res["conflicts"] else
                      "the runs do not hold the same steps, each once (see the notes); --common-only compares "
                      "the common steps alone"))
    else:
        k = res["first_divergence"]
        before = ", ".join(res["equal_before"])
        out.append(f"DIVERGED at step {k}: {res['first_stage']} diverged first"
                   + (f" ({before} equal)" if before else ""))
        out.append(f"  why: {res['why']}")
        out.append("  differing at this step: " + ", ".join(schema.stage_names()[f] for f in res["fields"]))
        if res["lr_a"] != res["lr_b"]:
            out.append(f"  lr differs: {res['lr_a']!r} | {res['lr_b']!r}")
        u = res["loss_ulps"]
        out.append(f"  loss: {res['loss_a']!r} | {res['loss_b']!r}  ({'?' if u is None else u} ULPs of fp32)")
        t = res["tensors"]
        if t is None:
            have = res["tensors_available"]
            out.append(f"  tensors: no per-tensor fingerprints at step {k} in "
                       + " and ".join(s.upper() for s in "ab" if not have[s])
                       + " (record them with log.tensor_every=1, or det.reference=<A> on B's rerun)")
        else:
            for kind, names in t.items():
                out.append(f"  tensors ({kind}): {len(names)} differ" + (f": {_names(names)}" if names else ""))
        if vd:
            out.append(f"  val loss first differs at step {vd['step']}: {vd['val_loss_a']!r} | {vd['val_loss_b']!r}")
    out.append("")
    # one column per fingerprint field, labels and widths as record/schema.py declares them
    columns = " ".join(f"{f.label:>{f.width}}" for f in schema.FIELDS)
    out.append(f" step | {columns} |           loss A           loss B |      ULPs")
    for row in res["table"]:
        marks = " ".join(f"{'=' if row['equal'][f.key] else 'X':>{f.width}}" for f in schema.FIELDS)
        u = row["ulps"]
        mark = " <- first divergence" if row["step"] == res["first_divergence"] else ""
        out.append(f"{row['step']:>5} | {marks[1:]} | {_loss(row['loss_a']):>16} {_loss(row['loss_b']):>16} | "
                   f"{'?' if u is None else u:>9}{mark}")
    return "\n".join(out)


# ---- plot -------------------------------------------------------------------------------------------------
def plot(a: Run, b: Run, res: dict[str, Any], out: str | Path) -> None:
    """Per-step match of each fingerprint, the two loss curves and |loss A - loss B| (matplotlib, PNG)."""
    import numpy as np

    from dettrain.tools.plot import pyplot

    plt = pyplot("diff --plot")
    import matplotlib

    sa = {s["step"]: s for s in a.steps}
    sb = {s["step"]: s for s in b.steps}
    common = sorted(set(sa) & set(sb))
    stages = schema.stage_names()
    match = np.array([[sa[s].get(f) == sb[s].get(f) for s in common] for f in stages], dtype=float)
    la = np.array([math.nan if sa[s].get("loss") is None else float(sa[s]["loss"]) for s in common])
    lb = np.array([math.nan if sb[s].get("loss") is None else float(sb[s]["loss"]) for s in common])
    fig, axes = plt.subplots(3, 1, figsize=(9, 7), sharex=True, gridspec_kw={"height_ratios": [1.2, 2, 2]})
    ext = (common[0] - 0.5, common[-1] + 0.5, len(stages) - 0.5, -0.5)
    axes[0].imshow(match, aspect="auto", interpolation="nearest", cmap="RdYlGn", vmin=0, vmax=1, extent=ext)
    axes[0].set_yticks(range(len(stages)), list(stages.values()))
    axes[0].set_title("per-step match (green: equal fingerprint, red: differs)")
    axes[1].plot(common, la, label=f"A: {a.arg}", lw=1.5)
    axes[1].plot(common, lb, label=f"B: {b.arg}", lw=1.0, ls="--")
    axes[1].set_ylabel("loss")
    axes[1].legend(fontsize=7, loc="upper right")
    axes[2].plot(common, np.abs(la - lb), marker=".", lw=1)
    axes[2].set_yscale("symlog", linthresh=1e-9)
    axes[2].set_ylabel("|loss A - loss B|")
    axes[2].set_xlabel("step")
    axes[2].xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    if res["first_divergence"] is not None:
        for ax in axes:
            ax.axvline(res["first_divergence"], color="red", lw=0.8, ls=":")
    fig.suptitle("identical" if res["identical"] else
                 f"first divergence: step {res['first_divergence']} ({res['first_stage']})")
    fig.tight_layout()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


# ---- CLI --------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dettrain.diff", description=__doc__.split("\n\n")[0],
                                 epilog="exit status: 0 identical, 1 diverged, 2 bad input")
    ap.add_argument("run_a", help="run dir, ledger file, wandb offline run, or wandb:ENTITY/PROJECT/RUN_ID")
    ap.add_argument("run_b", help="the run to compare with RUN_A (same kinds of input)")
    ap.add_argument("--plot", metavar="PNG", help="draw per-step match and |loss difference| into this file")
    ap.add_argument("--context", type=int, default=3, help="steps shown on each side of the divergence (3)")
    ap.add_argument("--json", action="store_true", help="print the comparison as JSON instead of text")
    ap.add_argument("--common-only", action="store_true",
                    help="compare only the steps both runs hold: a shorter run, gaps or a duplicated (equal) step "
                    "are noted but do not make the runs differ")
    args = ap.parse_args(argv)
    from dettrain.tools.trace import compare_main, is_trace_arg

    if args.plot:  # a missing matplotlib is said before any comparison (exit 2, the extra to install)
        from dettrain.tools.plot import pyplot

        try:
            pyplot("diff --plot")
        except UserError as e:
            print(f"dettrain.diff: error: {e}", file=sys.stderr)
            return 2

    if is_trace_arg(args.run_a) and is_trace_arg(args.run_b):  # two traces of one step (dettrain trace)
        return compare_main(args.run_a, args.run_b, as_json=args.json)
    try:
        a, b = load_run(args.run_a), load_run(args.run_b)
        res = compare(a, b, max(args.context, 0), common_only=args.common_only)
    except ValueError as e:
        print(f"dettrain.diff: error: {e}", file=sys.stderr)
        return 2
    _emit(json.dumps(res, indent=1) if args.json else render(res))
    if args.plot:
        plot(a, b, res, args.plot)
        if not args.json:
            _emit(f"plot: {args.plot}")
    return 0 if res["identical"] else 1


def _emit(text: str) -> None:
    """Print to stdout; a reader that went away (``| head``) ends the output quietly, not the exit status."""
    try:
        print(text)
        sys.stdout.flush()
    except BrokenPipeError:
        # nothing more can be shown; point stdout at /dev/null so the flush at exit cannot fail again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


if __name__ == "__main__":
    sys.exit(main())
