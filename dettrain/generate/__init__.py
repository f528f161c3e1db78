"""Generation whose logits equal the training forward's, bit for bit (``dettrain.generate``).

    from dettrain.generate import generate
    out = generate(model, [[1, 2, 3], [4, 5]], max_new_tokens=16, temperature=1.0, seed=0, ids=["a", "b"])
    out[0].tokens, out[0].logprobs, out[0].training_equal

A KV-cache generator for dettrain's LLaMA (models/llama.py) and the Hugging Face causal LMs dettrain trains
(models/hf.py: llama, qwen2, mistral): prefill (optionally in chunks of ``prefill_chunk`` positions), then one
decode step per new token; greedy (``temperature=0``) or sampled; each request stops at ``eos_id`` or after
``max_new_tokens``; prompts of any lengths in one batch of ``batch_size``.

The promise, for dettrain's LLaMA with det.batch_invariant on (``training_equal`` True): the logits from which each
new token is drawn equal, bit for bit, the logits the training forward (``model(tokens)``, train or eval mode,
dropout 0) computes at that position of the full sequence, whatever the batch, its other requests and their lengths,
the padding, the prefill chunk size, and whether the position came from prefill or decode.  Consequences:
``logprobs`` equal ``token_logprobs`` of the training forward's logits (what an RL trainer recomputes), and a
request's tokens do not depend on its neighbours, since sampling draws from a generator keyed by
(seed, request id, position) (``derive_seed``).  How (docs/generate.md):

* every row-wise op is batch-invariant: on CUDA dettrain's Triton kernels (kernels/batch_invariant.py, fixed tiles
  that never depend on the number of rows), on CPU kernels/rowwise.py (fixed trees of elementwise operations);
* the cache keeps each request at its own positions (slot j holds position j, the prompt right-aligned to nothing:
  no left padding inside the cache), so a query's keys sit where they sit in training;
* attention per query is the training attention's own arithmetic: on CPU ``rowwise.attention`` (the training
  forward calls the same function for its whole sequence); on CUDA the training kernel itself, run only for the
  query blocks that hold the step's rows (``kernels.attention.attention_rows``: each query's result depends on
  its own keys only, fixed key blocks from position 0, later keys masked; a decode step costs one query block
  per request and head, not the whole causal product);
* on CUDA the decode step is a CUDA graph, captured once per batch and replayed per token (``cuda_graphs``).

A setting that cannot keep the promise is refused (``UserError`` naming the key) unless ``exact=False``, which
generates and labels every completion ``training_equal=False`` with the reason in ``note``: det.batch_invariant off,
a Hugging Face model (transformers' own linear layers and norms are not batch-invariant), an attention route other
than dettrain's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from dettrain.determinism import derive_seed
from dettrain.errors import UserError
from dettrain.kernels import attention as attn_kernel
from dettrain.kernels import batch_invariant as bi
from dettrain.kernels import rowwise

__all__ = ["Completion", "exactness", "generate", "gumbel_noise", "token_logprobs"]


@dataclass
class Completion:
    """One request's result."""

    id: int | str
    """The request id (sampling is keyed by it)."""
    prompt: list[int]
    tokens: list[int]
    """The generated tokens (an end-of-text token included when it stopped there)."""
    logprobs: list[float]
    """log p(token) of each generated token under the model (temperature 1), as ``token_logprobs`` computes it."""
    finish: str
    """eos or length."""
    training_equal: bool
    """Whether every logit is promised equal to the training forward's (see the module docstring)."""
    note: str = ""
    """Why not, when training_equal is False."""
    logits: torch.Tensor | None = field(default=None, repr=False)
    """(len(tokens), V) fp32 logits each token was drawn from, when ``return_logits``."""


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(target) per row of ``logits`` (..., V), fp32, batch-invariant: the batch-invariant cross-entropy
    kernel's per-row loss on CUDA (``bi.cross_entropy_rows``), the row-wise log-softmax on CPU.  Use it on the
    training forward's logits to recompute a generation's log-probs (the sampler uses it).  The logits are taken
    in fp32 first: the kernel's reduction order depends on the dtype it loads, so bf16 logits and their fp32 copy
    give the same log-probs only through one dtype."""
    V = logits.shape[-1]
    logits = logits.float()
    if bi.active(logits):
        return -bi.cross_entropy_rows(logits.reshape(-1, V), targets.reshape(-1)).view(targets.shape)
    if bi.cpu_active(logits):
        return rowwise.token_logprobs(logits, targets)
    return -F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1), reduction="none").view(targets.shape)


def exactness(model: nn.Module) -> str | None:
    """None when generating from ``model`` keeps the promise in this process; otherwise why not (with the key)."""
    from dettrain.models.hf import HFCausalLM
    from dettrain.models.llama import Transformer

    if isinstance(model, HFCausalLM):
        return ("Hugging Face models run transformers' own linear layers and norms, which are not batch-invariant "
                "(dettrain's LLaMA is: model=tiny|125m|1b|7b)")
    if not isinstance(model, Transformer):
        return f"no KV-cache path for {type(model).__name__} (dettrain's LLaMA and Hugging Face models have one)"
    if not bi.enabled():
        return "det.batch_invariant is off: a row's logits depend on its batch; set det.batch_invariant=true"
    if compiled_modules(model):
        return (f"{', '.join(compiled_modules(model)[:3])} compiled (train.compile): Inductor fuses the training "
                "forward's elementwise operations (RoPE, silu x mul), so its bits are not the eager forward's that "
                "generation reproduces; train with train.compile=false (or generate from an uncompiled copy and "
                "recompute log-probs with it)")
    if model.cfg.dropout:
        return "model.dropout > 0: the batch-invariant attention has no dropout; set model.dropout=0"
    dev = model.tok_emb.weight.device
    if dev.type == "cuda" and not attn_kernel.attention_active(torch.empty(0, device=dev)):
        return "det.attention=torch: torch's attention is not batch-invariant; set det.attention=auto"
    if dev.type not in ("cpu", "cuda"):
        return f"no batch-invariant kernels on {dev.type}"
    return None


def compiled_modules(model: nn.Module) -> list[str]:
    """Names of ``model``'s modules whose forward is compiled (the trainer's ``forward = torch.compile(forward)``
    or ``Module.compile()``); "<model>" for the model itself."""
    out = []
    for name, m in model.named_modules():
        if hasattr(m.__dict__.get("forward"), "_torchdynamo_orig_callable") or \
                getattr(m, "_compiled_call_impl", None) is not None:
            out.append(name or "<model>")
    return out


def gumbel_noise(seed: int, rid: int | str, position: int, vocab: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The Gumbel noise (float64, ``vocab`` values) that sampling adds at ``position`` of request ``rid``:
    -log(-log(u)) of uniforms from a CPU generator seeded with ``derive_seed(seed, "generate", rid, position)``.
    The token drawn is argmax(logits / temperature + noise) (an exact draw from softmax(logits / temperature)),
    so it depends on (seed, request, position) and the request's own logits only."""
    g = torch.Generator().manual_seed(derive_seed(seed, "generate", rid, position))
    u = torch.rand(vocab, generator=g, dtype=torch.float64, out=out)
    return u.log_().neg_().log_().neg_()


