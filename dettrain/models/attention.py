"""Which attention runs (``det.attention``): dettrain's deterministic kernel or torch's, for every model.

    det.attention=auto      dettrain's kernel for every call it serves, at det.tier >= 2 on CUDA with Triton or
                            when det.batch_invariant is on; torch's attention for the rest, and everywhere else
    det.attention=dettrain  the kernel always (on CPU its fp32 reference: exact, slow); a call it cannot serve is
                            an error that names the reason
    det.attention=torch     never: torch's SDPA (deterministic under the tier's torch settings)

``resolve`` turns the setting into an ``AttentionChoice`` (recorded in the ledger header as ``attention``);
``route`` puts it in place for one run and returns what puts the previous route back (the Run of loop/build.py
calls it at ``close()``); ``install`` and ``uninstall`` are the bare switches.  Three entry points reach the kernel
(``torch.ops.dettrain.bi_attention``, dettrain/kernels/attention.py):

* dettrain's LLaMA (models/llama.py) asks ``kernels.attention.attention_active``: the same path and bits as before.
* Hugging Face models: ``dettrain.models.hf.from_config`` builds them with ``attn_implementation="dettrain"``
  (``register_hf``: ``hf_attention`` in transformers' AttentionInterface, ``hf_mask`` in its AttentionMaskInterface,
  so that a causal batch without padding arrives as ``attention_mask=None`` and a padded one as a mask).
* Any model calling ``torch.nn.functional.scaled_dot_product_attention``: while the choice is ``dettrain``,
  ``install`` replaces that attribute of ``torch.nn.functional`` with ``sdpa`` (the module's own callers, HF's
  ``sdpa`` path among them, look it up at each call).  Dynamo traces through the replacement like any Python
  function, so it works compiled too.  A module that bound the function itself before the run started
  (``from torch.nn.functional import scaled_dot_product_attention``) keeps torch's.

What the kernel serves (``problem``): causal self-attention (query and key length equal) without a mask, no
dropout, q/k/v (B, H, T, D) with the kv heads dividing the query heads (GQA without repeating k/v), head sizes
16 ... 128 in steps of 16 (48, 80, 96, 112 zero-padded to the next power of two, with the real scale), any scale;
for HF also a sliding window no shorter than T, and no softcapping, sinks or position bias.  Anything else goes to
torch at ``auto`` (one call at a time; the rest of the model keeps the kernel) and is an error at ``dettrain``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dettrain.errors import UserError
from dettrain.kernels import HAVE_TRITON, unavailable_reason
from dettrain.kernels import attention as kernel

SETTINGS = ("auto", "dettrain", "torch")
"""The values of det.attention."""

HF_NAME = "dettrain"
"""The name under which dettrain's attention is registered with transformers (``attn_implementation``)."""

_TORCH_SDPA = F.scaled_dot_product_attention  # torch's own, whatever install() does later


@dataclass(frozen=True)
class AttentionChoice:
    """det.attention resolved for one run on one device."""

    setting: str
    """det.attention as configured: auto, dettrain or torch."""
    resolved: str
    """dettrain (the kernel serves every call it can) or torch (it serves none)."""
    kernel: str | None
    """What runs the kernel's calls: triton (CUDA) or reference (the fp32 CPU reference); None when resolved torch."""
    reason: str
    """Why, in a few words (recorded in the header)."""

    @property
    def strict(self) -> bool:
        """A call the kernel cannot serve is an error (det.attention=dettrain)."""
        return self.setting == "dettrain"

    @property
    def mode(self) -> str:
        """kernels.attention.set_attention's mode for this choice."""
        if self.setting == "dettrain":
            return "always"
        if self.setting == "torch":
            return "never"
        return "cuda" if self.resolved == "dettrain" else "off"

    def header(self, model: torch.nn.Module | None = None) -> dict:
        """The ledger header's ``attention`` record: the choice, and the model's HF attn_implementation if any."""
        rec = {"setting": self.setting, "resolved": self.resolved, "kernel": self.kernel, "reason": self.reason,
               "sdpa_routed": self.resolved == "dettrain"}
        split = os.environ.get(kernel.KV_SPLIT_ENV, "").strip()
        if split and self.kernel == "triton":  # an override of the default split: other backward bits
            kernel.kv_split(1)  # a bad value stops the run here, before its first step
            rec["kv_split"] = int(split)
        hf_impl = _hf_implementation(model)
        if hf_impl is not None:
            rec["hf_attn_implementation"] = hf_impl
        return rec


