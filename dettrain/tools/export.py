"""Export a checkpoint of dettrain's LLaMA as a Hugging Face directory: ``config.json`` + ``model.safetensors``.

    python -m dettrain.export RUN_DIR|CHECKPOINT --out DIR [--force]

RUN_DIR takes its newest checkpoint that passes the file checks; CHECKPOINT is one ``step_XXXXXXXX`` directory.
The model shape comes from the checkpoint's own config (``dettrain.json`` holds the resolved config), the tensors
from its DCP files, read by checkpoint.storage's safe metadata reader: the flat buffer ``flat/param/<lo>-<hi>`` in
the canonical layout of ``collectives.FlatLayout`` (tiers 3-4) or ``model/<name>`` per parameter (tiers 0-2).  The
loaded parameters must hash to the fingerprint the checkpoint recorded (the ledger's ``param`` of the step before),
so what is written is exactly what was trained.

Layout change: dettrain's RoPE rotates interleaved pairs (rows 2i, 2i+1 of each head); Hugging Face's
``rotate_half`` rotates the two halves (rows i, i + head_dim/2).  Each head's q/k rows are permuted accordingly
(``w.view(heads, head_dim // 2, 2, dim).transpose(1, 2)``); every other tensor keeps its values under HF's name.
``transformers.LlamaForCausalLM.from_pretrained(DIR)`` then computes the same logits in fp32 (up to rounding:
the rope tables are built differently).  Needs ``transformers`` and ``safetensors`` (``pip install 'dettrain[hf]'``).
``--out`` must be a new or empty directory: an existing file or a directory that holds files is refused unless
``--force`` (export never writes over files it did not create); a read-only or immutable target is a one-line error
naming the path.
Exit status: 0 written, 2 bad input (no checkpoint, a custom model, a damaged checkpoint, missing packages, an --out
refused as above).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from dettrain.errors import EXIT_USAGE, UserError

__all__ = ["export", "find_checkpoint", "hf_config", "llama_config", "load_llama", "main", "to_hf"]


def find_checkpoint(path: Path) -> Path:
    """The checkpoint ``path`` names: itself (a step_XXXXXXXX dir) or a run dir's newest good checkpoint."""
    from dettrain import checkpoint as ckpt

    if (path / ckpt.META_NAME).is_file():
        return path
    if not path.exists():
        raise UserError(f"{path} does not exist; give a run dir or a checkpoint dir (run_dir/checkpoints/step_*)")
    reasons = []
    for root in (ckpt.ckpt_dir(path), path):
        for c in ckpt.list_checkpoints(root):
            try:
                ckpt._read_meta(c)
                return c
            except ckpt.CheckpointError as e:
                reasons.append(str(e))
    more = f" (damaged: {'; '.join(reasons)})" if reasons else ""
    raise UserError(f"{path} holds no checkpoint{more}; train with ckpt.every=N or train.stop_after=S to write one")


def llama_config(meta: dict, path: Path):
    """The ModelConfig of the checkpoint's resolved config; UserError for anything but dettrain's LLaMA."""
    from dettrain.config import model_config
    from dettrain.model import ModelConfig

    node = meta["config"]["model"]
    if "_target_" in node:
        raise UserError(f"checkpoint {path} holds a custom model (model._target_={node['_target_']}); export writes "
                        "dettrain's LLaMA only. Save your own model with its own code (its parameters are under "
                        "their names in the checkpoint)")
    cfg = model_config(node)
    assert isinstance(cfg, ModelConfig)
    return cfg


