"""``dettrain panel``: a saved wandb workspace (and, with ``--report``, a report) comparing the step hashes of every
run of one group.

    dettrain panel --entity E --project P [--group G] [--reference RUN] [--report] [--name NAME]
    dettrain panel --entity E --project P --group G --dry-run [--out spec.json]

The workspace (built with the ``wandb-workspaces`` package: ``pip install 'dettrain[wandb]'``) shows the runs of
group G, oldest first, and has four sections:

    fingerprints       one line panel per hash channel, x = step: fp24/batch (data), fp24/loss_bits (loss),
                       fp24/grad (gradients), fp24/param (parameters), fp24/opt (optimizer state); the low 24 bits
                       of each fingerprint, exact as a plotted number, so the lines of two runs coincide exactly
                       until the runs part; the reference run is drawn thicker and is the runs table's baseline
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
view spec, "report": the report spec or null}``.  It needs ``--group``; the reference run is the one ``--reference``
names, else "the group's first run" is left to the server (no baseline in the spec).  Exit 0 on success, 2 on bad
input or a server that cannot be reached (one line naming the fix).
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
from dettrain.record.wandb_io import has_api_key

__all__ = ["PANELS", "VS_REF_KEYS", "PanelDef", "build", "main", "panel_keys", "spec", "vs_reference"]


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

PANELS: tuple[PanelDef, ...] = (
    PanelDef("fingerprints", "data (batch fingerprint, low 24 bits)", "line", ("fp24/batch",)),
    PanelDef("fingerprints", "loss (fp32 bits, low 24)", "line", ("fp24/loss_bits",)),
    PanelDef("fingerprints", "gradients (low 24 bits)", "line", ("fp24/grad",)),
    PanelDef("fingerprints", "parameters (low 24 bits)", "line", ("fp24/param",)),
    PanelDef("fingerprints", "optimizer state (low 24 bits)", "line", ("fp24/opt",)),
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
"""The layout, in order; every history key here is one the mirror logs (wandb_io.step_row)."""

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


def build(entity: str, project: str, group: str, reference: str | None = None, name: str | None = None,
          report: bool = False, offline: bool = False) -> tuple[Any, Any]:
    """(wandb_workspaces Workspace, Report or None) for the runs of ``group``; ``reference``: the reference's run id
    (the runs table's baseline, drawn thicker), None to leave it unset.  No network; but a report's run set looks
    up its project's server id when it is serialized, so ``offline`` leaves the run set's entity/project unset
    (the report spec of --dry-run; the report itself names them)."""
    ws, wr, expr = _need_workspaces()
    filters = [expr.Metric("Group") == group, expr.Metric("JobType") == "train"]
    oldest_first = [expr.Ordering(expr.Metric("CreatedTimestamp"), ascending=True)]
    title = name or f"dettrain {group}"
    sections = [ws.Section(name=f"dettrain: {s}" + (f" {reference}" if s == "vs reference" and reference else ""),
                           panels=[_panel(wr, p, reference) for p in PANELS if p.section == s], is_open=True,
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
        runset = wr.Runset(**where, name=group, filters=filters, order=[
            wr.OrderBy("CreatedTimestamp", ascending=True)])
        blocks: list[Any] = [wr.P(f"Every run of the wandb group {group}, oldest first; reference "
                                  f"{reference or 'the oldest run'}. Hash lines coincide exactly while two runs "
                                  "agree; 'vs reference' says where each run first parts (dettrain diff's "
                                  "comparison, written by dettrain panel).")]
        for s in SECTIONS:
            blocks += [wr.H2(s), wr.PanelGrid(runsets=[runset], panels=[_panel(wr, p, reference) for p in PANELS
                                                                          if p.section == s])]
        rep = wr.Report(entity=entity, project=project, title=title, width="fluid",
                        description=f"dettrain step-hash comparison of group {group}", blocks=blocks)
    return workspace, rep


def _dump(model: Any) -> Any:
    return json.loads(model.model_dump_json(by_alias=True, exclude_none=True))


def spec(entity: str, project: str, group: str, reference: str | None = None, name: str | None = None,
         report: bool = False) -> dict[str, Any]:
    """The ``--dry-run`` JSON: the layout (``panels``) and the wandb specs the workspace and report save."""
    workspace, rep = build(entity, project, group, reference, name, report, offline=True)
    return {"entity": entity, "project": project, "group": group, "reference": reference,
            "panels": [{"section": p.section, "title": p.title, "type": p.type, "keys": list(p.keys)}
                       for p in PANELS],
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
        "with its first run; --dry-run writes the spec as JSON without a server."))
    ap.add_argument("--entity", default=os.environ.get("WANDB_ENTITY") or None,
                    help="wandb entity (team or user); default WANDB_ENTITY, online also the key's default entity")
    ap.add_argument("--project", default=os.environ.get("WANDB_PROJECT") or "dettrain",
                    help="wandb project (default WANDB_PROJECT, else dettrain: the mirror's default)")
    ap.add_argument("--group", help="wandb run group (default: the group of the project's newest dettrain run)")
    ap.add_argument("--reference", help="run id or display name to compare against (default: the group's oldest)")
    ap.add_argument("--report", action="store_true", help="also save a wandb report with the same panels")
    ap.add_argument("--name", help="workspace (and report) name (default: 'dettrain <group>')")
    ap.add_argument("--dry-run", action="store_true", help="write the spec as JSON, no network")
    ap.add_argument("--out", help="with --dry-run: write the JSON to this file (default stdout; an existing file "
                    "is refused unless --force)")
    ap.add_argument("--force", action="store_true", help="with --out: replace an existing file")
    args = ap.parse_args(argv)
    try:
        if args.out and not args.dry_run:
            raise UserError("--out writes the --dry-run spec; add --dry-run (or drop --out to save online)")
        if not args.dry_run:
            return _online(args)
        if not args.group:
            raise UserError("--dry-run needs --group G (without a server there is no newest run to take it from)")
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
            print(f"wrote {args.out} ({len(PANELS)} panels, group {args.group})")
        else:
            sys.stdout.write(text)
    except UserError as e:
        print(f"dettrain panel: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    return 0


if __name__ == "__main__":
    sys.exit(main())
