"""A plain PyTorch training loop (own model, torch AdamW) made bitwise reproducible by dettrain.

    python examples/own_loop.py --out runs/own                          # one process
    torchrun --nproc-per-node=2 examples/own_loop.py --out runs/own2 --tier 4
    python -m dettrain.diff runs/own runs/own2                          # tier 4: identical on 1 and 2 ranks

    python examples/own_loop.py --out runs/r --stop-after 3             # stop after step 3 (checkpoint saved)
    python examples/own_loop.py --out runs/r --resume                   # continue: the same ledger as runs/own
    python examples/own_loop.py --out runs/w --wandb                    # also mirror every step to wandb (offline)

The lines marked ``# dettrain`` are all it takes: tier settings and seeds, the step sampler (the trainer's global
sample order, resumable), the canonical gradient sync (a DDP replacement), the canonical norm for clipping, draws
keyed by the global micro-batch index, a ledger (with its wandb mirror) and checkpoints that resume bit for bit.
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
    ap.add_argument("--out", required=True, help="directory for ledger.jsonl and checkpoints/")
    ap.add_argument("--tier", type=int, default=4, choices=[3, 4], help="3: identical reruns; 4: also on any "
                    "power-of-two number of ranks")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ckpt-every", type=int, default=0, help="save a checkpoint every N steps (0: never)")
    ap.add_argument("--stop-after", type=int, default=0, help="save a checkpoint and stop after this many steps")
    ap.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --out")
    ap.add_argument("--wandb", action="store_true", help="mirror the ledger to wandb (WANDB_MODE, default offline)")
    args = ap.parse_args()
    out = Path(args.out)
    micro, per_micro, T, V = 4, 2, 16, 256  # 4 micro-batches of 2 sequences of byte tokens per step

    info = dettrain.setup(tier=args.tier, seed=args.seed)  # dettrain: tier settings, process group, seeds
    torch.manual_seed(args.seed)  # the same initial weights on every rank (any init that does not use the rank)
    model = GRULM(V, hidden=48, layers=1, dropout=0.1).to(info.device)  # your model: any nn.Module
    sync = dettrain.GradSync(model, accumulate="tree" if args.tier >= 4 else "fold")  # dettrain: replaces DDP
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, foreach=False)
    # dettrain: this rank's micro-batches of each step, in the global order of (seed, epoch) on any world size;
    # here the embedded corpus (Python's own sources as bytes), or a token file from `dettrain prepare`
    data = dettrain.sampler(None, seq_len=T, seed=args.seed, global_batch=micro * per_micro, micro_batch=per_micro,
                            max_bytes=200_000)
    start = dettrain.load_checkpoint(out / "checkpoints", model, opt, data) if args.resume else None  # dettrain
    ledger = dettrain.StepLedger(out / "ledger.jsonl", model, opt, tier=args.tier, resume_step=start,  # dettrain
                                 config={"example": "own_loop", "seed": args.seed, "steps": args.steps},
                                 wandb=args.wandb)
    batches = iter(data)
    for step in range(start or 0, args.steps):
        at = data.state_dict()  # (epoch, position) of this step, before next() advances it
        mbs = next(batches)
        losses = []
        for k, mb in enumerate(mbs):  # dettrain: mb.index is the global micro-batch index
            dettrain.seed_micro_batch(args.seed, step, mb.index)  # dettrain: dropout keyed by the global index
            tok = mb.tokens.to(info.device)
            logits = model(tok[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, V), tok[:, 1:].reshape(-1))
            sync.backward(loss, k, count=len(mbs))  # dettrain: instead of loss.backward()
            losses.append(loss)
        sync.reduce()  # dettrain: p.grad = the step's mean gradient
        norm = sync.clip_grad_norm_(1.0)  # dettrain: the canonical norm
        opt.step()
        # the ledger's batch hash: the step's global sample ids (every rank's micro-batches, the same on any rank)
        ids = torch.from_numpy(data.global_step_ids(at["epoch"], at["position"]).astype("int64"))
        ledger.log(step, loss=sync.mean(losses), batch=ids, grad_norm=norm)  # dettrain
        opt.zero_grad(set_to_none=False)
        if info.is_main:
            print(f"step {step}: loss {losses[0].item():.4f} grad norm {norm:.4f}")
        done = step + 1
        if (args.ckpt_every and done % args.ckpt_every == 0) or done == args.stop_after:
            dettrain.save_checkpoint(out / "checkpoints", done, model, opt, data)  # dettrain: a collective
        if done == args.stop_after:
            break
    ledger.close()
    dettrain.shutdown()


if __name__ == "__main__":
    main()