def load_llama(path: Path):
    """(ModelConfig, {dettrain parameter name: fp32 tensor}, checkpoint meta) of checkpoint ``path``, checked
    against the checkpoint's parameter fingerprint."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from dettrain import checkpoint as ckpt
    from dettrain.collectives import FlatLayout
    from dettrain.fingerprint import combine, fingerprint, format_fp
    from dettrain.model import build_model

    meta = ckpt._read_meta(path)
    cfg = llama_config(meta, path)
    shapes = build_model(cfg, 0, "meta")  # names, shapes and the canonical order, no memory
    layout = FlatLayout(shapes, 1, 1.0)
    md = ckpt._safe_metadata(path / ".metadata")
    params: dict[str, torch.Tensor] = {}
    if meta["optim"]["kind"] == "flat":  # tiers 3-4: pieces of the flat buffer [0, numel)
        pieces = ckpt._plan_flat(md, path, layout.numel)["param"]
        flat = torch.empty(layout.numel, dtype=torch.float32)
        sd = {key: flat[a:b] for a, b, key in pieces}  # read straight into place
        for name, _, off, k in layout.entries:
            params[name] = flat[off : off + k]
    else:  # tiers 0-2: one tensor per parameter name
        sd = {}
        for name, p, _, _ in layout.entries:
            key = f"model/{name}"
            tmd = md.state_dict_metadata.get(key)
            if not isinstance(tmd, TensorStorageMetadata) or tuple(tmd.size) != tuple(p.shape):
                raise ckpt.CheckpointError(f"checkpoint {path}: parameter {name} is missing or has another shape "
                                           f"than model {cfg.name} of its own config")
            sd[key] = params[name] = torch.empty(p.shape, dtype=torch.float32)
    try:
        with ckpt._single_process_ok():
            dcp.load(sd, storage_reader=ckpt._reader(path))
    except BaseException as e:  # DCP's CheckpointException derives from BaseException, not Exception
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        raise ckpt.CorruptCheckpoint(f"checkpoint {path}: reading tensors failed ({type(e).__name__}: "
                                     f"{str(e).splitlines()[0][:300] if str(e) else ''})") from None
    # the same fingerprint as the trainer's: every parameter at its canonical flat offset
    got = format_fp(combine(fingerprint(params[name].reshape(-1), off) for name, _, off, _ in layout.entries))
    want = meta["fingerprints"]["param"]
    if got != want:
        raise ckpt.CorruptCheckpoint(f"checkpoint {path}: loaded parameters hash to {got}, the checkpoint recorded "
                                     f"{want}; a data file is damaged")
    shaped = {name: params[name].reshape(p.shape) for name, p, _, _ in layout.entries}
    return cfg, shaped, meta


def _rope_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Interleaved RoPE pairs (dettrain) -> half-split rows (Hugging Face), per head."""
    out, dim = w.shape
    hd = out // heads
    return w.view(heads, hd // 2, 2, dim).transpose(1, 2).reshape(out, dim)


def to_hf(cfg, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """dettrain parameter names and layouts -> LlamaForCausalLM's state dict (contiguous fp32 tensors)."""
    kv = cfg.n_kv_heads or cfg.n_heads
    out = {"model.embed_tokens.weight": params["tok_emb.weight"], "model.norm.weight": params["norm.weight"]}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = params["output.weight"]
    names = {"attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
             "attn.wv.weight": "self_attn.v_proj.weight", "attn.wo.weight": "self_attn.o_proj.weight",
             "ffn.w1.weight": "mlp.gate_proj.weight", "ffn.w3.weight": "mlp.up_proj.weight",
             "ffn.w2.weight": "mlp.down_proj.weight"}
    for i in range(cfg.n_layers):
        src, dst = f"layers.{i}.", f"model.layers.{i}."
        out[dst + "self_attn.q_proj.weight"] = _rope_rows(params[src + "attn.wq.weight"], cfg.n_heads)
        out[dst + "self_attn.k_proj.weight"] = _rope_rows(params[src + "attn.wk.weight"], kv)
        for a, b in names.items():
            out[dst + b] = params[src + a]
    return {k: v.detach().to(torch.float32).contiguous().clone() for k, v in out.items()}


def hf_config(cfg):
    """The transformers.LlamaConfig of a dettrain ModelConfig."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.dim, intermediate_size=cfg.ffn_dim,
        num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads or cfg.n_heads, head_dim=cfg.dim // cfg.n_heads,
        max_position_embeddings=cfg.seq_len, rms_norm_eps=cfg.norm_eps,  # HF's default eps is 1e-6, ours 1e-5
        rope_theta=cfg.rope_theta, tie_word_embeddings=cfg.tie_embeddings, hidden_act="silu",
        attention_bias=False, mlp_bias=False, attention_dropout=0.0, dtype="float32",
        architectures=["LlamaForCausalLM"])


def check_out(out: Path, force: bool = False) -> None:
    """Refuse (UserError naming it) an ``--out`` that is an existing file, or a directory that already holds files,
    unless ``force``: export never writes over files it did not create."""
    if out.is_file() or out.is_symlink() and not out.is_dir():
        if not force:
            raise UserError(f"--out {out} is an existing file; export writes a directory: choose another --out "
                            "(or pass --force to replace the file)")
    elif out.is_dir() and not force:
        try:
            held = sorted(p.name for p in out.iterdir())
        except OSError as e:
            from dettrain.rundir import io_error

            raise io_error("read the --out directory", out, e, target="--out") from None
        if held:
            more = f" and {len(held) - 3} more" if len(held) > 3 else ""
            raise UserError(f"--out {out} is not empty (it holds {', '.join(held[:3])}{more}); export into a new or "
                            "empty directory, or pass --force to write over its files")


def export(src: Path, out: Path, force: bool = False) -> Path:
    """Write the Hugging Face directory of checkpoint/run dir ``src`` into ``out``; returns the checkpoint used.
    ``out`` must be new or empty unless ``force`` (``check_out``)."""
    from dettrain.rundir import io_error

    try:
        from safetensors.torch import save_file
        from transformers import LlamaConfig  # noqa: F401 - checked before any work
    except ImportError as e:
        raise UserError(f"export needs transformers and safetensors ({e}); pip install 'dettrain[hf]'") from None
    check_out(out, force)
    path = find_checkpoint(src)
    cfg, params, meta = load_llama(path)
    tensors = to_hf(cfg, params)
    target = out
    try:
        if out.is_file() or out.is_symlink() and not out.is_dir():
            out.unlink()  # --force on an existing file: the directory takes its place
        out.mkdir(parents=True, exist_ok=True)
        target = out / "config.json"
        hf_config(cfg).save_pretrained(out)
        target = out / "model.safetensors"
        save_file(tensors, str(target), metadata={"format": "pt"})
        info = {"checkpoint": str(path.resolve()), "step": meta["step"], "config_hash": meta["config_hash"],
                "param_fingerprint": meta["fingerprints"]["param"]}
        target = out / "dettrain_export.json"
        target.write_text(json.dumps(info, indent=1))
    except OSError as e:  # read-only, immutable (chattr +i), full, not permitted: one line naming the path
        raise io_error("write", target, e, target="--out") from None
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dettrain.export", description=__doc__.split("\n\n")[0])
    ap.add_argument("src", help="a run dir (its newest good checkpoint) or a checkpoint dir (step_XXXXXXXX)")
    ap.add_argument("--out", required=True, help="output directory (config.json + model.safetensors); must be new "
                    "or empty")
    ap.add_argument("--force", action="store_true", help="write into a non-empty --out (or replace a file there)")
    args = ap.parse_args(argv)
    try:
        path = export(Path(args.src), Path(args.out), force=args.force)
    except ValueError as e:  # UserError and CheckpointError: bad input, one line, no traceback
        print(f"dettrain.export: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    print(f"wrote {args.out} (config.json, model.safetensors) from {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