class _NoiseFeed:
    """Each sampled step's noise rows (B, V), drawn on the host and sent to the device from one of two pinned
    buffers, so the host draws the next step's noise while the device runs this one and never waits for it (a
    buffer is refilled only once its previous copy has been made)."""

    def __init__(self, B: int, V: int, device: torch.device) -> None:
        self.device, pin = device, device.type == "cuda"
        self.bufs = [torch.empty(B, V, dtype=torch.float64, pin_memory=pin) for _ in range(2 if pin else 1)]
        self.copied: list = [None] * len(self.bufs)

    def rows(self, step: int, seed: int, ids: list, positions: list[int]) -> torch.Tensor:
        k = step % len(self.bufs)
        if self.copied[k] is not None:
            self.copied[k].synchronize()
        buf = self.bufs[k]
        for b, (rid, at) in enumerate(zip(ids, positions)):
            gumbel_noise(seed, rid, at, buf.shape[1], out=buf[b])
        if self.device.type != "cuda":
            return buf
        noise = buf.to(self.device, non_blocking=True)
        self.copied[k] = torch.cuda.Event()
        self.copied[k].record()
        return noise


def generate(model: nn.Module, prompts: list[list[int]] | torch.Tensor, *, max_new_tokens: int,
             temperature: float = 0.0, seed: int = 0, ids: list[int | str] | None = None, eos_id: int | None = None,
             batch_size: int | None = None, prefill_chunk: int | None = None, exact: bool = True,
             return_logits: bool = False, attention_mask: torch.Tensor | None = None,
             cuda_graphs: bool = True) -> list[Completion]:
    """Generate up to ``max_new_tokens`` tokens after each prompt (lists of token ids, any lengths; or a padded
    (B, T) tensor with ``attention_mask``, 1 for a real token, padding left or right: the real tokens are what
    counts, the padding never reaches a request's bits).

    ``ids``: the request ids that key sampling (default: the prompts' indices); ``temperature`` 0: greedy;
    ``eos_id``: stop a request after this token; ``batch_size``: requests per batch (default: all);
    ``prefill_chunk``: prompt positions per prefill step (default: the whole prompt); ``exact``: refuse (UserError)
    when the promise cannot hold (``exactness``), else generate and label; ``cuda_graphs``: on CUDA, replay each
    batch's decode step as a CUDA graph (False launches the same kernels from Python).  Runs in eval mode under
    no_grad on the model's device; the model's mode is restored."""
    if isinstance(prompts, torch.Tensor):
        if attention_mask is None or attention_mask.shape != prompts.shape:
            raise UserError("generate: a padded prompt tensor needs attention_mask of its shape (1: token, 0: pad)")
        prompts = [row[m.bool()].tolist() for row, m in zip(prompts.cpu(), attention_mask.cpu())]
    ids = list(range(len(prompts))) if ids is None else list(ids)
    if len(ids) != len(prompts):
        raise UserError(f"generate: {len(ids)} ids for {len(prompts)} prompts")
    if len(set(ids)) != len(ids):
        raise UserError("generate: request ids must be distinct (sampling is keyed by them)")
    if max_new_tokens < 1:
        raise UserError(f"generate: max_new_tokens={max_new_tokens} must be >= 1")
    if prefill_chunk is not None and prefill_chunk < 1:
        raise UserError(f"generate: prefill_chunk={prefill_chunk} must be >= 1")
    if any(len(p) == 0 for p in prompts):
        raise UserError("generate: every prompt needs at least one token")
    why = exactness(model)
    if why is not None and exact:
        raise UserError(f"generation cannot promise training-equal logits: {why} (or generate with exact=False / "
                        "--inexact: completions are then labelled training_equal=false)")
    step_fn = _stepper(model, why, cuda_graphs)
    was_training = model.training
    model.eval()
    try:
        out: list[Completion] = []
        bs = batch_size or len(prompts) or 1
        with torch.no_grad():
            for i in range(0, len(prompts), bs):
                out += _generate_batch(step_fn, prompts[i:i + bs], ids[i:i + bs], max_new_tokens, temperature,
                                       seed, eos_id, prefill_chunk, why, return_logits)
        return out
    finally:
        model.train(was_training)


