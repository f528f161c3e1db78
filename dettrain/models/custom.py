"""Your own model through Hydra: ``model=custom`` with ``model._target_: pkg.factory`` (docs/custom_models.md).

The ``custom`` node is flat, as Hydra users write ``instantiate`` configs: ``_target_`` names a callable (a function
or an ``nn.Module`` class), and every other key of ``model.*`` except ``name`` is one of its keyword arguments.
``model.vocab_size`` and ``model.seq_len`` are typed and read by the harness (the data needs the context length,
the token check needs the vocabulary); the factory receives each of them only if its signature takes it (a
parameter of that name, or ``**kwargs``), so a plain ``nn.Module(vocab_size, dim)`` works as it is.  Any other key
is the factory's own and must be one of its parameters (``model.hidden=512`` overrides a key the YAML declares,
``+model.new_key=1`` adds one).

The factory runs under ``torch.device(device)`` and under a torch RNG seeded from ``derive_seed(seed, "init",
"custom")``, the same on every rank: a model that keeps PyTorch's default initialisation starts from the same values
on every rank and world size.  For init keyed by (seed, parameter name) -- independent of construction order and of
which parameters exist -- the factory calls ``dettrain.models.llama.init_by_name(module, seed)``, with the run's seed
passed as a key (``seed: ${seed}`` in the YAML).

The built module is checked once: it has parameters, every parameter fp32, and a forward of token ids (2, 3)
returns a tensor (2, 3, vocab_size) of logits (B != T, so a time-major (T, B, V) output is caught).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

from dettrain.errors import UserError
from dettrain.models import check_vocab_size

HARNESS_ONLY = ("_target_", "name", "allow_unused")
"""Keys of the custom node that are not passed to the factory."""
HARNESS_READ = ("vocab_size", "seq_len")
"""Keys the harness reads, passed to the factory only when its signature takes them."""
_HYDRA_KEYS = ("_recursive_", "_convert_", "_partial_", "_args_")


@dataclass
class CustomModelConfig:
    """Your own model (``model=custom``): ``_target_`` and keyword arguments; see docs/custom_models.md."""

    _target_: str = "???"
    """Import path of the factory: a function or nn.Module class taking the other keys as keyword arguments and
    returning a module that maps token ids (B, T) to logits (B, T, vocab_size)."""
    name: str = "custom"
    """Name of the model (informational; not passed to the factory)."""
    vocab_size: int = 256
    """Vocabulary size; must exceed every token id of the data (0: data.path's sidecar).  Passed to the factory
    when its signature takes ``vocab_size`` (or ``**kwargs``)."""
    seq_len: int = 128
    """Training context length in tokens.  Passed to the factory when its signature takes ``seq_len`` (or
    ``**kwargs``)."""
    allow_unused: bool = False
    """Parameters without a gradient in the first step: refused (false, exit 2 naming them) or left out of the
    update and of weight decay (true).  Not passed to the factory."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Every other key of the ``model`` node (written flat in YAML and on the command line, not under 'kwargs')."""

    def as_dict(self) -> dict[str, Any]:
        """The flat node as written in YAML (what the run dir's config.yaml and the config hash hold)."""
        return {"_target_": self._target_, "name": self.name, "vocab_size": self.vocab_size,
                "seq_len": self.seq_len, **({"allow_unused": True} if self.allow_unused else {}), **self.kwargs}

    def factory_kwargs(self, fn: Any = None) -> dict[str, Any]:
        """The keyword arguments the factory ``fn`` gets: its own keys, and vocab_size/seq_len where ``fn``'s
        signature takes them (all of them when ``fn`` is None or has no signature)."""
        return {**{k: getattr(self, k) for k in HARNESS_READ if takes(fn, k)}, **self.kwargs}


def takes(fn: Any, key: str) -> bool:
    """Whether ``fn`` accepts the keyword argument ``key``: a parameter of that name that can be passed by keyword,
    or ``**kwargs``.  True when ``fn`` is None or its signature cannot be read (a builtin: the call will tell)."""
    if fn is None:
        return True
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return True
    p = params.get(key)
    if p is not None and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
        return True
    return any(q.kind is q.VAR_KEYWORD for q in params.values())


def is_custom(node: Any) -> bool:
    """Whether a model node (dataclass, dict or DictConfig) names a factory with ``_target_``."""
    if isinstance(node, CustomModelConfig):
        return True
    try:
        return "_target_" in node
    except TypeError:
        return False


def _int_key(node: dict, key: str, default: int) -> int:
    v = node.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, str)):
        raise UserError(f"model.{key}={v!r} is not an integer")
    try:
        return int(v)
    except ValueError:
        raise UserError(f"model.{key}={v!r} is not an integer") from None


def from_node(node: dict) -> CustomModelConfig:
    """The typed CustomModelConfig of a flat ``model`` node (a plain dict, interpolations resolved)."""
    target = node.get("_target_")
    if not isinstance(target, str) or not target or target == "???":
        raise UserError("model._target_ is not set: model=custom needs model._target_=pkg.module.factory (in your "
                        "experiment YAML or on the command line)")
    extra = {k: v for k, v in node.items() if k not in (*HARNESS_ONLY, "vocab_size", "seq_len")}
    allow = node.get("allow_unused", False)
    if not isinstance(allow, bool):
        raise UserError(f"model.allow_unused={allow!r} must be true or false")
    return CustomModelConfig(_target_=target, name=str(node.get("name", "custom")),
                             vocab_size=_int_key(node, "vocab_size", 256), seq_len=_int_key(node, "seq_len", 128),
                             allow_unused=allow, kwargs=extra)