def _hf_implementation(model: torch.nn.Module | None) -> str | None:
    cfg = getattr(getattr(model, "hf", None), "config", None)
    return getattr(cfg, "_attn_implementation", None) if cfg is not None else None


def resolve(setting: str, device: torch.device, *, deterministic_ops: bool, batch_invariant: bool,
            batch_invariant_asked: bool | None = None) -> AttentionChoice:
    """det.attention for a run on ``device``: ``deterministic_ops`` is the tier's (det.tier >= 2),
    ``batch_invariant`` the resolved det.batch_invariant, ``batch_invariant_asked`` the configured one (True: the
    user asked for it, which torch's attention cannot give).  A UserError names the key and the fix."""
    s = str(setting).lower()
    if s not in SETTINGS:
        raise UserError(f"det.attention={setting!r} must be one of {', '.join(SETTINGS)}")
    cuda = device.type == "cuda"
    if s == "torch":
        if batch_invariant and batch_invariant_asked:
            raise UserError("det.attention=torch with det.batch_invariant=true: torch's attention is not "
                            "batch-invariant; set det.attention=auto or det.batch_invariant=false")
        return AttentionChoice(s, "torch", None, "det.attention=torch")
    if s == "dettrain":
        if cuda and not HAVE_TRITON:
            raise UserError(f"det.attention=dettrain on CUDA needs Triton ({unavailable_reason()}); "
                            "set det.attention=auto|torch")
        return AttentionChoice(s, "dettrain", "triton" if cuda else "reference", "det.attention=dettrain")
    if not cuda:
        return AttentionChoice(s, "torch", None, f"auto on {device.type}: torch's attention (the kernel runs on CUDA)")
    if not HAVE_TRITON:
        return AttentionChoice(s, "torch", None, "auto: no Triton on this CUDA machine")
    if batch_invariant:
        return AttentionChoice(s, "dettrain", "triton", "auto: det.batch_invariant")
    if deterministic_ops:
        return AttentionChoice(s, "dettrain", "triton", "auto: det.tier >= 2 on CUDA")
    return AttentionChoice(s, "torch", None, "auto: det.tier < 2 (nothing to make deterministic)")


def install(choice: AttentionChoice) -> None:
    """Put ``choice`` in place for this process: the kernel's routing mode, and the SDPA replacement while the
    choice is dettrain (removed otherwise).  Idempotent; a later install replaces an earlier one."""
    kernel.set_attention(choice.mode, strict=choice.strict)
    if choice.resolved == "dettrain":
        F.scaled_dot_product_attention = sdpa
    elif F.scaled_dot_product_attention is sdpa:
        F.scaled_dot_product_attention = _TORCH_SDPA


def uninstall() -> None:
    """Back to torch's attention everywhere (the end of a run): torch's SDPA and the kernel's default mode."""
    if F.scaled_dot_product_attention is sdpa:
        F.scaled_dot_product_attention = _TORCH_SDPA
    kernel.set_attention("off")


def route(choice: AttentionChoice) -> Callable[[], None]:
    """``install(choice)`` for one run; returns the action that puts back what was in place before (the SDPA
    attribute, the kernel's mode and strictness).  ``loop/build.py``'s Run owns it and calls it at ``close()``, so
    the route lasts as long as the run that chose it."""
    saved = (F.scaled_dot_product_attention, kernel.attention_mode(), kernel.attention_strict())
    install(choice)

    def restore() -> None:
        sdpa_fn, mode, strict = saved
        F.scaled_dot_product_attention = sdpa_fn
        kernel.set_attention(mode, strict=strict)

    return restore


