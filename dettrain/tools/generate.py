"""Generate from a run's checkpoint with logits equal to the training forward's (``dettrain generate``).

    dettrain generate RUN_DIR|CHECKPOINT --prompts prompts.jsonl [--out completions.jsonl] [--max-new-tokens 32]
                      [--temperature 0] [--seed S] [--batch-size 16] [--prefill-chunk N] [--eos ID] [--inexact]

``prompts.jsonl``: one request a line, ``{"tokens": [ids...]}`` or, for a byte-level run (the embedded corpus, or
a token file prepared without a tokenizer), ``{"text": "..."}``; an optional ``"id"`` keys its sampling (default:
the line number).  Output: one JSON line per request, in order: ``id``, ``prompt`` (token ids), ``tokens``,
``logprobs`` (log p of each generated token, what the trainer recomputes), ``finish`` (eos or length),
``training_equal``, ``note`` and, for byte-level runs, ``text``.  The model, its parameters (checked against the
checkpoint's fingerprint) and the settings come from the checkpoint (tools/export.py's loader): the tier's torch
settings and threads, det.batch_invariant and det.attention are applied as the training run applied them.

Refused (exit 2, naming the key) when the logits cannot be training-equal: det.tier < 3, det.batch_invariant off
for this device, a model without the batch-invariant path (Hugging Face models), det.attention=torch, a training
forward compiled on this device (train.compile resolving on: Inductor's fused arithmetic).  ``--inexact``
generates anyway and labels each line ``"training_equal": false`` with the reason.  ``--out`` is written to a
temporary file and renamed; an existing file is refused unless ``--force``.  Without ``--out``, lines go to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from dettrain.errors import EXIT_USAGE, UserError

__all__ = ["main", "read_prompts"]


def read_prompts(path: Path, byte_level: bool) -> tuple[list[list[int]], list[int | str]]:
    """(prompts, ids) of a prompts file; UserError naming the line for anything else."""
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise UserError(f"--prompts {path}: {e.strerror or e}") from None
    prompts, ids = [], []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            raise UserError(f"--prompts {path}:{n}: not JSON; write one object a line, e.g. "
                            '{"tokens": [1, 2, 3]}') from None
        if not isinstance(rec, dict):
            raise UserError(f"--prompts {path}:{n}: expected an object with tokens or text")
        if "tokens" in rec:
            toks = rec["tokens"]
            if not (isinstance(toks, list) and toks and all(isinstance(t, int) and t >= 0 for t in toks)):
                raise UserError(f"--prompts {path}:{n}: tokens must be a non-empty list of token ids")
        elif "text" in rec and isinstance(rec["text"], str) and rec["text"]:
            if not byte_level:
                raise UserError(f"--prompts {path}:{n}: text prompts need a byte-level run; give \"tokens\" "
                                "(ids of the run's tokenizer)")
            toks = list(rec["text"].encode())
        else:
            raise UserError(f"--prompts {path}:{n}: give \"tokens\": [ids] or \"text\": \"...\"")
        prompts.append(toks)
        ids.append(rec.get("id", len(ids)))
    if not prompts:
        raise UserError(f"--prompts {path} holds no prompt")
    return prompts, ids


def _settings_problem(det: dict, device: torch.device, train: dict | None = None) -> str | None:
    from dettrain.determinism import DetConfig, resolve_batch_invariant
    from dettrain.loop.compile import resolve_compile
    from dettrain.tiers import policy

    if not policy(int(det.get("tier", 3))).canonical_sum:
        return f"det.tier={det.get('tier')}: training-equal generation needs det.tier >= 3"
    cfg = DetConfig(tier=int(det.get("tier", 3)), batch_invariant=det.get("batch_invariant"))
    if not resolve_batch_invariant(cfg, device):
        return (f"det.batch_invariant={det.get('batch_invariant')} on {device.type}: the run was not trained with "
                "batch-invariant kernels; train with det.batch_invariant=true")
    if det.get("attention") == "torch":
        return "det.attention=torch: torch's attention is not batch-invariant; train with det.attention=auto"
    setting = (train or {}).get("compile", "auto")
    if resolve_compile(setting, device):
        return (f"train.compile={str(setting).lower()} compiles the training forward on {device.type}: Inductor "
                "fuses its elementwise operations (RoPE, silu x mul), so its bits are not the eager forward's that "
                "generation reproduces; train with train.compile=false")
    return None


def _write(lines: list[str], out: Path | None, force: bool) -> None:
    if out is None:
        sys.stdout.write("".join(lines))
        return
    if out.exists() and not force:
        raise UserError(f"--out {out} exists; choose another path or pass --force to replace it")
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    try:
        tmp.write_text("".join(lines))
        tmp.replace(out)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise UserError(f"--out {out}: {e.strerror or e}") from None


def run(args: argparse.Namespace) -> None:
    from dettrain.config import model_config
    from dettrain.determinism import DetConfig, apply_tier
    from dettrain.generate import generate
    from dettrain.kernels import batch_invariant as bi
    from dettrain.loop.resolve import resolve_precision
    from dettrain.models import attention as attention_route
    from dettrain.models.llama import build_model
    from dettrain.tools.export import find_checkpoint, load_params, token_ids

    if args.out is not None and args.out.exists() and not args.force:  # before any work
        raise UserError(f"--out {args.out} exists; choose another path or pass --force to replace it")
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          "cpu" if args.device == "auto" else args.device)
    ckpt = find_checkpoint(args.run)
    params, meta = load_params(ckpt)
    conf = meta["config"]
    det = conf.get("det") or {}
    why = _settings_problem(det, device, conf.get("train"))
    if why is not None and not args.inexact:
        raise UserError(f"{ckpt}: {why} (or pass --inexact: lines are then labelled training_equal=false)")
    ids_, tok_path, _ = token_ids(meta)
    byte_level = tok_path is None and int(conf["model"].get("vocab_size", 256) or 256) >= 256
    prompts, ids = read_prompts(args.prompts, byte_level)
    eos = args.eos if args.eos is not None else ids_.get("eos_token_id")

    apply_tier(DetConfig(tier=int(det.get("tier", 3)), threads=int(det.get("threads", 1))))
    bi.set_enabled(why is None)
    choice = attention_route.resolve(det.get("attention", "auto"), device, deterministic_ops=True,
                                     batch_invariant=why is None)
    attention_route.install(choice)
    try:
        model = build_model(model_config(conf["model"]), int(conf.get("seed", 0)), device)
        model.load_state_dict({k: v.to(device) for k, v in params.items()}, strict=True)
        # the training forward's precision: bf16 autocast over fp32 weights where train.precision resolves to bf16
        bf16 = resolve_precision((conf.get("train") or {}).get("precision", "auto"), device) == "bf16"
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            out = generate(model, prompts, ids=ids, max_new_tokens=args.max_new_tokens,
                           temperature=args.temperature,
                           seed=int(conf.get("seed", 0)) if args.seed is None else args.seed, eos_id=eos,
                           batch_size=args.batch_size, prefill_chunk=args.prefill_chunk, exact=not args.inexact)
    finally:
        bi.set_enabled(False)
        attention_route.uninstall()
    lines = []
    for c in out:
        rec = {"id": c.id, "prompt": c.prompt, "tokens": c.tokens, "logprobs": c.logprobs, "finish": c.finish,
               "training_equal": c.training_equal and why is None, "note": why or c.note}
        if byte_level:
            rec["text"] = bytes(t for t in c.tokens if t < 256).decode("utf-8", "replace")
        lines.append(json.dumps(rec) + "\n")
    _write(lines, args.out, args.force)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dettrain.generate", description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path, help="run dir (its newest checkpoint) or one checkpoint dir")
    ap.add_argument("--prompts", type=Path, required=True, help="JSONL: {\"tokens\": [...]} or {\"text\": ...}")
    ap.add_argument("--out", type=Path, default=None, help="output JSONL (default: stdout)")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    ap.add_argument("--seed", type=int, default=None, help="sampling seed (default: the run's seed)")
    ap.add_argument("--batch-size", type=int, default=None, help="requests per batch (default: all)")
    ap.add_argument("--prefill-chunk", type=int, default=None, help="prompt positions per prefill step")
    ap.add_argument("--eos", type=int, default=None, help="end-of-text id (default: the data's)")
    ap.add_argument("--device", default="auto", help="auto (CUDA if present), cpu or cuda")
    ap.add_argument("--inexact", action="store_true", help="generate even when logits cannot be training-equal "
                    "(labelled training_equal=false)")
    ap.add_argument("--force", action="store_true", help="replace an existing --out")
    args = ap.parse_args(argv)
    try:
        run(args)
    except UserError as e:
        print(f"dettrain generate: {e}", file=sys.stderr)
        return EXIT_USAGE
    return 0
