"""``python -m dettrain.checkpoint list|status RUN_DIR | to-torch RUN|CKPT --out FILE`` (also ``dettrain checkpoint``).

``list`` prints every entry of a run's ``checkpoints/`` and whether each file matches its size and sha256;
``status`` gives a launcher its verdict as the exit status: 0 complete, 75 resumable from a verified checkpoint or
fresh (requeue it), 1 neither.  ``to-torch`` writes one ``torch.save`` file of the model's state dict, checked
against the checkpoint's fingerprint, for tools that want a single file: the keys and tensors of ``state_dict()``
of the model the checkpoint's config builds, so its ``load_state_dict`` takes the file as it is (a Hugging Face
model's own keys, without dettrain's ``hf.`` wrapper; tied weights under each of their keys); ``--optim FILE``
adds the AdamW state in the layout of ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict``
(``state`` and ``param_groups`` keyed by those names; one group per weight decay, decayed parameters first), which
``set_optimizer_state_dict`` loads into a ``torch.optim.AdamW`` built with the same groups.  RUN_DIR
may also be the run's ``ledger.jsonl`` (its run dir is meant); any other
file is refused (exit 2), never read as an empty run dir.  The checkpoints themselves are the package
dettrain.checkpoint.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

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
from dettrain.errors import UserError


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


def _model_of(node: dict) -> tuple[Any, Any]:
    """(the model a checkpoint's model node builds, on "meta": names and shapes only; the module whose state dict a
    user loads: a Hugging Face model's own, without dettrain's wrapper)."""
    from dettrain.config import model_config
    from dettrain.models.hf import HFCausalLM
    from dettrain.models.llama import build_model

    built = build_model(model_config(node), 0, "meta")
    return built, built.hf if isinstance(built, HFCausalLM) else built


def model_state(node: dict, params: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str], list[str]]:
    """({``state_dict()`` key of the user's model: tensor}, {dettrain's parameter name: the first such key}, the
    persistent buffers not among them: to_torch fills them from the checkpoint's buffers files) for the checkpoint's
    parameters ``params``."""
    built, inner = _model_of(node)
    name_of = {id(p): n for n, p in built.named_parameters()}
    out: dict[str, Any] = {}
    fqn: dict[str, str] = {}
    buffers = []
    for key, t in inner.state_dict(keep_vars=True).items():
        name = name_of.get(id(t))
        if name is None:
            buffers.append(key)
            continue
        out[key] = params[name].contiguous()
        fqn.setdefault(name, key)
    return out, fqn, buffers


def optimizer_state(path: Path, meta: dict, fqn: dict[str, str]) -> dict[str, Any]:
    """The AdamW state of checkpoint ``path`` as ``get_optimizer_state_dict`` lays it out, keyed by ``fqn``."""
    import torch
    import torch.distributed.checkpoint as dcp

    from dettrain import checkpoint as ckpt
    from dettrain.sync.optim import OptimConfig, decays, lr_at

    md = ckpt._safe_metadata(path / ".metadata")
    sd = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in md.state_dict_metadata.items()
          if k.startswith("optim/") and hasattr(v, "size")}
    try:
        with ckpt._single_process_ok():
            dcp.load(sd, storage_reader=ckpt._reader(path))
    except BaseException as e:  # DCP's CheckpointException derives from BaseException
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        raise ckpt.CorruptCheckpoint(f"checkpoint {path}: reading the optimizer state failed ({type(e).__name__})"
                                     ) from None
    c = meta["config"]
    oc = OptimConfig(**{k: v for k, v in c["optim"].items() if k in OptimConfig.__dataclass_fields__})
    steps = meta["optim"].get("step_count", meta["step"])
    state: dict[str, dict[str, Any]] = {}
    for name, key in fqn.items():
        moments = {m: sd[f"optim/{name}/{m}"] for m in ("exp_avg", "exp_avg_sq") if f"optim/{name}/{m}" in sd}
        if moments:  # a frozen parameter has none
            step = sd.get(f"optim/{name}/step")
            state[key] = {"step": torch.tensor(float(steps if step is None else step.item())), **moments}
    # the learning rate of the last step the checkpoint holds (its schedule), the settings of the trainer's AdamW
    lr = lr_at(max(meta["step"] - 1, 0), c["train"]["lr"], c["train"]["steps"], oc)
    group = {"lr": lr, "betas": (oc.beta1, oc.beta2), "eps": oc.eps, "amsgrad": False, "maximize": False,
             "foreach": None, "capturable": False, "differentiable": False, "fused": None,
             "decoupled_weight_decay": True}
    decayed = [key for name, key in fqn.items() if decays(name, oc)]
    plain = [key for name, key in fqn.items() if not decays(name, oc)]
    groups = [{**group, "weight_decay": wd, "params": keys} for wd, keys in ((oc.weight_decay, decayed),
                                                                            (0.0, plain)) if keys]
    return {"state": state, "param_groups": groups}


def _save(obj: Any, out: Path) -> None:
    import torch

    from dettrain.errors import replace_atomically, write_error

    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        replace_atomically(out, lambda tmp: torch.save(obj, tmp))
    except (OSError, RuntimeError) as e:  # torch.save reports a full disk as a RuntimeError
        raise write_error(out, e) from None


def to_torch(src: Path, out: Path, force: bool = False, optim: Path | None = None) -> Path:
    """``torch.save`` of the model state dict (``model_state``) of checkpoint/run dir ``src`` into ``out`` and, with
    ``optim``, of its optimizer state (``optimizer_state``) into that file; each written beside its target, then
    renamed (never half-written); an existing file is refused unless ``force``.  Returns the checkpoint used."""
    from dettrain.progress import Progress
    from dettrain.tools.export import _saved_buffers, find_checkpoint, load_params

    for f, flag in ((out, "--out"), (optim, "--optim")):
        if f is None:
            continue
        if f.is_dir():
            raise UserError(f"{flag} {f} is a directory; name the file to write (e.g. {flag} {f / 'model.pt'})")
        if (f.exists() or f.is_symlink()) and not force:
            raise UserError(f"{flag} {f} already exists; choose another {flag}, or pass --force to replace it")
    if optim is not None and optim.absolute() == out.absolute():
        raise UserError(f"--optim {optim} is --out too; name two files")
    with Progress("to-torch", total=3 if optim is None else 4, unit="stage") as prog:
        path = find_checkpoint(src)
        params, meta = load_params(path)
        prog.update(1, f"read {path.name}, parameters checked")
        state, fqn, buffers = model_state(meta["config"]["model"], params)
        saved = _saved_buffers(path, meta)  # each rank's persistent buffers are in the checkpoint: rank 0's here
        for key in list(buffers):
            for name in (key, f"hf.{key}"):  # dettrain's names of an HF model's tensors carry its hf. prefix
                if name in saved:
                    state[key] = saved[name]
                    buffers.remove(key)
                    break
        if buffers:
            print(f"note: the model's buffers {', '.join(buffers[:4])}{' ...' * (len(buffers) > 4)} are not in this "
                  "checkpoint: load the file with load_state_dict(..., strict=False)", file=sys.stderr)
        prog.update(1, "named for load_state_dict")
        _save(state, out)
        prog.update(1, f"wrote {out}")
        if optim is not None:
            _save(optimizer_state(path, meta, fqn), optim)
            prog.update(1, f"wrote {optim}")
    return path


def _to_torch(src: Path, out: Path, force: bool, optim: Path | None) -> int:
    from dettrain.errors import EXIT_USAGE

    try:
        path = to_torch(src, out, force, optim)
    except ValueError as e:  # UserError and CheckpointError: one line, no traceback
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    extra = f", {optim} (the optimizer state)" if optim is not None else ""
    print(f"wrote {out} (torch.save of the model state dict){extra} from {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dettrain.checkpoint", description=checkpoint.__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="checkpoints of a run and whether every file matches its sha256"
                   ).add_argument("run_dir")
    sub.add_parser("status", help=f"exit 0 if the run is complete, {REQUEUE_EXIT_CODE} if it can resume from a "
                   "verified checkpoint or has trained nothing yet (requeue it), 1 otherwise").add_argument("run_dir")
    tt = sub.add_parser("to-torch", help="one torch.save file of the model's state dict (the keys its "
                        "load_state_dict takes -> fp32 tensors) of a checkpoint, or of a run dir's newest good one")
    tt.add_argument("src", help="a run dir or a checkpoint dir (step_XXXXXXXX)")
    tt.add_argument("--out", required=True, help="the file to write (refused if it exists, unless --force)")
    tt.add_argument("--optim", help="also write the optimizer state (get_optimizer_state_dict's layout) to this file")
    tt.add_argument("--force", action="store_true", help="replace an existing --out (or --optim)")
    args = ap.parse_args(argv)
    if args.cmd == "to-torch":
        return _to_torch(Path(args.src), Path(args.out), args.force, Path(args.optim) if args.optim else None)
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