def _stepper(model: nn.Module, why: str | None, cuda_graphs: bool = True):
    from dettrain.generate.hf import HFStepper
    from dettrain.generate.llama import LlamaStepper
    from dettrain.models.hf import HFCausalLM
    from dettrain.models.llama import Transformer

    if isinstance(model, Transformer):
        return LlamaStepper(model, exact=why is None, cuda_graphs=cuda_graphs)
    if isinstance(model, HFCausalLM):
        return HFStepper(model)
    raise UserError(f"generate: {why}")


# decoding brings its tokens to the host every this many steps (a request's end-of-text is seen then): between, the
# steps run back to back on the device (CUDA), the host never waiting on it (a sampled step's noise is drawn on the
# host ahead of the device, _NoiseFeed); at most DRAIN_EVERY - 1 steps run after the last request has ended, their
# results dropped
DRAIN_EVERY = 16


def _generate_batch(stepper, prompts: list[list[int]], ids: list, max_new: int, temperature: float, seed: int,
                    eos_id: int | None, chunk: int | None, why: str | None, return_logits: bool) -> list[Completion]:
    lengths = [len(p) for p in prompts]
    total = max(n + max_new for n in lengths)
    state = stepper.start(prompts, total)
    last = stepper.prefill(state, prompts, chunk)  # (B, V): the logits at each prompt's last position
    B, dev = len(prompts), last.device
    new: list[list[int]] = [[] for _ in range(B)]
    lps: list[list[float]] = [[] for _ in range(B)]
    kept: list[list[torch.Tensor]] = [[] for _ in range(B)]
    finish = [""] * B
    pos = torch.tensor(lengths, device=dev)  # the position of each request's next token
    # each step's picks, log-probs (and logits) stay on the device until drain() brings them over in one transfer
    feed = _NoiseFeed(B, last.shape[-1], dev) if temperature > 0 else None
    steps: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = []

    def drain() -> bool:
        """Take the pending steps into each request's completion; whether every request has finished."""
        if not steps:
            return all(finish)
        picks = torch.stack([p for p, _, _ in steps], 1).tolist()
        lp = torch.stack([q for _, q, _ in steps], 1).tolist()
        rows = torch.stack([r for _, _, r in steps], 1).cpu() if return_logits else None
        for b in range(B):
            for j, t in enumerate(picks[b]):
                if finish[b]:
                    break
                new[b].append(t)
                lps[b].append(lp[b][j])
                if return_logits:
                    kept[b].append(rows[b, j])
                if eos_id is not None and t == eos_id:
                    finish[b] = "eos"
                elif len(new[b]) == max_new:
                    finish[b] = "length"
        steps.clear()
        return all(finish)

    for step in range(max_new):
        # one pick and one log-prob per row for the whole batch (each row's values are its own: argmax and the
        # row-wise log-prob kernels do not mix rows)
        if temperature <= 0:
            pick = torch.argmax(last, dim=-1)  # the first maximum: a fixed tie-break
        else:  # fp64 division and addition are correctly rounded on every device: the same draw anywhere
            noise = feed.rows(step, seed, ids, [n + step for n in lengths])
            pick = torch.argmax(last.double() / temperature + noise, dim=-1)
        steps.append((pick, token_logprobs(last, pick), last.to(torch.float32, copy=True) if return_logits else None))
        if step == max_new - 1 or ((step + 1) % DRAIN_EVERY == 0 and drain()):
            break
        # every request steps at its next position; a finished one goes on too (its rows are its own, and what
        # it computes after its end is dropped by drain)
        last = stepper.decode(state, pick, pos, top=max(lengths) + step + 1)
        pos = pos + 1
    drain()
    return [Completion(ids[b], list(prompts[b]), new[b], lps[b], finish[b], why is None, why or "",
                       torch.stack(kept[b]) if return_logits else None) for b in range(B)]
