"""``python -m dettrain.audit``: check this environment against a determinism tier, with the fix for every failure.

    python -m dettrain.audit [--tier N] [--threads T] [--world W] [--attention A] [--reference RUN] [--as-is]
                             [--json PATH|-]

By default the audit first does what a dettrain run does at start-up (``set_env_before_cuda`` and ``apply_tier``),
so what can still fail is what dettrain cannot fix for you: a conflicting variable already exported in the shell
(CUBLAS_WORKSPACE_CONFIG, NCCL_*; dettrain never overrides an exported value), versions or devices that differ from
a reference run.  ``--as-is`` audits the process without applying anything: the failures are then the checklist for
a script of your own (see docs/determinism.md), and each row's fix is the line to add.

The same rows (``dettrain.determinism.audit``) go into every run's ledger header.  Rows have a level: ``required``
rows can change dettrain's bits at that tier and fail the audit (exit 1); ``advice`` rows are printed as WARN with
their fix; ``info`` rows record versions and which attention a run with det.attention=A would use on this machine
(``dettrain.models.attention.resolve``).  Exit 0 when every required row passes, 1 when one fails, 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from dettrain.determinism import DetConfig, apply_tier, audit, audit_failures, set_env_before_cuda
from dettrain.tiers import TIERS, is_tier, not_a_tier, policy

__all__ = ["STATUS", "format_rows", "main"]

STATUS = {"required": "FAIL", "advice": "WARN", "info": "FAIL"}


def format_rows(rows: list[dict], tier: int) -> str:
    """A table: status, name, value, wanted value; failed rows are followed by their fix."""
    lines = [f"dettrain audit against tier {tier} ({TIERS[tier]})", ""]
    w = max(len(r["name"]) for r in rows)
    for r in rows:
        status = "ok" if r["ok"] else STATUS.get(r.get("level", "required"), "FAIL")
        if r.get("level") == "info" and r["ok"]:
            status = "info"
        value = "''" if r["value"] == "" else r["value"]
        lines.append(f"  {status:<4}  {r['name']:<{w}}  {value!s:<24}  want {r['want']}")
        if not r["ok"] and r["fix"]:
            lines.append(f"        fix: {r['fix']}")
    bad = audit_failures(rows)
    warn = [r for r in rows if not r["ok"] and r not in bad]
    lines.append("")
    lines.append(f"{'PASS' if not bad else 'FAIL'}: {len(bad)} required check(s) failed, {len(warn)} advice "
                 f"warning(s)")
    return "\n".join(lines)


def _attention(tier: int, setting: str):
    """det.attention resolved as a run of the default config on this machine's first device would
    (dettrain/loop/resolve.py, with the default det.batch_invariant and train.compile); the error text when the
    setting cannot run here."""
    import torch

    from dettrain.config import Config
    from dettrain.errors import UserError
    from dettrain.loop.resolve import resolve

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return resolve(Config(det=DetConfig(tier=tier, attention=setting)), device).attention
    except UserError as e:
        return str(e)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dettrain.audit", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tier", type=int, default=DetConfig.tier, help="det.tier to check against (default 3)")
    ap.add_argument("--threads", type=int, default=DetConfig.threads, help="det.threads of the run (default 1)")
    ap.add_argument("--world", type=int, default=None, help="ranks of the run (default $WORLD_SIZE or 1)")
    ap.add_argument("--attention", default=DetConfig.attention, choices=("auto", "dettrain", "torch"),
                    help="det.attention of the run (default auto): its resolved choice is recorded as a row")
    ap.add_argument("--reference", default=None,
                    help="run dir or ledger of a reference run: versions, devices and world size must match it")
    ap.add_argument("--as-is", action="store_true",
                    help="audit this process without applying dettrain's start-up settings first")
    ap.add_argument("--json", default=None, metavar="PATH", help="also write the rows as JSON ('-' for stdout)")
    args = ap.parse_args(argv)
    if not is_tier(args.tier):
        print(f"dettrain.audit: error: {not_a_tier(args.tier, '--tier')}", file=sys.stderr)
        return 2
    if policy(args.tier).pin_threads and args.threads <= 0:
        print(f"dettrain.audit: error: --threads {args.threads}: tier {args.tier} pins a positive thread count",
              file=sys.stderr)
        return 2
    reference = None
    if args.reference:
        from dettrain.record.ledger import read_ledger

        try:
            reference, _ = read_ledger(args.reference)
        except ValueError as e:
            print(f"dettrain.audit: error: --reference: {e}", file=sys.stderr)
            return 2
    if not args.as_is:
        set_env_before_cuda(args.tier)
        apply_tier(DetConfig(tier=args.tier, threads=args.threads))
    world = args.world if args.world is not None else int(os.environ.get("WORLD_SIZE", 1))
    choice = _attention(args.tier, args.attention)
    if isinstance(choice, str):
        print(f"dettrain.audit: error: {choice}", file=sys.stderr)
        return 2
    rows = audit(args.tier, threads=args.threads, world=world, reference=reference, attention=choice.header())
    out = {"tier": args.tier, "as_is": args.as_is, "pass": not audit_failures(rows), "rows": rows,
           "attention": choice.header()}
    if args.json == "-":
        print(json.dumps(out, indent=1, default=str))
    else:
        print(format_rows(rows, args.tier))
        if args.json:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump(out, f, indent=1, default=str)
    return 0 if out["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
