"""``dettrain panel``: a saved wandb workspace (and, with ``--report``, a report) comparing the step hashes of every
run of one group.

    dettrain panel --entity E --project P [--group G] [--reference RUN] [--report] [--name NAME]
    dettrain panel --entity E --project P [--group G] --dry-run [--out spec.json]
    dettrain panel RUN_A RUN_B ... --out report.html|report.png      # no server: from run dirs (``local``)

The workspace (built with the ``wandb-workspaces`` package: ``pip install 'dettrain[wandb]'``) shows the runs of
group G, oldest first, and has four sections:

    fingerprints       one line panel per hash channel (per field of record/schema.py), x = step: fp24/batch
                       (data), fp24/loss_bits (loss), fp24/grad (gradients), fp24/param (parameters), fp24/opt
                       (optimizer state); the low 24 bits of each fingerprint, exact as a plotted number, so
                       the lines of two runs coincide exactly until the runs part; the reference run is drawn
                       thicker and is the runs table's baseline
    vs reference       per run: the steps equal to the reference before the first divergence and the first
                       divergence step (summary keys vs_ref/*, below); the live reference's ref/match and
                       ref/loss_ulps (runs trained with det.reference); a run comparer of the config and summary
                       differences (split view)
    loss               train/loss, eval/loss, train/grad_norm, train/lr
    throughput         perf/tokens_per_s, perf/mfu

The reference is the group's first run (the oldest), or ``--reference RUN`` (a run id or display name).  Without
``--dry-run`` the command reads every run of the group from the server, compares each with the reference step by step
as ``dettrain diff`` does, and writes the result into the run's summary, which the "vs reference" panels plot::

    vs_ref/reference         the reference's run id
    vs_ref/verdict           identical | diverged | ... (dettrain diff's verdict; the reference itself: identical)
    vs_ref/first_divergence  the first step whose fingerprints differ (null: none)
    vs_ref/first_stage       where that step first differs (data, forward/loss, gradients, ...; null: none)
    vs_ref/matching_steps    how many common steps match before the first divergence (all of them: none)
    vs_ref/compared          how many steps both runs hold

Then it saves the workspace (and the report) and prints their URLs.  Without ``--group`` it takes the group of the
project's newest dettrain run (job type train).  Online needs an API key (``wandb login`` or WANDB_API_KEY; a
server other than wandb.ai: WANDB_BASE_URL).

``--dry-run`` builds the same workspace (and report) without any network and writes its spec as JSON, to stdout or
``--out FILE``: ``{"group", "reference", "panels": [{"section", "title", "type", "keys"}], "workspace": the wandb
view spec, "report": the report spec or null}``.  Without ``--group`` the workspace shows every dettrain run of the
project (job type train) instead of one group's; the reference run is the one ``--reference`` names, else "the
group's first run" is left to the server (no baseline in the spec).

Without a server: ``dettrain panel RUN_A RUN_B ... --out FILE`` reads run dirs, ledgers or offline wandb runs
(anything ``dettrain diff`` reads), compares every run with the first as ``dettrain diff`` does, and draws
(matplotlib: ``pip install 'dettrain[plot]'``) the loss of every run per step, and per later run the agreement of
each fingerprint (data, loss, gradients, parameters, optimizer state) with the first run's at every common step,
the first divergence marked.  ``--out`` ending in ``.png`` (or ``.svg``, ``.pdf``) is the picture; ``.html`` is one
self-contained page with the picture and a table of each run's verdict.  Exit 0 on success, 2 on bad input or a
server that cannot be reached (one line naming the fix).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dettrain.errors import EXIT_USAGE, UserError
from dettrain.record import schema
from dettrain.record.wandb_io import has_api_key
from dettrain.tools.plot import pyplot

# PANELS comes from the module __getattr__ below
__all__ = ["PANELS",  # noqa: F822
           "VS_REF_KEYS", "PanelDef", "build", "main", "panel_keys", "panels", "spec", "vs_reference"]


@dataclass(frozen=True)
class PanelDef:
    """One panel: its section, title, wandb panel type and the keys it plots (history, or ``summary:KEY``)."""

    section: str
    title: str
    type: str  # line | bar | compare
    keys: tuple[str, ...] = ()


SECTIONS = ("fingerprints", "vs reference", "loss", "throughput")
VS_REF_KEYS = ("vs_ref/reference", "vs_ref/verdict", "vs_ref/first_divergence", "vs_ref/first_stage",
               "vs_ref/matching_steps", "vs_ref/compared")
"""The summary keys ``dettrain panel`` writes into every run of the group (``vs_reference``)."""

_OTHER_PANELS: tuple[PanelDef, ...] = (
    PanelDef("vs reference", "steps equal to the reference before the first divergence", "bar",
             ("summary:vs_ref/matching_steps",)),
    PanelDef("vs reference", "first divergence from the reference (step)", "bar",
             ("summary:vs_ref/first_divergence",)),
    PanelDef("vs reference", "live reference match (det.reference; 1 = same fingerprints)", "line", ("ref/match",)),
    PanelDef("vs reference", "live reference loss distance (fp32 ULPs)", "line", ("ref/loss_ulps",)),
    PanelDef("vs reference", "config and summary differences", "compare"),
    PanelDef("loss", "train loss", "line", ("train/loss",)),
    PanelDef("loss", "validation loss", "line", ("eval/loss",)),
    PanelDef("loss", "gradient norm", "line", ("train/grad_norm",)),
    PanelDef("loss", "learning rate", "line", ("train/lr",)),
    PanelDef("throughput", "tokens/s (all ranks)", "line", ("perf/tokens_per_s",)),
    PanelDef("throughput", "MFU (per device, 6N FLOPs/token, bf16 dense peak)", "line", ("perf/mfu",)),
)


def panels() -> tuple[PanelDef, ...]:
    """The layout, in order: one fingerprints panel per field of record/schema.py, then the rest; every history
    key here is one the mirror logs (wandb_io.step_row)."""
    return (*(PanelDef("fingerprints", f.panel, "line", (f"fp24/{f.key}",)) for f in schema.FIELDS),
            *_OTHER_PANELS)


def __getattr__(name: str) -> Any:
    if name == "PANELS":  # the layout as a constant, read from the schema when asked
        return panels()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

PINNED_COLUMNS = ["summary:vs_ref/verdict", "summary:vs_ref/first_divergence", "summary:vs_ref/first_stage",
                  "summary:vs_ref/matching_steps"]


def _need_workspaces() -> tuple[Any, Any, Any]:
    try:
        import wandb_workspaces.reports.v2 as wr
        import wandb_workspaces.workspaces as ws
        from wandb_workspaces import expr
    except ModuleNotFoundError as e:
        raise UserError("dettrain panel needs the wandb-workspaces package: pip install 'dettrain[wandb]' (or pip "
                        "install wandb-workspaces)") from e
    return ws, wr, expr


def _panel(wr: Any, p: PanelDef, ref_id: str | None) -> Any:
    if p.type == "compare":
        return wr.RunComparer(diff_only="split")
    if p.type == "bar":
        return wr.BarPlot(title=p.title, metrics=[wr.SummaryMetric(k.removeprefix("summary:")) for k in p.keys],
                          orientation="h", max_runs_to_show=100)
    # smoothing off: a smoothed hash line is a mix of neighbouring steps and would hide exact equality
    kw: dict[str, Any] = {}
    if ref_id is not None and p.section == "fingerprints":
        kw["line_widths"] = {f"{ref_id}:{k}": 3.0 for k in p.keys}  # the reference drawn thicker
    return wr.LinePlot(title=p.title, x="Step", y=list(p.keys), smoothing_type="none", max_runs_to_show=100, **kw)


def build(entity: str, project: str, group: str | None, reference: str | None = None, name: str | None = None,
          report: bool = False, offline: bool = False) -> tuple[Any, Any]:
    """(wandb_workspaces Workspace, Report or None) for the runs of ``group``; ``reference``: the reference's run id
    (the runs table's baseline, drawn thicker), None to leave it unset.  No network; but a report's run set looks
    up its project's server id when it is serialized, so ``offline`` leaves the run set's entity/project unset
    (the report spec of --dry-run; the report itself names them)."""
    ws, wr, expr = _need_workspaces()
    filters = [expr.Metric("Group") == group] * (group is not None) + [expr.Metric("JobType") == "train"]
    oldest_first = [expr.Ordering(expr.Metric("CreatedTimestamp"), ascending=True)]
    title = name or f"dettrain {group or project}"
    sections = [ws.Section(name=f"dettrain: {s}" + (f" {reference}" if s == "vs reference" and reference else ""),
                           panels=[_panel(wr, p, reference) for p in panels() if p.section == s], is_open=True,
                           layout_settings=ws.SectionLayoutSettings(columns=5 if s == "fingerprints" else 3))
                for s in SECTIONS]
    workspace = ws.Workspace(
        entity=entity, project=project, name=title, sections=sections,
        settings=ws.WorkspaceSettings(x_axis="Step", smoothing_type="none", max_runs=100, ignore_outliers=False),
        runset_settings=ws.RunsetSettings(filters=filters, order=oldest_first, pinned_columns=PINNED_COLUMNS,
                                          baseline_run=reference))
    rep = None
    if report:
        where = {} if offline else {"entity": entity, "project": project}
        runset = wr.Runset(**where, name=group or project, filters=filters, order=[
            wr.OrderBy("CreatedTimestamp", ascending=True)])
        which = f"group {group}" if group else "project"
        blocks: list[Any] = [wr.P(f"Every run of the wandb {which}, oldest first; reference "
                                  f"{reference or 'the oldest run'}. Hash lines coincide exactly while two runs "
                                  "agree; 'vs reference' says where each run first parts (dettrain diff's "
                                  "comparison, written by dettrain panel).")]
        for s in SECTIONS:
            blocks += [wr.H2(s), wr.PanelGrid(runsets=[runset], panels=[_panel(wr, p, reference) for p in panels()
                                                                          if p.section == s])]
        rep = wr.Report(entity=entity, project=project, title=title, width="fluid",
                        description=f"dettrain step-hash comparison of {group or project}", blocks=blocks)
    return workspace, rep


def _dump(model: Any) -> Any:
    return json.loads(model.model_dump_json(by_alias=True, exclude_none=True))


def spec(entity: str, project: str, group: str | None, reference: str | None = None, name: str | None = None,
         report: bool = False) -> dict[str, Any]:
    """The ``--dry-run`` JSON: the layout (``panels``) and the wandb specs the workspace and report save."""
    workspace, rep = build(entity, project, group, reference, name, report, offline=True)
    return {"entity": entity, "project": project, "group": group, "reference": reference,
            "panels": [{"section": p.section, "title": p.title, "type": p.type, "keys": list(p.keys)}
                       for p in panels()],
            "workspace": _dump(workspace._to_model()), "report": None if rep is None else _dump(rep._to_model())}


def panel_keys(view: Any) -> set[str]:
    """Every metric key the panels of a wandb spec name (``spec()["workspace"]`` or ``spec()["report"]``), read from
    the spec itself (each panel: a dict with a ``viewType``, its keys under ``config.metrics``): history keys as
    they are, summary keys as ``summary:KEY``."""
    keys: set[str] = set()

    def walk(x: Any) -> None:
        if isinstance(x, dict):
            if "viewType" in x and isinstance(x.get("config"), dict):
                for m in x["config"].get("metrics") or []:
                    keys.add(f"summary:{m.removeprefix('summary_metrics.')}" if m.startswith("summary_metrics.")
                             else m)
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)

    walk(view)
    return keys


# ---- the comparison each run's summary gets -----------------------------------------------------------------
def vs_reference(ref: Any, run: Any, ref_id: str) -> dict[str, Any]:
    """The ``vs_ref/*`` summary of ``run`` against ``ref`` (both ``dettrain.tools.diff.Run``): dettrain diff's
    comparison, reduced to a few numbers a bar panel can show."""
    from dettrain.tools.diff import compare

    try:
        res = compare(ref, run)
    except ValueError:  # no common steps
        return {"vs_ref/reference": ref_id, "vs_ref/verdict": "no common steps", "vs_ref/first_divergence": None,
                "vs_ref/first_stage": None, "vs_ref/matching_steps": 0, "vs_ref/compared": 0}
    first = res["first_divergence"]
    common = sorted({s["step"] for s in ref.steps} & {s["step"] for s in run.steps})
    matching = len(common) if first is None else sum(s < first for s in common)
    return {"vs_ref/reference": ref_id, "vs_ref/verdict": res["verdict"], "vs_ref/first_divergence": first,
            "vs_ref/first_stage": res.get("first_stage"), "vs_ref/matching_steps": matching,
            "vs_ref/compared": res["compared"]}


# ---- without a server: a picture or a page from run dirs -------------------------------------------------------
def draw(runs: list[Any], results: list[dict[str, Any]], out: Path) -> None:
    """The loss of every run per step, then per later run the per-step agreement of each fingerprint with the first
    run's (green equal, red different), the first divergence marked; ``results[i]``: compare(runs[0], runs[i+1])."""
    import io

    plt = pyplot("drawing the panel")
    fig, axes = plt.subplots(1 + len(results), 1, figsize=(10, 2.6 + 1.4 * len(results)), sharex=True, squeeze=False,
                             gridspec_kw={"height_ratios": [3] + [1.3] * len(results)})
    axes = axes[:, 0]
    ref = {s["step"]: s for s in runs[0].steps}
    for i, run in enumerate(runs):
        xs = [s["step"] for s in run.steps if s.get("loss") is not None]
        axes[0].plot(xs, [float(s["loss"]) for s in run.steps if s.get("loss") is not None], lw=2.2 if i == 0
                     else 1.1, ls="-" if i == 0 else "--", label=f"{'reference: ' * (i == 0)}{run.arg}")
    axes[0].set_ylabel("loss")
    axes[0].legend(fontsize=7, loc="upper right")
    for ax, run, res in zip(axes[1:], runs[1:], results):
        mine = {s["step"]: s for s in run.steps}
        common = sorted(set(ref) & set(mine))
        stages = schema.stage_names()
        grid = [[float(ref[k].get(f) == mine[k].get(f)) for k in common] for f in stages]
        ax.imshow(grid, aspect="auto", interpolation="nearest", cmap="RdYlGn", vmin=0, vmax=1,
                  extent=(common[0] - 0.5, common[-1] + 0.5, len(stages) - 0.5, -0.5))
        ax.set_yticks(range(len(stages)), list(stages.values()), fontsize=7)
        first = res["first_divergence"]
        verdict = (f"first divergence at step {first} ({res['first_stage']})" if first is not None
                   else res["verdict"])
        ax.set_title(f"{run.arg} vs the reference: {verdict}", fontsize=8, loc="left")
        if first is not None:
            for a in (axes[0], ax):
                a.axvline(first, color="red", lw=1.0, ls=":")
            axes[0].annotate(f"step {first}", (first, 1.0), xycoords=("data", "axes fraction"), color="red",
                             fontsize=7, ha="left", va="top")
    every = [s["step"] for r in runs for s in r.steps]
    axes[-1].set_xlim(min(every) - 0.5, max(every) + 0.5)  # every run's steps, not only the common ones
    axes[-1].xaxis.set_major_locator(plt.MaxNLocator(integer=True))
    axes[-1].set_xlabel("step")
    fig.suptitle("fingerprint agreement with the reference (green: equal, red: differs)", fontsize=9)
    fig.tight_layout()
    if out.suffix.lower() in (".html", ".htm"):
        svg = io.StringIO()
        fig.savefig(svg, format="svg")
        plt.close(fig)
        _atomic_write(out, _page(runs, results, svg.getvalue()).encode())
        return
    buf = io.BytesIO()
    fig.savefig(buf, format=out.suffix.lower().lstrip(".") or "png", dpi=110)
    plt.close(fig)
    _atomic_write(out, buf.getvalue())


def _page(runs: list[Any], results: list[dict[str, Any]], svg: str) -> str:
    from html import escape

    rows = "".join(
        f"<tr><td>{escape(r.arg)}</td><td>{escape(res['verdict'])}</td><td>{res['compared']}</td>"
        f"<td>{'' if res['first_divergence'] is None else res['first_divergence']}</td>"
        f"<td>{escape(res.get('first_stage') or '')}</td></tr>" for r, res in zip(runs[1:], results))
    return ("<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>dettrain panel</title><style>"
            "body{font-family:sans-serif;margin:2em}td,th{padding:2px 10px;text-align:left}</style></head><body>"
            f"<h1>dettrain panel</h1><p>reference: {escape(runs[0].arg)} ({len(runs[0].steps)} steps)</p>"
            "<table><tr><th>run</th><th>verdict</th><th>steps compared</th><th>first divergence</th>"
            f"<th>first stage</th></tr>{rows}</table>\n{svg[svg.find('<svg'):]}\n</body></html>\n")


def _atomic_write(out: Path, data: bytes) -> None:
    tmp = out.with_name(f".{out.name}.tmp")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_bytes(data)
        tmp.replace(out)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise UserError(f"--out {out}: cannot write ({e.strerror})") from e


DRAWN = (".png", ".svg", ".pdf", ".html", ".htm")


def local(args: argparse.Namespace) -> int:
    """``dettrain panel RUN_A RUN_B ... --out FILE``: compare every run with the first and draw it (no server)."""
    from dettrain.tools.diff import compare, load_run

    if len(args.runs) < 2:
        raise UserError("dettrain panel RUN_A RUN_B ...: give at least two run dirs, ledgers or wandb runs (the "
                        "first is the reference)")
    out = Path(args.out or "")
    if not args.out or out.suffix.lower() not in DRAWN:
        raise UserError(f"--out {args.out or '(missing)'}: name the file to draw, ending in .html (a page) or .png, "
                        ".svg, .pdf (a picture), e.g. --out report.html")
    if out.exists() and not args.force:
        raise UserError(f"--out {out} already exists; choose another --out, or pass --force to replace it")
    pyplot("drawing the panel")  # before reading the runs: a missing matplotlib is said first
    try:
        runs = [load_run(a) for a in args.runs]
        results = [compare(runs[0], r) for r in runs[1:]]
    except ValueError as e:
        raise UserError(str(e)) from None
    draw(runs, results, out)
    for r, res in zip(runs[1:], results):
        first = res["first_divergence"]
        print(f"{r.arg}: {res['verdict']}" + ("" if first is None else f" at step {first} ({res['first_stage']})"))
    print(f"wrote {out} (reference {runs[0].arg})")
    return 0


# ---- online ----------------------------------------------------------------------------------------------------
def _online(args: argparse.Namespace) -> int:
    if not has_api_key():
        raise UserError("dettrain panel saves a workspace on a wandb server and needs an API key: run 'wandb login' "
                        "or set WANDB_API_KEY (or pass --dry-run to write the spec as JSON without a server)")
    _need_workspaces()
    import wandb

    from dettrain.record.wandb_io import read_wandb_online
    from dettrain.tools.diff import Run

    try:
        api = wandb.Api(timeout=60)
        entity = args.entity or api.default_entity
        path = f"{entity}/{args.project}"
        group = args.group
        if group is None:
            newest = next(iter(api.runs(path, filters={"jobType": "train"}, order="-created_at", per_page=1)), None)
            if newest is None or not newest.group:
                raise UserError(f"no dettrain run with a group in {path}: pass --group G (the wandb group of the "
                                "runs to compare) or check --entity/--project")
            group = newest.group
        runs = list(api.runs(path, filters={"group": group, "jobType": "train"}, order="+created_at"))
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - network, auth, unknown project: bad input for this command
        raise UserError(f"cannot list the runs of {args.project!r} on the wandb server ({type(e).__name__}: {e}); "
                        "check --entity/--project, WANDB_BASE_URL and the API key, or pass --dry-run") from e
    if not runs:
        raise UserError(f"no dettrain runs in group {group!r} of {path}: check --group (the mirror's default group "
                        "is <exp_name>-<config hash prefix>, shown in the ledger header under wandb.group)")
    if args.reference is None:
        ref = runs[0]
    else:
        ref = next((r for r in runs if args.reference in (r.id, r.name)), None)
        if ref is None:
            raise UserError(f"--reference {args.reference!r} is no run of group {group!r} (its runs: "
                            f"{', '.join(r.id for r in runs[:10])}); pass a run id or display name of the group")
    loaded = {}
    for r in runs:
        try:
            loaded[r.id] = Run(f"{path}/{r.id}", "wandb online", f"{path}/{r.id}",
                               *read_wandb_online(f"{path}/{r.id}"))
        except ValueError as e:
            print(f"dettrain panel: skipping run {r.id} ({e})", file=sys.stderr)
    if ref.id not in loaded:
        raise UserError(f"the reference run {ref.id} has no dettrain steps; pass --reference RUN")
    results = {rid: vs_reference(loaded[ref.id], run, ref.id) for rid, run in loaded.items()}
    workspace, rep = build(entity, args.project, group, ref.id, args.name, args.report)
    try:
        for r in runs:
            if r.id in results:
                r.summary.update(results[r.id])  # the server's summary of a finished run: what the bar panels plot
        workspace.save()
        print(f"workspace: {workspace.url}")
        if rep is not None:
            rep.save()
            print(f"report: {rep.url}")
    except Exception as e:  # noqa: BLE001 - the server refused or went away: say so on one line
        raise UserError(f"saving to {path} on the wandb server failed ({type(e).__name__}: {e}); check that the key "
                        "may write to this project, or pass --dry-run") from e
    n_same = sum(v["vs_ref/verdict"] == "identical" for v in results.values())
    print(f"group {group}: {len(loaded)} runs, reference {ref.id} ({ref.name}); {n_same} identical to it")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dettrain.panel", description=(
        "Save a wandb workspace (and with --report a report) comparing the step hashes of every run of one group "
        "with its first run; --dry-run writes the spec as JSON without a server; RUN_A RUN_B ... --out FILE draws "
        "the comparison of run dirs without a server."))
    ap.add_argument("runs", nargs="*", metavar="RUN", help="run dirs, ledgers or offline wandb runs to draw "
                    "(the first is the reference); needs --out FILE (.html or .png)")
    ap.add_argument("--entity", default=os.environ.get("WANDB_ENTITY") or None,
                    help="wandb entity (team or user); default WANDB_ENTITY, online also the key's default entity")
    ap.add_argument("--project", default=os.environ.get("WANDB_PROJECT") or "dettrain",
                    help="wandb project (default WANDB_PROJECT, else dettrain: the mirror's default)")
    ap.add_argument("--group", help="wandb run group (default: the group of the project's newest dettrain run)")
    ap.add_argument("--reference", help="run id or display name to compare against (default: the group's oldest)")
    ap.add_argument("--report", action="store_true", help="also save a wandb report with the same panels")
    ap.add_argument("--name", help="workspace (and report) name (default: 'dettrain <group>')")
    ap.add_argument("--dry-run", action="store_true", help="write the spec as JSON, no network")
    ap.add_argument("--out", help="with --dry-run: write the JSON to this file (default stdout); with RUNs: the "
                    "page (.html) or picture (.png, .svg, .pdf) to draw (an existing file is refused unless --force)")
    ap.add_argument("--force", action="store_true", help="replace an existing --out")
    args = ap.parse_args(argv)
    try:
        if args.runs:
            if args.dry_run:
                raise UserError("RUNs are drawn without a server already; drop --dry-run (it writes the workspace "
                                "spec of --entity/--project)")
            return local(args)
        if args.out and not args.dry_run:
            raise UserError("--out writes the --dry-run spec; add --dry-run (or drop --out to save online)")
        if not args.dry_run:
            return _online(args)
        if not args.entity:
            raise UserError("--dry-run needs --entity E (or WANDB_ENTITY): the workspace spec names its entity")
        text = json.dumps(spec(args.entity, args.project, args.group, args.reference, args.name, args.report),
                          indent=1) + "\n"
        if args.out:
            out = Path(args.out)
            if out.is_dir():
                raise UserError(f"--out {out} is a directory; name the JSON file to write (e.g. {out / 'spec.json'})")
            if (out.exists() or out.is_symlink()) and not args.force:
                raise UserError(f"--out {out} already exists; choose another --out, or pass --force to replace it")
            tmp = out.with_name(f".{out.name}.tmp")
            try:  # beside it, then renamed: a failed write never leaves half a file under the name
                tmp.write_text(text)
                tmp.replace(out)
            except OSError as e:
                tmp.unlink(missing_ok=True)
                raise UserError(f"--out {args.out}: cannot write ({e.strerror})") from None
            print(f"wrote {args.out} ({len(panels())} panels, {f'group {args.group}' if args.group else 'every run'})")
        else:
            sys.stdout.write(text)
    except UserError as e:
        print(f"dettrain panel: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    return 0


if __name__ == "__main__":
    sys.exit(main())
