"""Export a checkpoint as a Hugging Face directory: ``config.json``, ``generation_config.json``, the weights.

    python -m dettrain.export RUN_DIR|CHECKPOINT --out DIR [--force]

RUN_DIR takes its newest checkpoint that passes the file checks; CHECKPOINT is one ``step_XXXXXXXX`` directory.
The model comes from the checkpoint's own config (``dettrain.json`` holds the resolved config), the tensors from its
DCP files as the engine that saved them reads them (``Engine.saved_params``: ``model/<name>`` for every built-in
engine, or the pieces ``flat/param/<lo>-<hi>`` of the earlier flat format), through checkpoint.storage's safe
metadata reader.  The loaded parameters must hash to the fingerprint the
checkpoint recorded (the ledger's ``param`` of the step before), so what is written is exactly what was trained.
dettrain's LLaMA becomes a ``LlamaForCausalLM`` (below); a ``dettrain.models.hf.from_config`` model (``model=hf_llama``,
qwen2, mistral, ...) is written by its own ``save_pretrained``.  The data's token ids (``token_ids``: the token
file's sidecar) go into both configs, and its tokenizer, if it was prepared with one, is copied.

Layout change: dettrain's RoPE rotates interleaved pairs (rows 2i, 2i+1 of each head); Hugging Face's
``rotate_half`` rotates the two halves (rows i, i + head_dim/2).  Each head's q/k rows are permuted accordingly
(``w.view(heads, head_dim // 2, 2, dim).transpose(1, 2)``); every other tensor keeps its values under HF's name.
``transformers.LlamaForCausalLM.from_pretrained(DIR)`` then computes the same logits in fp32 (up to rounding:
the rope tables are built differently).  Needs ``transformers`` and ``safetensors`` (``pip install 'dettrain[hf]'``).
``--out`` must be a new or empty directory: an existing file or a directory that holds files is refused unless
``--force`` (export never writes over files it did not create); a read-only or immutable target is a one-line error
naming the path. Exit status: 0 written, 2 bad input (no checkpoint, a custom model other than dettrain.models.hf's, a
damaged checkpoint, missing packages, an --out refused as above).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from dettrain.errors import EXIT_USAGE, UserError, follow_umask

if TYPE_CHECKING:  # torch is imported where it is used: `export --help` answers without it
    import torch

HF_TARGET = "dettrain.models.hf.from_config"

__all__ = ["copy_tokenizer", "export", "export_tokenizer", "find_checkpoint", "hf_config", "llama_config",
           "load_llama", "load_params", "main", "to_hf", "token_ids"]


def find_checkpoint(path: Path) -> Path:
    """The checkpoint ``path`` names: itself (a step_XXXXXXXX dir) or a run dir's newest good checkpoint (each newer
    damaged one named on stderr with the reason it was skipped)."""
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
            except ckpt.CheckpointError as e:
                reasons.append(str(e))
                continue
            for r in reasons:  # never an older checkpoint in silence: which newer one was passed over, and why
                print(f"warning: skipped a newer checkpoint: {r}; using {c}", file=sys.stderr)
            return c
    more = f" (damaged: {'; '.join(reasons)})" if reasons else ""
    raise UserError(f"{path} holds no checkpoint{more}; train with ckpt.every=N or train.stop_after=S to write one")


def llama_config(meta: dict, path: Path):
    """The ModelConfig of the checkpoint's resolved config; UserError for anything but dettrain's LLaMA."""
    from dettrain.config import model_config
    from dettrain.models.llama import ModelConfig

    node = meta["config"]["model"]
    if "_target_" in node:
        raise UserError(f"checkpoint {path} holds a custom model (model._target_={node['_target_']}); export writes "
                        f"dettrain's LLaMA and {HF_TARGET} models only: take its state dict with 'dettrain checkpoint "
                        "to-torch CKPT --out FILE' (parameter names -> tensors) and save it with your model's code")
    cfg = model_config(node)
    assert isinstance(cfg, ModelConfig)
    return cfg


def load_params(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """({parameter name: fp32 tensor of its shape}, checkpoint meta) of checkpoint ``path``, any engine, any
    model, read by plain DCP (``model/<name>`` keys) and checked against the checkpoint's parameter fingerprint.
    The names, shapes and canonical order come from the model of the checkpoint's own config, built on "meta"."""
    import torch.distributed.checkpoint as dcp

    from dettrain import checkpoint as ckpt
    from dettrain.config import model_config
    from dettrain.models.llama import build_model
    from dettrain.record.fingerprint import combine, fingerprint, format_fp
    from dettrain.sync.collectives import FlatLayout
    from dettrain.sync.engines import saved_by

    meta = ckpt._read_meta(path)
    shapes = build_model(model_config(meta["config"]["model"]), 0, "meta")  # names, shapes, order; no memory
    layout = FlatLayout(shapes, 1, 1.0)
    md = ckpt._safe_metadata(path / ".metadata")
    # the engine that saved it knows its layout (every built-in one: model/<name>; the earlier flat format: pieces)
    sd, params = saved_by(meta["optim"]["kind"]).saved_params(md, path, layout.entries)
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
    return params, meta


