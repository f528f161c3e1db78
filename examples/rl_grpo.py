"""On-policy RL whose importance ratio is exactly 1.0: GRPO-style training of a tiny LLaMA on a verifiable toy task.

    python examples/rl_grpo.py --out runs/rl                                    # one process, tier 4
    torchrun --nproc-per-node=2 examples/rl_grpo.py --out runs/rl2              # two ranks
    python -m dettrain.diff runs/rl runs/rl2                                    # identical ledgers (tier 4)
    python examples/rl_grpo.py --out runs/rl3 --tier 3                          # tier 3: identical reruns

The task: a prompt is four digits (tokens 0-9); the policy earns reward for each of its ``NEW`` tokens that repeats
the prompt's first digit.  Each step draws ``PROMPTS`` prompts (keyed by seed and step), samples ``GROUP``
completions of each with ``dettrain.generate`` (keyed by seed, request and position, so every rank draws the same
tokens for a request whatever else it generates), and takes one policy-gradient step on the group-normalised
advantages (GRPO without a KL term).  A micro-batch is one prompt's group; the ranks split the micro-batches.

Why the ratio is exactly 1: with det.batch_invariant on, the sampler's logits equal the training forward's for the
same tokens, whatever the batch (generation runs this rank's groups together, training one group at a time), so
the trainer's recomputed log-probs equal the sampler's bit for bit and exp(new - old) is 1.0 for every token of
every step: the loop asserts it.  The ledger carries the generation's fingerprints (``gen_prompts``,
``gen_tokens``, ``gen_logprobs``) beside the trainer's, so ``dettrain diff`` compares them too.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

import dettrain
from dettrain.determinism import derive_seed
from dettrain.generate import generate, token_logprobs
from dettrain.kernels import batch_invariant as bi
from dettrain.models.llama import ModelConfig, build_model
from dettrain.record.fingerprint import fingerprint, format_fp, sum_u64

PROMPTS, GROUP, PROMPT_LEN, NEW = 4, 4, 4, 3  # 4 prompts x 4 samples a step; each micro-batch one prompt's group
MODEL = ModelConfig(dim=32, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=64, vocab_size=16, seq_len=16)


def reward(prompt: list[int], tokens: list[int]) -> float:
    """The verifiable reward: the share of generated tokens equal to the prompt's first digit."""
    return sum(t == prompt[0] for t in tokens) / len(tokens)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="directory for ledger.jsonl")
    ap.add_argument("--tier", type=int, default=4, choices=[3, 4])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    info = dettrain.setup(tier=args.tier, seed=args.seed)  # dettrain: tier settings, process group, seeds
    bi.set_enabled(True)  # batch-invariant kernels: the sampler's logits are the trainer's (kernels/rowwise.py on CPU)
    model = build_model(MODEL, args.seed, info.device)  # initialised by (seed, parameter name): the same everywhere
    sync = dettrain.GradSync(model, accumulate="tree" if args.tier >= 4 else "fold")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, foreach=False)
    ledger = dettrain.StepLedger(Path(args.out) / "ledger.jsonl", model, opt, tier=args.tier,
                                 config={"example": "rl_grpo", "seed": args.seed, "steps": args.steps})
    for step in range(args.steps):
        g = torch.Generator().manual_seed(derive_seed(args.seed, "rl_prompts", step))
        prompts = torch.randint(0, 10, (PROMPTS, PROMPT_LEN), generator=g)  # the same on every rank
        mine = list(sync.my_micro_batches(PROMPTS))  # global micro-batch index = prompt index
        requests = [(j, s) for j in mine for s in range(GROUP)]
        # one generation batch of this rank's groups: a request's tokens depend on (seed, its id, position) only
        outs = generate(model, [prompts[j].tolist() for j, _ in requests], ids=[f"{step}:{j}:{s}" for j, s in requests],
                        max_new_tokens=NEW, temperature=1.0, seed=args.seed)
        losses, rewards = [], []
        for k, j in enumerate(mine):
            group = outs[k * GROUP:(k + 1) * GROUP]
            r = torch.tensor([reward(prompts[j].tolist(), o.tokens) for o in group])
            adv = (r - r.mean()) / (r.std() + 1e-4)  # group-normalised advantage
            seqs = torch.tensor([o.prompt + o.tokens for o in group])
            logits = model(seqs[:, :-1])  # the training forward, train mode
            new = token_logprobs(logits[:, PROMPT_LEN - 1:], seqs[:, PROMPT_LEN:])
            old = torch.tensor([o.logprobs for o in group])
            ratio = torch.exp(new - old)
            # on-policy for real: the recomputed log-probs are the sampler's, so the ratio is 1.0 for every token
            assert torch.equal(ratio.detach(), torch.ones_like(ratio)), f"step {step}: ratio != 1 ({ratio})"
            loss = -(ratio * adv[:, None]).mean()
            sync.backward(loss, k)
            losses.append(loss)
            rewards.append(r.mean())
        sync.reduce()
        sync.clip_grad_norm_(1.0)
        opt.step()
        # the generation's fingerprints, each request at its global offset, summed over ranks (order-free)
        idx = [j * GROUP + s for j, s in requests]
        gen = {"gen_prompts": [(prompts[j], i * PROMPT_LEN) for i, (j, _) in zip(idx, requests)],
               "gen_tokens": [(torch.tensor(o.tokens), i * NEW) for i, o in zip(idx, outs)],
               "gen_logprobs": [(torch.tensor(o.logprobs), i * NEW) for i, o in zip(idx, outs)]}
        local = [sum(fingerprint(t, off) for t, off in parts) % 2**64 for parts in gen.values()]
        fps = dict(zip(gen, map(format_fp, sum_u64(local, ledger.info))))
        mean_reward = sync.mean(rewards)  # a collective: every rank calls it
        ledger.log(step, loss=sync.mean(losses), batch=prompts, reward=mean_reward, **fps)
        opt.zero_grad(set_to_none=False)
        if info.rank == 0:
            print(f"step {step}: reward {mean_reward:.3f}, importance ratio 1.0 for all {len(outs) * NEW} tokens "
                  "sampled on this rank")
    ledger.close()
    dettrain.shutdown()


if __name__ == "__main__":
    main()
