"""The KV-cache steps of a Hugging Face causal LM (``dettrain.models.hf.from_config``): transformers' own cache.

Prompts are left-padded with an attention mask and explicit positions (each request at 0, 1, ...), so a request
sees only its own tokens; prefill may run in chunks.  transformers' linear layers and norms are not batch-invariant,
so these completions are labelled ``training_equal=False`` (``dettrain.generate.exactness``).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from dettrain.models.hf import HFCausalLM


@dataclass
class _State:
    cache: object
    mask: torch.Tensor  # (B, slots so far): 1 for a real token
    pad: torch.Tensor  # (B,): left padding of each request


class HFStepper:
    def __init__(self, model: HFCausalLM) -> None:
        self.hf = model.hf
        self.device = next(model.parameters()).device
        # transformers 5 renames the cache argument (past_key_values is deprecated); older versions lack ``cache``
        self.cache_arg = "cache" if "cache" in inspect.signature(self.hf.forward).parameters else "past_key_values"

    def start(self, prompts: list[list[int]], total: int) -> _State:
        n = max(map(len, prompts))
        pad = torch.tensor([n - len(p) for p in prompts], device=self.device)
        return _State(None, torch.zeros(len(prompts), 0, dtype=torch.long, device=self.device), pad)

    def _run(self, st: _State, toks: torch.Tensor, pos: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        st.mask = torch.cat([st.mask, real.long()], 1)
        out = self.hf(input_ids=toks, attention_mask=st.mask, position_ids=pos.clamp(min=0), use_cache=True,
                      return_dict=True, **{self.cache_arg: st.cache})
        cache = getattr(out, "cache", None)
        st.cache = cache if cache is not None else out.past_key_values
        return out.logits.float()

    def prefill(self, st: _State, prompts: list[list[int]], chunk: int | None) -> torch.Tensor:
        B, n = len(prompts), max(map(len, prompts))
        toks = torch.zeros(B, n, dtype=torch.long, device=self.device)
        for b, p in enumerate(prompts):
            toks[b, n - len(p):] = torch.tensor(p, dtype=torch.long)
        pos = torch.arange(n, device=self.device)[None, :] - st.pad[:, None]
        c = chunk or n
        logits = None
        for c0 in range(0, n, c):
            logits = self._run(st, toks[:, c0:c0 + c], pos[:, c0:c0 + c], pos[:, c0:c0 + c] >= 0)
        return logits[:, -1]

    def decode(self, st: _State, tokens: torch.Tensor, positions: torch.Tensor, top: int) -> torch.Tensor:
        toks = tokens.to(self.device, torch.long).view(-1, 1)
        pos = positions.to(self.device, torch.long).view(-1, 1)
        return self._run(st, toks, pos, torch.ones_like(pos, dtype=torch.bool))[:, 0]
