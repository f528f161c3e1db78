"""The one Triton-availability guard, and the helpers every kernel module shares.

``import triton`` is tried here and nowhere else in dettrain: ``HAVE_TRITON`` says whether it worked, ``triton`` and
``tl`` (``triton.language``) are the modules (None without Triton) and ``unavailable_reason()`` says why not.  A
kernel module defines its ``@triton.jit`` functions under ``if HAVE_TRITON:`` and keeps a torch path for everything
else, so every module of ``dettrain.kernels`` imports on a machine without Triton (CPU installs, CI).

For the modules that register torch custom ops (batch_invariant.py, attention.py): ``custom_op`` (a CPU reference,
the Triton kernel on CUDA when Triton is there, a fake for tracing), ``on_device`` (the launch context),
``rows_like`` (the layout every op returns) and ``acc`` (the references' accumulation dtype).
"""

from __future__ import annotations

import contextlib

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


def custom_op(name: str, schema: str, cpu_impl, cuda_impl, fake):
    """Define ``dettrain::<name>`` with a CPU reference, the Triton CUDA kernel (when Triton is present) and a fake."""
    op = torch.library.custom_op(f"dettrain::{name}", cpu_impl, mutates_args=(), device_types="cpu", schema=schema)
    if HAVE_TRITON:
        op.register_kernel("cuda")(cuda_impl)
    op.register_fake(fake)
    return op


def rows_like(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A fresh contiguous tensor of x's shape (the layout every op here returns, real and fake alike)."""
    return torch.empty(x.shape, dtype=dtype or x.dtype, device=x.device)


def acc(t: torch.Tensor) -> torch.Tensor:
    """The references' accumulation dtype: fp32 for 16-bit inputs (as the kernels), the input's own otherwise."""
    return t.float() if t.dtype in (torch.bfloat16, torch.float16) else t