# ---- what the kernel serves -------------------------------------------------------------------------------------
def problem(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, mask, dropout: float,
            gqa_ok: bool = True) -> str | None:
    """None when the kernel serves this call exactly; otherwise the reason, as a phrase."""
    if mask is not None:
        return "an attention mask (padding or a custom pattern)"
    if not causal:
        return "non-causal attention"
    if dropout:
        return f"attention dropout {dropout} while training"
    if any(t.dim() != 4 for t in (q, k, v)) or any(t.is_nested for t in (q, k, v)):
        return "q/k/v that are not dense (B, H, T, D) tensors"
    B, H, T, D = q.shape
    if k.shape != v.shape or k.shape[0] != B or k.shape[2] != T or k.shape[3] != D:
        return f"q {tuple(q.shape)} with k {tuple(k.shape)} / v {tuple(v.shape)} (self-attention of equal length " \
               "and head size needed)"
    if k.shape[1] != H and (not gqa_ok or H % k.shape[1]):
        return f"{k.shape[1]} kv heads for {H} query heads"
    return kernel.head_size_problem(D)


def _dtypes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """q, k, v in the dtype torch's SDPA would compute in: autocast's (SDPA is on its lower-precision list) when
    autocast is on for their device, else their own, which must then agree (None: they do not)."""
    dev = q.device.type
    if torch.is_autocast_enabled(dev):
        dt = torch.get_autocast_dtype(dev)
        return tuple(t.to(dt) for t in (q, k, v))
    if not (q.dtype == k.dtype == v.dtype):
        return None
    return q, k, v


def _use_kernel(q: torch.Tensor, why: str | None, where: str) -> bool:
    """Whether this call runs the kernel; at det.attention=dettrain a call it cannot serve is an error."""
    if not kernel.attention_active(q):
        return False
    if why is None:
        return True
    if kernel.attention_strict():
        raise UserError(f"det.attention=dettrain: dettrain's attention kernel cannot serve {why} ({where}); set "
                        "det.attention=auto (torch's attention for such calls) or det.attention=torch")
    return False


