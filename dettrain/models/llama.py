"""LLaMA-style decoder: RMSNorm, RoPE, SwiGLU, grouped-query attention through scaled_dot_product_attention.

Sizes come from the ``model`` config group (conf/model/{tiny,125m,1b,7b}.yaml).  Parameter initialisation is keyed
by (seed, parameter name) through ``derive_seed``, so a parameter's initial value does not depend on construction
order, on which parameters exist beside it, or on how many devices there are.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from dettrain.determinism import derive_seed
from dettrain.errors import UserError
from dettrain.kernels import attention as attn
from dettrain.kernels import batch_invariant as bi
from dettrain.kernels import rowwise
from dettrain.models import check_vocab_size


@dataclass
class ModelConfig:
    """Model shape (``model.*``); pick a preset with ``model=tiny|125m|1b|7b`` and override single fields."""

    name: str = "tiny"
    """Preset name (informational; set by conf/model/*.yaml)."""
    dim: int = 128
    """Residual stream width."""
    n_layers: int = 4
    """Number of transformer blocks."""
    n_heads: int = 4
    """Attention heads (query)."""
    n_kv_heads: int | None = 2
    """Key/value heads for grouped-query attention (None: same as n_heads); must divide n_heads."""
    ffn_dim: int = 352
    """SwiGLU hidden width."""
    vocab_size: int = 256
    """Vocabulary size; must exceed every token id in data.path.  0: data.path's sidecar (written by prepare; 257
    for byte-level files with end-of-text tokens), 256 for the embedded corpus."""
    seq_len: int = 128
    """Training context length in tokens."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    rope_theta: float = 10000.0
    """RoPE base."""
    tie_embeddings: bool = False
    """Share the token embedding with the output projection."""
    dropout: float = 0.0
    """Dropout on attention and residual outputs (draws keyed by step and global micro-batch index)."""
    activation_checkpointing: bool = False
    """Recompute each block in backward (torch.utils.checkpoint, non-reentrant) to save activation memory."""
    init_std: float = 0.02
    """Std of the normal init; output projections are scaled by 1/sqrt(2 * n_layers)."""
    allow_unused: bool = False
    """Trainable parameters that receive no gradient in the first step are refused (exit 2, naming them: they would
    only be decayed, never trained); true: leave them out of the update and of weight decay instead.  The same key
    for model=custom (docs/custom_models.md); every parameter of dettrain's LLaMA gets a gradient."""


class Linear(nn.Linear):
    """nn.Linear (same parameters and state dict) whose matmul is batch-invariant under det.batch_invariant."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if bi.active(x) and self.bias is None:
            return bi.linear(x, self.weight)
        if bi.cpu_active(x):  # det.batch_invariant on CPU: a tree sum per output element (kernels/rowwise.py)
            return rowwise.linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if bi.active(x):  # det.batch_invariant on CUDA: one fixed reduction per row (kernels/batch_invariant.py)
            return bi.rms_norm(x, self.weight, self.eps)
        if bi.cpu_active(x):
            return rowwise.rms_norm(x, self.weight, self.eps)
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).type_as(x)


def rope_tables(head_dim: int, seq_len: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables (seq_len, head_dim/2), computed in float64 then rounded: the same on every device."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    ang = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv)
    return ang.cos().float().to(device), ang.sin().float().to(device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (B, H, T, D); rotate pairs (even, odd)
    T = x.shape[-2]
    x1, x2 = x.float()[..., 0::2], x.float()[..., 1::2]
    c, s = cos[:T], sin[:T]
    out = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)
    return out.type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.n_kv = cfg.n_kv_heads or cfg.n_heads
        self.head_dim = cfg.dim // cfg.n_heads
        self.wq = Linear(cfg.dim, self.n_heads * self.head_dim, bias=False)
        self.wk = Linear(cfg.dim, self.n_kv * self.head_dim, bias=False)
        self.wv = Linear(cfg.dim, self.n_kv * self.head_dim, bias=False)
        self.wo = Linear(self.n_heads * self.head_dim, cfg.dim, bias=False)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if bi.cpu_active(q):  # det.batch_invariant on CPU: each query over its keys in fixed blocks (rowwise.py)
            if self.dropout and self.training:
                raise UserError("det.batch_invariant=true needs model.dropout=0 (the batch-invariant attention has "
                                "no dropout); set model.dropout=0 or det.batch_invariant=false")
            return self.wo(rowwise.causal_attention(q, k, v).transpose(1, 2).reshape(B, T, -1))
        ours = attn.attention_active(q)  # dettrain's causal flash attention: deterministic, batch-invariant, GQA
        if ours and self.dropout and self.training:  # the kernel has no dropout
            if bi.enabled():
                raise RuntimeError("det.batch_invariant=true needs model.dropout=0 (dettrain's attention kernel has "
                                   "no dropout); set model.dropout=0 or det.batch_invariant=false")
            if attn.attention_strict():
                raise UserError("det.attention=dettrain needs model.dropout=0 while training (dettrain's attention "
                                "kernel has no dropout); set model.dropout=0 or det.attention=auto|torch")
            ours = False  # tiers 2-3: torch's SDPA in deterministic mode instead
        if ours:
            return self.wo(attn.attention(q, k, v).transpose(1, 2).reshape(B, T, -1))
        if self.n_kv != self.n_heads:  # grouped-query attention: each kv head serves n_heads / n_kv query heads
            rep = self.n_heads // self.n_kv
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.w1 = Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w3 = Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        act = rowwise.silu if bi.cpu_active(x) else F.silu  # torch's CPU silu: other bits in a tensor's tail
        return self.w2(act(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn = FeedForward(cfg)
        self.dropout = nn.Dropout(cfg.dropout)
        self.checkpointing = cfg.activation_checkpointing

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # activation checkpointing lives inside the block, so whatever wraps the block (FSDP2's input casts and
        # parameter all-gathers, torch.compile of the whole block) stays outside the recomputed region
        if self.checkpointing and self.training:
            return torch.utils.checkpoint.checkpoint(self._forward, x, cos, sin, use_reentrant=False)
        return self._forward(x, cos, sin)

    def _forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.dropout(self.attn(self.attn_norm(x), cos, sin))
        return x + self.dropout(self.ffn(self.ffn_norm(x)))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        validate_model(cfg)
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = None if cfg.tie_embeddings else Linear(cfg.dim, cfg.vocab_size, bias=False)
        cos, sin = rope_tables(cfg.dim // cfg.n_heads, cfg.seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(tokens)
        for layer in self.layers:  # each block checkpoints itself (Block.forward) when asked to
            x = layer(x, self.rope_cos, self.rope_sin)
        return self.head(self.norm(x))

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of the final-normed hidden states (the output projection, or the tied embedding)."""
        w = self.tok_emb.weight if self.output is None else self.output.weight
        if bi.cpu_active(x):
            return rowwise.linear(x, w)
        return bi.linear(x, w) if bi.active(x) else F.linear(x, w)


def validate_model(cfg: ModelConfig) -> None:
    for key in ("dim", "n_layers", "n_heads", "ffn_dim", "vocab_size", "seq_len"):
        if getattr(cfg, key) <= 0:
            raise UserError(f"model.{key} must be positive, got {getattr(cfg, key)}")
    if cfg.dim % cfg.n_heads:
        raise UserError(f"model.dim={cfg.dim} must be divisible by model.n_heads={cfg.n_heads}")
    if (cfg.dim // cfg.n_heads) % 2:
        raise UserError("model.dim / model.n_heads must be even for RoPE; change model.dim or model.n_heads")
    if cfg.n_kv_heads is not None and cfg.n_kv_heads <= 0:
        raise UserError(f"model.n_kv_heads={cfg.n_kv_heads} must be positive (or null: model.n_heads)")
    kv = cfg.n_kv_heads or cfg.n_heads
    if cfg.n_heads % kv:
        raise UserError(f"model.n_kv_heads={kv} must divide model.n_heads={cfg.n_heads}")
    if not 0 <= cfg.dropout < 1:
        raise UserError(f"model.dropout={cfg.dropout} must lie in [0, 1)")
    check_vocab_size(cfg.vocab_size)
    # `not x > 0` also refuses nan; each of these would otherwise surface as a non-finite loss blamed on the optimizer
    if not cfg.norm_eps > 0:
        raise UserError(f"model.norm_eps={cfg.norm_eps} must be positive (RMSNorm divides by sqrt(mean(x^2) + "
                        "eps)), e.g. model.norm_eps=1e-5")
    if not (cfg.rope_theta > 0 and math.isfinite(cfg.rope_theta)):
        raise UserError(f"model.rope_theta={cfg.rope_theta} must be a finite positive number (the RoPE base: "
                        "frequencies theta^(-2i/d)), e.g. model.rope_theta=10000")
    if not (cfg.init_std >= 0 and math.isfinite(cfg.init_std)):
        raise UserError(f"model.init_std={cfg.init_std} must be a finite number >= 0 (std of the normal init), "
                        "e.g. model.init_std=0.02")


@torch.no_grad()
def init_by_name(model: nn.Module, seed: int, std: float | Callable[[str, nn.Parameter], float | None] = 0.02) -> None:
    """Draw parameters from N(0, std) with one generator per parameter keyed by (seed, parameter name).

    A parameter's value then depends only on the seed, its name and its shape: not on construction order, on the
    other parameters, on sharding or on the number of devices.  ``std`` is a number, applied
    to every parameter of two or more dimensions (biases and norm gains are left as the module built them), or a
    function ``(name, parameter) -> std | None`` deciding per parameter (None: leave it).  Values are drawn on the
    parameter's device type (CPU and CUDA draws differ, which the tier promise allows: same hardware type); meta
    parameters are skipped.  Custom models call it from their factory (docs/custom_models.md)."""
    rule = std if callable(std) else (lambda _name, p: std if p.dim() >= 2 else None)
    for name, p in model.named_parameters():
        if p.device.type == "meta":
            continue
        s = rule(name, p)
        if s is None:
            continue
        g = torch.Generator(device=p.device).manual_seed(derive_seed(seed, "init", name))
        p.normal_(0.0, float(s), generator=g)


@torch.no_grad()
def init_parameters(model: Transformer, seed: int) -> None:
    """Initialise dettrain's LLaMA by ``init_by_name``: norm gains 1, output projections (wo, w2) scaled by
    1/sqrt(2 * n_layers), everything else N(0, init_std)."""
    cfg = model.cfg

    def std(name: str, p: nn.Parameter) -> float | None:
        if name.endswith("norm.weight"):
            p.fill_(1.0)
            return None
        if name.endswith(("wo.weight", "w2.weight")):
            return cfg.init_std / math.sqrt(2 * cfg.n_layers)
        return cfg.init_std

    init_by_name(model, seed, std)


def build_model(cfg, seed: int, device: torch.device | str = "cpu") -> nn.Module:
    """Build and initialise the model of ``cfg`` (the ``model`` node) on ``device`` ("meta" builds shapes only):
    dettrain's LLaMA for a ModelConfig, the factory of ``model._target_`` for a CustomModelConfig (model=custom)."""
    from dettrain.models.custom import CustomModelConfig, build_custom_model

    if isinstance(cfg, CustomModelConfig):
        return build_custom_model(cfg, seed, device)
    with torch.device(device):
        model = Transformer(cfg)
    init_parameters(model, seed)
    return model


def num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
