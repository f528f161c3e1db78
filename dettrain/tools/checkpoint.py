"""``python -m dettrain.checkpoint list|status RUN_DIR | to-torch RUN|CKPT --out FILE`` (also ``dettrain checkpoint``).

``list`` prints every entry of a run's ``checkpoints/`` and whether each file matches its size and sha256;
``status`` gives a launcher its verdict as the exit status: 0 complete, 75 resumable from a verified checkpoint or
fresh (requeue it), 1 neither.  ``to-torch`` writes one ``torch.save`` file of the model's state dict (parameter
names -> fp32 tensors, checked against the checkpoint's fingerprint) for tools that want a single file.  RUN_DIR
may also be the run's ``ledger.jsonl`` (its run dir is meant); any other
file is refused (exit 2), never read as an empty run dir.  The checkpoints themselves are the package
dettrain.checkpoint.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dettrain import checkpoint
from dettrain.checkpoint import (
    CKPT_DIR,
    META_NAME,
    REQUEUE_EXIT_CODE,
    CheckpointError,
    _read_meta,
    ckpt_dir,
    list_checkpoints,
)


def _verified(root: Path, limit: int | None = None, why: str = "") -> tuple[Path | None, list[str]]:
    """(the newest checkpoint under ``root`` of step <= ``limit`` (any without one) whose every file matches its
    size and sha256, or None; why each newer one was rejected)."""
    bad = []
    for p in list_checkpoints(root):
        if limit is not None and int(p.name.split("_")[-1]) > limit:
            bad.append(f"{p.name}: newer than the ledger ({why})")
            continue
        try:
            _read_meta(p, verify_data=True)
            return p, bad
        except CheckpointError as e:
            bad.append(f"{p.name}: {e}")
    return None, bad


def _status(run_dir: Path) -> tuple[int, str]:
    """(exit code, one-line verdict) of a run dir: 0 complete, 75 resumable or fresh, 1 neither."""
    from dettrain.checkpoint.resumption import torn_ledger_limit
    from dettrain.record.ledger import LEDGER_NAME, parse_lines, read_ledger

    ledger = run_dir / LEDGER_NAME
    good, bad = _verified(ckpt_dir(run_dir), *torn_ledger_limit(run_dir))  # the checkpoint ckpt.resume=auto takes
    why = f" (skipped: {'; '.join(bad)})" if bad else ""
    # a signal in the first seconds (before the handler exists) leaves no run dir, no ledger, or a ledger whose
    # header is missing or torn: nothing was trained, so a requeue (75) starts the job afresh
    try:
        lines = parse_lines(ledger) if ledger.is_file() else []
    except ValueError as e:
        return 1, str(e)
    if not lines:
        if good is not None:
            return 1, f"neither: checkpoint {good.name} but no ledger at {ledger}; the run's record is lost"
        return REQUEUE_EXIT_CODE, (f"fresh: no steps trained in {run_dir} yet; rerun it (with ckpt.resume=auto it "
                                   "starts at step 0)" + why)
    try:
        header, steps = read_ledger(ledger)
    except ValueError as e:
        return 1, str(e)
    train = header.get("config", {}).get("train", {}) if isinstance(header.get("config"), dict) else {}
    total = train.get("steps") if isinstance(train, dict) else None
    last = steps[-1]["step"] if steps else -1
    if isinstance(total, int) and last + 1 >= total:
        return 0, f"complete: {last + 1}/{total} steps"
    if good is not None:
        return REQUEUE_EXIT_CODE, (f"resumable: {last + 1}/{total} steps in the ledger, newest verified checkpoint "
                                   f"{good.name}; rerun with ckpt.resume=auto" + why)
    if not steps:
        return REQUEUE_EXIT_CODE, (f"fresh: a ledger header and no steps in {run_dir}; rerun it (with "
                                   "ckpt.resume=auto it starts at step 0)" + why)
    return 1, f"neither: {last + 1}/{total} steps and no usable checkpoint" + why


def _list(run_dir: Path) -> int:
    root = ckpt_dir(run_dir)
    if not root.is_dir():
        print(f"error: {root} does not exist", file=sys.stderr)
        return 2
    for p in sorted(root.iterdir()):
        if p.name.endswith(".tmp"):
            state = "incomplete (a save that did not finish; never read)"
        elif p.name.endswith(".corrupt"):
            state = "BAD set aside by a resume that found it damaged (never read)"
        elif not (p / META_NAME).is_file():
            state = f"incomplete (no {META_NAME})"
        else:
            try:
                meta = _read_meta(p, verify_data=True)  # every file's size and sha256
                state = f"ok  step {meta['step']} world {meta['world_size']} tier {meta['tier']} ({meta['reason']})"
            except CheckpointError as e:
                state = f"BAD {e}"
        print(f"{p.name}: {state}")
    return 0


def _to_torch(src: Path, out: Path, force: bool) -> int:
    from dettrain.errors import EXIT_USAGE
    from dettrain.tools.export import to_torch

    try:
        path = to_torch(src, out, force)
    except ValueError as e:  # UserError and CheckpointError: one line, no traceback
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    print(f"wrote {out} (torch.save of the model state dict) from {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dettrain.checkpoint", description=checkpoint.__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="checkpoints of a run and whether every file matches its sha256"
                   ).add_argument("run_dir")
    sub.add_parser("status", help=f"exit 0 if the run is complete, {REQUEUE_EXIT_CODE} if it can resume from a "
                   "verified checkpoint or has trained nothing yet (requeue it), 1 otherwise").add_argument("run_dir")
    tt = sub.add_parser("to-torch", help="one torch.save file of the model's state dict (parameter names -> fp32 "
                        "tensors) of a checkpoint, or of a run dir's newest good one")
    tt.add_argument("src", help="a run dir or a checkpoint dir (step_XXXXXXXX)")
    tt.add_argument("--out", required=True, help="the file to write (refused if it exists, unless --force)")
    tt.add_argument("--force", action="store_true", help="replace an existing --out")
    args = ap.parse_args(argv)
    if args.cmd == "to-torch":
        return _to_torch(Path(args.src), Path(args.out), args.force)
    run_dir = Path(args.run_dir)
    if run_dir.is_file():
        from dettrain.record.ledger import LEDGER_NAME

        # a run's ledger names its run dir; any other file would be read as a run dir that holds nothing ("fresh",
        # 75), and a launcher would requeue a finished run
        if run_dir.name != LEDGER_NAME:
            print(f"error: {run_dir} is a file, not a run dir; pass the run dir (the directory that holds "
                  f"{LEDGER_NAME} and {CKPT_DIR}/) or its {LEDGER_NAME}", file=sys.stderr)
            return 2
        run_dir = run_dir.parent
    if args.cmd == "status":
        code, msg = _status(run_dir)
        print(msg)
        return code
    return _list(run_dir)


if __name__ == "__main__":
    sys.exit(main())