# ---- torch.nn.functional.scaled_dot_product_attention --------------------------------------------------------------
def sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
         dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
         enable_gqa: bool = False) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` with the calls the kernel serves sent to it (``install``); the rest go
    to torch's, unchanged."""
    why = problem(query, key, value, causal=is_causal, mask=attn_mask, dropout=dropout_p, gqa_ok=enable_gqa)
    qkv = _dtypes(query, key, value) if why is None else None
    if why is None and qkv is None:
        why = f"q/k/v of dtypes {query.dtype}/{key.dtype}/{value.dtype}"
    if not _use_kernel(query, why, "torch.nn.functional.scaled_dot_product_attention"):
        return _TORCH_SDPA(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                           scale=scale, enable_gqa=enable_gqa)
    return kernel.attention(*qkv, scale)


# ---- Hugging Face transformers -------------------------------------------------------------------------------------
_HF_REFUSED = ("softcap", "s_aux", "sinks", "position_bias", "cu_seq_lens_q", "cu_seq_lens_k")
"""Keyword arguments of transformers' attention calls that change what is computed: any of them set (not None)
means the kernel does not serve the call."""


def _hf_problem(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask, dropout: float, kwargs: dict) -> str | None:
    causal = kwargs.get("is_causal")
    causal = getattr(module, "is_causal", True) if causal is None else causal
    why = problem(query, key, value, causal=bool(causal), mask=attention_mask, dropout=dropout)
    if why is not None:
        return why
    window = kwargs.get("sliding_window")
    if window is not None and window < query.shape[2]:
        return f"a sliding window of {window} < {query.shape[2]} tokens"
    for name in _HF_REFUSED:
        if kwargs.get(name) is not None:
            return f"the {name!r} argument"
    return None


def hf_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                 **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention interface (q/k/v (B, H, T, D), output (B, T, H, D)): the kernel for the calls it
    serves, transformers' own ``sdpa`` path for the rest (which may still reach the kernel through ``sdpa``)."""
    why = _hf_problem(module, query, key, value, attention_mask, dropout, kwargs)
    qkv = _dtypes(query, key, value) if why is None else None
    if why is None and qkv is None:
        why = f"q/k/v of dtypes {query.dtype}/{key.dtype}/{value.dtype}"
    if not _use_kernel(query, why, f"transformers attention in {type(module).__name__}"):
        return _HF_FALLBACK["attention"](module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    return kernel.attention(*qkv, scaling).transpose(1, 2).contiguous(), None


def _window_covers(kwargs: dict) -> bool:
    """Whether the sliding window of a mask request covers every (query, key) pair: then the mask is plain causal."""
    w, kv, q = kwargs.get("local_size"), kwargs.get("kv_length"), kwargs.get("q_length")
    offsets = (kwargs.get("q_offset", 0), kwargs.get("kv_offset", 0))
    if "cache_position" in kwargs or not all(isinstance(x, int) and x == 0 for x in offsets):
        return False
    return isinstance(w, int) and isinstance(kv, int) and isinstance(q, int) and q <= kv <= w


_PLAIN_INPUTS = False
"""True while ``dettrain.models.hf.HFCausalLM`` runs its model (``plain_inputs``): token ids only, so no padding and the
default positions 0..T-1 (no packed sequences)."""


def plain_inputs(on: bool) -> None:
    """Say that the HF forward now running gets token ids only (HFCausalLM sets it around its call, and clears it).
    While tracing (torch.compile), transformers cannot rule out packed sequences without reading the positions, so
    it materialises the causal mask; this tells ``hf_mask`` that the positions are the default ones."""
    global _PLAIN_INPUTS
    _PLAIN_INPUTS = bool(on)


def _plain_causal_request(kwargs: dict) -> bool:
    """Whether a mask request under ``plain_inputs`` is plain causal: no padding mask, no extra pattern (or/and
    mask functions: ``use_vmap``; a bidirectional request), queries and keys the same positions, and no window or
    chunk shorter than the sequence."""
    if kwargs.get("attention_mask") is not None or kwargs.get("use_vmap", False):
        return False
    if "allow_is_bidirectional_skip" in kwargs or "cache_position" in kwargs:
        return False
    q, kv = kwargs.get("q_length"), kwargs.get("kv_length")
    offsets = (kwargs.get("q_offset", 0), kwargs.get("kv_offset", 0))
    if not (isinstance(q, int) and q == kv and all(isinstance(x, int) and x == 0 for x in offsets)):
        return False
    local = kwargs.get("local_size")
    return local is None or (isinstance(local, int) and local >= kv)


def hf_mask(*args, **kwargs):
    """transformers' mask interface for ``attn_implementation="dettrain"``: the ``sdpa`` mask (None for a causal
    batch without padding, a boolean mask otherwise), with two facts transformers cannot know added:

    * under ``plain_inputs`` (dettrain's HFCausalLM: no padding, default positions, no cache) a plain causal request
      (``_plain_causal_request``) is None, also while tracing: transformers materialises the mask under
      torch.compile, since it cannot read the positions or the padding there (and, before torch 2.14, never skips);
    * a sliding window that covers the whole sequence is plain causal (sdpa materialises a mask for a window equal
      to the length)."""
    if _PLAIN_INPUTS and not args and _plain_causal_request(kwargs):
        return None
    if kwargs.get("local_size") is not None and _window_covers(kwargs):
        kwargs["local_size"] = None
    return _HF_FALLBACK["mask"](*args, **kwargs)


_HF_FALLBACK: dict = {}
"""transformers' own sdpa attention and mask functions, bound by ``register_hf`` (imported once, outside any traced
forward)."""


def register_hf() -> None:
    """Register ``hf_attention`` and ``hf_mask`` with transformers under ``HF_NAME`` (idempotent)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    _HF_FALLBACK.update(attention=sdpa_attention_forward, mask=sdpa_mask)
    AttentionInterface.register(HF_NAME, hf_attention)
    AttentionMaskInterface.register(HF_NAME, hf_mask)


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Causal attention in float64 by the textbook formula (tests and benchmarks compare the kernel with it)."""
    G = q.shape[1] // k.shape[1]
    qd, kd, vd = (t.double() for t in (q, k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)))
    s = (qd @ kd.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]) if scale is None else scale)
    T = q.shape[2]
    s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool, device=q.device).tril(), float("-inf"))
    return torch.softmax(s, -1) @ vd
