"""A plain PyTorch training loop (own model, own data, torch AdamW) made bitwise reproducible by dettrain.

    python examples/own_loop.py --out runs/own                          # one process
    torchrun --nproc-per-node=2 examples/own_loop.py --out runs/own2 --tier 4
    python -m dettrain.diff runs/own runs/own2                          # tier 4: identical on 1 and 2 ranks

The lines marked ``# dettrain`` are all it takes: tier settings and seeds, the canonical gradient sync (a DDP
replacement), the canonical norm for clipping, draws keyed by the global micro-batch index, and a ledger.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F
from gru_lm import GRULM  # examples/gru_lm.py: the script's own folder is on sys.path

import dettrain


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="directory for ledger.jsonl")
    ap.add_argument("--tier", type=int, default=4, choices=[3, 4], help="3: identical reruns; 4: also on any "
                    "power-of-two number of ranks")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    micro, per_micro, T, V = 4, 2, 16, 64  # 4 micro-batches of 2 sequences per step

    info = dettrain.setup(tier=args.tier, seed=args.seed)  # dettrain: tier settings, process group, seeds
    torch.manual_seed(args.seed)  # the same initial weights on every rank (any init that does not use the rank)
    model = GRULM(V, hidden=48, layers=1, dropout=0.1).to(info.device)  # your model: any nn.Module
    sync = dettrain.GradSync(model, accumulate="tree" if args.tier >= 4 else "fold")  # dettrain: replaces DDP
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, foreach=False)
    ledger = dettrain.StepLedger(Path(args.out) / "ledger.jsonl", model, opt, tier=args.tier,  # dettrain
                                 config={"example": "own_loop", "seed": args.seed, "steps": args.steps})
    data = torch.randint(0, V, (args.steps, micro, per_micro, T + 1),
                         generator=torch.Generator().manual_seed(args.seed))  # own data: the same on every rank
    for step in range(args.steps):
        losses = []
        for k, index in enumerate(sync.my_micro_batches(micro)):  # dettrain: this rank's global indices
            dettrain.seed_micro_batch(args.seed, step, index)  # dettrain: dropout keyed by the global index
            tok = data[step, index].to(info.device)
            logits = model(tok[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, V), tok[:, 1:].reshape(-1))
            sync.backward(loss, k)  # dettrain: instead of loss.backward()
            losses.append(loss)
        sync.reduce()  # dettrain: p.grad = the step's mean gradient
        norm = sync.clip_grad_norm_(1.0)  # dettrain: the canonical norm
        opt.step()
        ledger.log(step, loss=sync.mean(losses), batch=data[step], grad_norm=norm)  # dettrain
        opt.zero_grad(set_to_none=False)
        if info.is_main:
            print(f"step {step}: loss {losses[0].item():.4f} grad norm {norm:.4f}")
    ledger.close()
    dettrain.shutdown()


if __name__ == "__main__":
    main()
