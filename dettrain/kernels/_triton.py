"""The one Triton-availability guard, and the helpers every kernel module shares.

``import triton`` is tried here and nowhere else in dettrain: ``HAVE_TRITON`` says whether it worked, ``triton`` and
``tl`` (``triton.language``) are the modules (None without Triton) and ``unavailable_reason()`` says why not.  A
kernel module defines its ``@triton.jit`` functions under ``if HAVE_TRITON:`` and keeps a torch path for everything
else, so every module of ``dettrain.kernels`` imports on a machine without Triton (CPU installs, CI).

For the modules that register torch custom ops (batch_invariant.py, attention.py): ``custom_op`` (a CPU reference,
the Triton kernel on CUDA when Triton is there, a fake for tracing; registering one also puts the kernels' sources
into torch.compile's cache keys, ``tag_compile_caches``), ``on_device`` (the launch context), ``rows_like`` (the
layout the ops return; attention's outputs follow its inputs instead) and ``acc`` (the references' accumulation
dtype).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
from pathlib import Path

import torch

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
    _IMPORT_ERROR: str | None = None
except ImportError as e:  # pragma: no cover - CI has no Triton
    triton = tl = None
    HAVE_TRITON = False
    _IMPORT_ERROR = f"{type(e).__name__}: {e}"


def unavailable_reason() -> str | None:
    """None when Triton is importable; otherwise why not and what to do."""
    if HAVE_TRITON:
        return None
    return f"Triton is not importable ({_IMPORT_ERROR}); install it (pip install triton; CUDA builds of torch bring it)"


def on_device(x: torch.Tensor):
    """Launch context on x's device (a no-op for CPU tensors, which only Triton's interpreter runs)."""
    return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()


@functools.cache
def kernels_digest(folder: Path | None = None) -> str:
    """sha256 (hex, 16 digits) of the Python sources of dettrain.kernels (or ``folder``), names and contents."""
    h = hashlib.sha256()
    for f in sorted(Path(folder or Path(__file__).parent).glob("*.py")):
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:16]


_CACHE_TAG: str | None = None


def tag_compile_caches() -> str:
    """Put dettrain's kernel sources into torch.compile's cache keys (``torch.compiler.config.cache_key_tag``; a tag
    the user set stays in front); returns the tag.  Inductor's FX graph cache and AOTAutograd's cache key a graph
    on its ops and their inputs, not on a custom op's implementation: a graph compiled under another dettrain
    would come back from the cache with that version's output layouts, and Inductor's stride assertion would stop
    the run.  With the sources in the key, a change to them is a new key.  Called when the ops are registered."""
    global _CACHE_TAG
    import torch.compiler.config as cc

    if not hasattr(cc, "cache_key_tag"):  # older torch: nothing to key on
        return ""
    mark = f"dettrain-kernels-{kernels_digest()}"
    if _CACHE_TAG is None or cc.cache_key_tag != _CACHE_TAG:
        user = cc.cache_key_tag
        _CACHE_TAG = f"{user}|{mark}" if user else mark
        cc.cache_key_tag = _CACHE_TAG
    return _CACHE_TAG


def custom_op(name: str, schema: str, cpu_impl, cuda_impl, fake):
    """Define ``dettrain::<name>`` with a CPU reference, the Triton CUDA kernel (when Triton is present) and a fake
    (and put the kernels' sources into torch.compile's cache keys: ``tag_compile_caches``)."""
    tag_compile_caches()
    op = torch.library.custom_op(f"dettrain::{name}", cpu_impl, mutates_args=(), device_types="cpu", schema=schema)
    if HAVE_TRITON:
        op.register_kernel("cuda")(cuda_impl)
    op.register_fake(fake)
    return op


def rows_like(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A fresh contiguous tensor of x's shape (the layout the ops here return, real and fake alike; attention's
    outputs follow its inputs: ``attention._out_like``)."""
    return torch.empty(x.shape, dtype=dtype or x.dtype, device=x.device)


def acc(t: torch.Tensor) -> torch.Tensor:
    """The references' accumulation dtype: fp32 for 16-bit inputs (as the kernels), the input's own otherwise."""
    return t.float() if t.dtype in (torch.bfloat16, torch.float16) else t