def load_llama(path: Path):
    """(ModelConfig, {dettrain parameter name: fp32 tensor}, checkpoint meta) of checkpoint ``path`` of dettrain's
    LLaMA, checked against the checkpoint's parameter fingerprint."""
    from dettrain import checkpoint as ckpt

    cfg = llama_config(ckpt._read_meta(path), path)
    params, meta = load_params(path)
    return cfg, params, meta


def token_ids(meta: dict, tokenizer: bool = True) -> tuple[dict[str, int | None], Path | None, str]:
    """(bos/eos/pad token ids, the tokenizer file or directory the data was prepared with or None, a note) of the
    checkpoint's training data; UserError when that tokenizer no longer matches the sidecar's ``tokenizer_sha256``
    (``tokenizer=False``: not looked at).  A token file's sidecar gives its end-of-text id (``eot_id``), which is all
    that separates documents: a document starts after one and ends with one, so it is bos, eos and pad alike (GPT-2's
    convention).  The embedded corpus is raw bytes 0-255 with no separator: no id is special, so all are None."""
    data = meta["config"].get("data") or {}
    if not data.get("path"):
        return ({"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}, None,
                "the embedded byte corpus has no special tokens: bos/eos/pad are null")
    from dettrain.data import sidecar

    side = sidecar(data["path"])
    try:
        sc = json.loads(side.read_text())
    except (OSError, ValueError) as e:
        return ({"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}, None,
                f"no token ids written: the data's sidecar {side} is unreadable ({type(e).__name__})")
    eot = sc.get("eot_id") if isinstance(sc, dict) else None
    # the sidecar's own bos/pad where the tokenizer has them; else the end-of-text id, the data's only separator
    bos, pad = sc.get("bos_id"), sc.get("pad_id")
    ids = {"bos_token_id": eot if bos is None else bos, "eos_token_id": eot,
           "pad_token_id": eot if pad is None else pad}
    tok = sc.get("tokenizer")
    tok_path = None
    if not tokenizer:
        return ids, None, f"token ids from {side}; tokenizer not exported (--no-tokenizer)"
    if tok:
        for cand in (Path(tok), side.parent / tok):
            if cand.exists():
                tok_path = cand
                break
    if tok_path is not None and sc.get("tokenizer_sha256"):
        from dettrain.data import tokenizer_sha256

        now = tokenizer_sha256(tok_path)
        if now != sc["tokenizer_sha256"]:  # replaced since prepare: its ids are not the data's
            raise UserError(f"the tokenizer {tok_path} changed since prepare wrote {side} (sha256 {now[:12]}..., the "
                            f"sidecar records {sc['tokenizer_sha256'][:12]}...): it is not the tokenizer the model "
                            "was trained with; restore it, or export without it with --no-tokenizer")
    note = (f"token ids from {side}" + ("" if not tok else f"; tokenizer {tok_path}" if tok_path
                                       else f"; its tokenizer {tok} no longer exists: not copied"))
    return ids, tok_path, note


NOT_TOKENIZER = ("config.json", "generation_config.json", "model.safetensors.index.json", "dettrain_export.json")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".ckpt")


def copy_tokenizer(tok: Path, out: Path, ids: dict[str, int | None]) -> list[str]:
    """The data's tokenizer into ``out``: a directory's files as they are (AutoTokenizer's layout; a file of the
    model export's own, e.g. a config.json, is never replaced), a bare tokenizer.json plus a tokenizer_config.json
    naming PreTrainedTokenizerFast and the special tokens.  Returns the names written."""
    import shutil

    if tok.is_dir():  # a model directory (a pretrained start's) also holds weights and configs: not the tokenizer's
        names = []
        for f in sorted(tok.iterdir()):
            if (f.is_file() and f.name not in NOT_TOKENIZER and not f.name.endswith(WEIGHT_SUFFIXES)
                    and not (out / f.name).exists()):
                shutil.copyfile(f, out / f.name)
                names.append(f.name)
        return names
    shutil.copyfile(tok, out / "tokenizer.json")
    from tokenizers import Tokenizer

    t = Tokenizer.from_file(str(tok))
    conf: dict = {"tokenizer_class": "PreTrainedTokenizerFast"}
    for key, name in (("bos_token_id", "bos_token"), ("eos_token_id", "eos_token"), ("pad_token_id", "pad_token")):
        if ids.get(key) is not None and t.id_to_token(ids[key]) is not None:
            conf[name] = t.id_to_token(ids[key])
    (out / "tokenizer_config.json").write_text(json.dumps(conf, indent=1))
    return ["tokenizer.json", "tokenizer_config.json"]


TOKENIZER_SUBDIR = "tokenizer"
"""Where the tokenizer goes when ``AutoTokenizer.from_pretrained(out)`` would not load it as it is: transformers
picks the tokenizer class from config.json's model_type for some families (qwen2: ``Qwen2Tokenizer``, which rebuilds
its own normalizer and pre-tokenizer around the vocabulary), whatever tokenizer_config.json names."""
PROBE_TEXTS = ("def f(x):\n    return x + 12345  # a comment\n", "Hello, World! It's 2026; naïve café über 東京.",
               "  two  spaces\n\n\ttab and trailing   ", "The end.<|endoftext|>Next document 0.5e-3")
"""Texts both tokenizers encode when export checks that AutoTokenizer gives the training ids: digits, accents, CJK,
runs of whitespace, an end-of-text token inside the text."""


def _ids_differ(tok: Path, where: Path) -> str | None:
    """How ``AutoTokenizer.from_pretrained(where)`` encodes ``PROBE_TEXTS`` unlike the training tokenizer (prepare's
    own loading of ``tok``), or None when every id is the same."""
    from transformers import AutoTokenizer

    from dettrain.data import load_tokenizer

    train = load_tokenizer(str(tok))
    try:
        auto = AutoTokenizer.from_pretrained(str(where), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds for a directory it cannot load
        return f"AutoTokenizer cannot load it ({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''})"
    want = train.encode(list(PROBE_TEXTS))
    got = [list(x) for x in auto(list(PROBE_TEXTS), add_special_tokens=True)["input_ids"]]
    for text, a, b in zip(PROBE_TEXTS, want, got):
        if a != b:
            return f"{type(auto).__name__} encodes {text[:30]!r} as {b[:8]}..., the training tokenizer as {a[:8]}..."
    return None


def export_tokenizer(tok: Path, out: Path, ids: dict[str, int | None], model_type: str) -> str:
    """Copy the training tokenizer into ``out`` so that ``AutoTokenizer.from_pretrained(out)`` encodes as in
    training (checked on ``PROBE_TEXTS``); where transformers would load another class for this ``model_type``,
    into ``out/tokenizer/`` instead (loaded there as it is), never as a tokenizer that gives other ids.  Returns the
    note to print."""
    names = copy_tokenizer(tok, out, ids)
    why = _ids_differ(tok, out)
    if why is None:
        return f"AutoTokenizer.from_pretrained({out}) encodes as the training tokenizer"
    sub = out / TOKENIZER_SUBDIR
    sub.mkdir(exist_ok=True)
    for name in names:
        (out / name).replace(sub / name)
    again = _ids_differ(tok, sub)
    if again is not None:
        raise UserError(f"the tokenizer {tok} cannot be exported so that AutoTokenizer loads it ({again}); export "
                        "without it with --no-tokenizer and ship the tokenizer file itself")
    return (f"warning: for model_type {model_type}, AutoTokenizer.from_pretrained({out}) would not encode as the "
            f"training tokenizer ({why}); the tokenizer is in {sub}: load it with AutoTokenizer.from_pretrained({sub})")


def _rope_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Interleaved RoPE pairs (dettrain) -> half-split rows (Hugging Face), per head."""
    out, dim = w.shape
    hd = out // heads
    return w.view(heads, hd // 2, 2, dim).transpose(1, 2).reshape(out, dim)


def to_hf(cfg, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """dettrain parameter names and layouts -> LlamaForCausalLM's state dict (contiguous fp32 tensors)."""
    import torch

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


def hf_config(cfg, ids: dict[str, int | None] | None = None):
    """The transformers.LlamaConfig of a dettrain ModelConfig, with the data's token ids (``token_ids``)."""
    from transformers import LlamaConfig

    return LlamaConfig(**(ids or {}),
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
            from dettrain.record.rundir import io_error

            raise io_error("read the --out directory", out, e, target="--out") from None
        if held:
            more = f" and {len(held) - 3} more" if len(held) > 3 else ""
            raise UserError(f"--out {out} is not empty (it holds {', '.join(held[:3])}{more}); export into a new or "
                            "empty directory, or pass --force to write over its files")


def export(src: Path, out: Path, force: bool = False, tokenizer: bool = True) -> tuple[Path, str]:
    """Write the Hugging Face directory of checkpoint/run dir ``src`` into ``out``; returns (the checkpoint used, a
    note on the token ids and tokenizer).  ``out`` must be new or empty unless ``force`` (``check_out``);
    ``tokenizer=False`` leaves the data's tokenizer out (the token ids are still written)."""
    from dettrain import checkpoint as ckpt
    from dettrain.errors import write_error
    from dettrain.progress import Progress

    try:
        from safetensors import SafetensorError
        from safetensors.torch import save_file
        from transformers import GenerationConfig
    except ImportError as e:
        raise UserError(f"export needs transformers and safetensors ({e}); pip install 'dettrain[hf]'") from None
    check_out(out, force)
    prog = Progress("export", total=3, unit="stage")
    path = find_checkpoint(src)
    node = ckpt._read_meta(path)["config"]["model"]
    hf_model = None
    if node.get("_target_") == HF_TARGET:  # already a transformers model: its own save_pretrained
        params, meta = load_params(path)
        hf_model = _hf_model(node, params)
    else:
        cfg, params, meta = load_llama(path)  # UserError for any other custom model
        tensors = to_hf(cfg, params)
    prog.update(1, f"read {path.name}, parameters checked")
    ids, tok, note = token_ids(meta, tokenizer)
    if tokenizer and tok is None and node.get("pretrained"):  # the pretrained model's own, when the data names none
        tok, note = _pretrained_tokenizer(str(node["pretrained"]), note)
    target = out
    existed = out.is_dir()
    before = {p.name for p in out.iterdir()} if existed else set()
    try:
        if out.is_file() or out.is_symlink() and not out.is_dir():
            out.unlink()  # --force on an existing file: the directory takes its place
        out.mkdir(parents=True, exist_ok=True)
        model_type = "llama"
        if hf_model is not None:
            model_type = hf_model.config.model_type
            target = out / "model.safetensors"
            for k, v in ids.items():
                setattr(hf_model.config, k, v)
            hf_model.config.use_cache = True  # dettrain trains without a KV cache; generate wants one
            hf_model.save_pretrained(out)
            follow_umask(target)  # safetensors writes 0600
        else:
            target = out / "config.json"
            hf_config(cfg, ids).save_pretrained(out)
            target = out / "model.safetensors"
            save_file(tensors, str(target), metadata={"format": "pt"})
            follow_umask(target)  # safetensors writes 0600
        prog.update(1, "wrote the weights")
        target = out / "generation_config.json"
        GenerationConfig(**ids).save_pretrained(out)
        tok_dir = None
        if tok is not None:
            target = out / "tokenizer.json"
            note += "; " + export_tokenizer(tok, out, ids, model_type)
            tok_dir = TOKENIZER_SUBDIR if (out / TOKENIZER_SUBDIR).is_dir() else "."
        info = {"checkpoint": str(path.resolve()), "step": meta["step"], "config_hash": meta["config_hash"],
                "param_fingerprint": meta["fingerprints"]["param"], **ids,
                "tokenizer": str(tok) if tok is not None else None, "tokenizer_dir": tok_dir}
        target = out / "dettrain_export.json"
        target.write_text(json.dumps(info, indent=1))
    except (OSError, RuntimeError, SafetensorError, UserError) as e:
        # read-only, immutable (chattr +i), full (safetensors and torch say so in their own errors), not permitted:
        # what this call wrote is removed (an empty config.json would block the rerun), then one line naming it
        prog.close(ok=False)
        _undo(out, existed, before)
        if isinstance(e, UserError):
            raise
        raise write_error(target, e) from None
    prog.update(1, "wrote the configs and tokenizer")
    prog.close()
    return path, note


def _pretrained_tokenizer(spec: str, note: str) -> tuple[Path | None, str]:
    """The directory of ``model.pretrained`` when it holds a tokenizer (tokenizer.json or tokenizer_config.json)."""
    from dettrain.hub import resolve

    try:
        path = resolve(spec, "model.pretrained")
    except UserError as e:
        return None, f"{note}; the pretrained model's tokenizer is not copied ({e})"
    if (path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file():
        return path, f"{note}; tokenizer of model.pretrained={spec} ({path})"
    return None, note


def _undo(out: Path, existed: bool, before: set[str]) -> None:
    """Remove what a failed export wrote into ``out``: the entries that were not there before, and ``out`` itself
    when the export created it."""
    import shutil

    try:
        for p in out.iterdir() if out.is_dir() else ():
            if p.name not in before:
                shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
        if not existed and out.is_dir():
            out.rmdir()
    except OSError:
        pass  # an immutable or vanished directory: the error already names the path


def _hf_model(node: dict, params: dict[str, torch.Tensor]):
    """The transformers model of a ``model._target_=dettrain.models.hf.from_config`` node holding ``params`` (dettrain's
    names are ``hf.<transformers name>``), with eager attention recorded (dettrain's own kernel is registered only
    inside dettrain; eager is what transformers runs everywhere)."""
    import torch

    from dettrain.config import model_config
    from dettrain.models.hf import HFCausalLM, config_only
    from dettrain.models.llama import build_model

    with config_only():  # a pretrained start: its config.json only, the weights are the checkpoint's
        wrapped = build_model(model_config(node), 0, "cpu")
    assert isinstance(wrapped, HFCausalLM)
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            p.copy_(params[name])
    model = wrapped.hf
    model.set_attn_implementation("eager")
    return model


def _saved_buffers(path: Path, meta: dict) -> dict[str, torch.Tensor]:
    """Rank 0's persistent model buffers (BatchNorm statistics) of checkpoint ``path``, so the file loads into the
    model with ``load_state_dict(strict=True)``; {} when the model has none.  Checked against their sha256."""
    import torch

    from dettrain import checkpoint as ckpt
    from dettrain.checkpoint.state import buffers_file
    from dettrain.checkpoint.storage import _sha256_file

    rel = buffers_file(0)
    if rel not in meta.get("sha256_files", {}):
        return {}
    f = path / rel
    try:
        if _sha256_file(f) != meta["sha256_files"][rel]:
            raise ValueError("sha256 mismatch")
        return torch.load(f, map_location="cpu", weights_only=True)
    except (OSError, ValueError, RuntimeError) as e:
        raise ckpt.CorruptCheckpoint(f"checkpoint {path}: model buffers {rel} are damaged ({e})") from None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dettrain.export", description=__doc__.split("\n\n")[0])
    ap.add_argument("src", help="a run dir (its newest good checkpoint) or a checkpoint dir (step_XXXXXXXX)")
    ap.add_argument("--out", required=True, help="output directory (config.json + model.safetensors); must be new "
                    "or empty")
    ap.add_argument("--force", action="store_true", help="write into a non-empty --out (or replace a file there)")
    ap.add_argument("--no-tokenizer", action="store_true", help="leave the data's tokenizer out (the token ids are "
                    "still written)")
    args = ap.parse_args(argv)
    try:
        path, note = export(Path(args.src), Path(args.out), force=args.force, tokenizer=not args.no_tokenizer)
    except ValueError as e:  # UserError and CheckpointError: bad input, one line, no traceback
        print(f"dettrain.export: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    print(f"wrote {args.out} (config.json, generation_config.json, model.safetensors) from {path}; {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