def validate_custom(cfg: CustomModelConfig) -> None:
    for key in ("vocab_size", "seq_len"):
        if getattr(cfg, key) <= 0:
            raise UserError(f"model.{key} must be positive, got {getattr(cfg, key)}")
    check_vocab_size(cfg.vocab_size)
    _resolve_target(cfg)


def _resolve_target(cfg: CustomModelConfig):
    """The factory object; UserError when it cannot be imported or does not take the configured keys."""
    from hydra.utils import get_object

    try:
        fn = get_object(cfg._target_)
    except Exception as e:  # noqa: BLE001 - Hydra wraps import errors of every kind
        cause = e.__cause__ or e
        raise UserError(f"model._target_={cfg._target_!r} cannot be imported ({type(cause).__name__}: "
                        f"{str(cause).splitlines()[0] if str(cause) else ''}); is its package on PYTHONPATH?") from None
    if not callable(fn):
        raise UserError(f"model._target_={cfg._target_!r} is a {type(fn).__name__}, not a callable")
    kwargs = {k: v for k, v in cfg.factory_kwargs(fn).items() if k not in _HYDRA_KEYS}
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return fn  # a builtin without a signature: let the call tell
    try:
        sig.bind(**kwargs)
    except TypeError as e:
        raise UserError(f"model._target_={cfg._target_!r} does not take the keys of model.* ({e}); every key of "
                        "the model node except _target_ and name is passed to it (vocab_size and seq_len only "
                        "when its signature names them); remove the key or add the parameter") from None
    return fn


def build_custom_model(cfg: CustomModelConfig, seed: int, device) -> Any:
    """Instantiate the factory on ``device`` under the seeded init RNG, then check the contract."""
    import torch
    from hydra.utils import instantiate

    from dettrain.determinism import derive_seed

    fn = _resolve_target(cfg)
    device = torch.device(device)
    # plain dicts/lists, not DictConfig; vocab_size/seq_len only where the factory takes them
    node = {"_target_": cfg._target_, "_convert_": "all", **cfg.factory_kwargs(fn)}
    cuda = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda), torch.device(device):
        torch.manual_seed(derive_seed(seed, "init", "custom"))  # the same on every rank: never keyed by rank
        model = _instantiate(instantiate, node, cfg)
    if not isinstance(model, torch.nn.Module):
        raise UserError(f"model._target_={cfg._target_!r} returned a {type(model).__name__}, not a torch.nn.Module")
    if device.type != "meta":
        model.to(device)
    if not any(p.requires_grad for p in model.parameters()):
        raise UserError(f"model._target_={cfg._target_!r} built a {type(model).__name__} with no trainable parameters "
                        "(nothing for the optimizer to update); register them as nn.Parameter / submodules, or leave "
                        "requires_grad on for at least one")
    bad = [n for n, p in model.named_parameters() if p.dtype != torch.float32]
    if bad:
        raise UserError(f"model._target_={cfg._target_!r}: parameters must be fp32 (master weights; use "
                        f"train.precision=bf16 for lower-precision compute), got non-fp32 {bad[:3]}")
    if device.type != "meta":
        _check_logits(model, cfg, device)
    return model


def _instantiate(instantiate, node: dict, cfg: CustomModelConfig) -> Any:
    """Hydra's ``instantiate(node)`` without Hydra's wrapper around what the factory raised.

    Hydra re-raises every exception of the call as an InstantiationException whose message is one ``repr``: a
    UserError raised by the factory (dettrain.models.hf without transformers) comes back as that UserError, so it prints
    as one line with exit 2; any other exception is the factory's own bug and is re-raised as itself, with its
    traceback through the user's code, after a line that says whose it is."""
    import sys

    from hydra.errors import InstantiationException

    try:
        return instantiate(node)
    except InstantiationException as e:
        err = e
    cause = err.__cause__
    seen = set()
    c = cause
    while c is not None and id(c) not in seen:  # a UserError anywhere down the chain is the message to show
        if isinstance(c, UserError):
            raise c.with_traceback(None) from None
        seen.add(id(c))
        c = c.__cause__ or c.__context__
    if cause is None:  # Hydra's own complaint (no exception of the factory behind it)
        raise UserError(f"model._target_={cfg._target_!r}: {' '.join(str(err).split())}") from None
    print(f"dettrain: model._target_={cfg._target_!r} raised {type(cause).__name__} while building the model; the "
          "traceback below runs through your factory (fix it there, or check the model.* keys it was given)",
          file=sys.stderr, flush=True)
    raise cause  # outside the except block: its own traceback and chain, not Hydra's wrapper


def _check_logits(model, cfg: CustomModelConfig, device) -> None:
    """One forward of (B, T) token ids in eval mode (no buffer updates, no randomness): logits (B, T, V).  B > 1 and
    T > 1 where seq_len allows, and B != T, so that a model returning (T, B, V) -- or one that flattens or drops
    the batch dimension -- fails here instead of training on misaligned targets."""
    import torch

    t = min(3, cfg.seq_len)
    b = 3 if t == 2 else 2  # B != T: a transposed output has another shape
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            tokens = torch.arange(b * t, device=device).remainder(max(cfg.vocab_size, 1)).view(b, t)
            out = model(tokens)
    finally:
        model.train(was_training)
    want = (b, t, cfg.vocab_size)
    if not torch.is_tensor(out) or tuple(out.shape) != want:
        got = tuple(out.shape) if torch.is_tensor(out) else type(out).__name__
        hint = " (that is (T, B, V): return batch-first logits)" if got == (t, b, cfg.vocab_size) else ""
        raise UserError(f"model._target_={cfg._target_!r}: the model must map token ids (B, T) to logits "
                        f"(B, T, model.vocab_size); tokens ({b}, {t}) gave {got}, expected {want}{hint}")
