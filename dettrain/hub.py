"""Hugging Face Hub ids resolved through the local Hugging Face cache: ``model.pretrained=ORG/NAME``,
``prepare --tokenizer ORG/NAME`` and ``prepare --dataset ORG/NAME`` take a Hub id where they take a directory.

A local directory is used as it is.  Anything else is a repository id handed to ``huggingface_hub``: the cache
under ``HF_HOME`` (``$HF_HOME/hub/models--org--name/snapshots/<commit>/``) answers first when ``HF_HUB_OFFLINE=1``,
and the Hub downloads the files into that cache when the machine has network.  Only the files a use needs are
fetched (``patterns``): a model's config, safetensors weights and tokenizer files, never pickled ``.bin`` weights.
"""

from __future__ import annotations

import os
from pathlib import Path

from dettrain.errors import UserError

MODEL_FILES = ("*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.tiktoken", "*.jinja")
"""What a pretrained start needs: config, safetensors weights (with their index) and the tokenizer's files."""
TOKENIZER_FILES = ("tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt",
                   "*.model", "*.tiktoken", "chat_template.*", "config.json")
"""A tokenizer's files (config.json too: AutoTokenizer reads the model type from it when tokenizer_config lacks it)."""

FILE_SUFFIXES = (".json", ".jsonl", ".ndjson", ".txt", ".parquet", ".bin", ".model", ".safetensors", ".arrow")
"""A name ending so is a (missing) file, never a Hub id."""


def is_local(spec: str) -> bool:
    """Whether ``spec`` names something on this machine (an existing path, or a path-like name), not a Hub id."""
    p = Path(spec)
    return (p.exists() or spec.startswith((".", "/", "~")) or spec.count("/") > 1 or not spec
            or p.suffix.lower() in FILE_SUFFIXES)


def resolve(spec: str, what: str, patterns: tuple[str, ...] = MODEL_FILES, repo_type: str = "model") -> Path:
    """The directory of ``spec``: itself when it is a local directory, else the Hub snapshot of that repository id
    in the Hugging Face cache (downloaded when online).  UserError naming ``what`` (the key or option) when neither."""
    p = Path(spec).expanduser()
    if p.is_dir():
        return p.resolve()
    if is_local(spec):
        raise UserError(f"{what}={spec!r} is not a directory; pass a save_pretrained directory or a Hub id "
                        "(org/name) that is in the Hugging Face cache")
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise UserError(f"{what}={spec!r} is a Hub id, which needs huggingface_hub: pip install 'dettrain[hf]'") \
            from None
    try:
        return Path(snapshot_download(spec, repo_type=repo_type, allow_patterns=list(patterns), **_env())).resolve()
    except Exception as e:  # noqa: BLE001 - offline misses, unknown repos, gated repos, network errors alike
        first = (str(e).splitlines() or [type(e).__name__])[0][:200]
        raise UserError(f"{what}={spec!r}: not a local directory and not resolvable as a Hub {repo_type} "
                        f"({type(e).__name__}: {first}); download it once with network (huggingface-cli download "
                        f"{spec}), or point HF_HOME at the cache that holds it") from None


def _env() -> dict:
    """HF_HUB_CACHE / HF_HOME and HF_HUB_OFFLINE as the environment says now (huggingface_hub reads them once, when
    it is imported: a process that set them later, such as a notebook or a test, still gets them)."""
    env = os.environ
    cache = env.get("HF_HUB_CACHE") or (os.path.join(env["HF_HOME"], "hub") if env.get("HF_HOME") else None)
    offline = env.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    return {**({"cache_dir": cache} if cache else {}), **({"local_files_only": True} if offline else {})}


def snapshot_revision(path: Path) -> str | None:
    """The commit of a Hub snapshot directory (``.../snapshots/<commit>``), None for any other directory."""
    return path.name if path.parent.name == "snapshots" and path.parent.parent.name.startswith(
        ("models--", "datasets--")) else None
