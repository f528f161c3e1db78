"""A plain PyTorch training loop (own model, torch AdamW) made bitwise reproducible by dettrain.

    python examples/own_loop.py --out runs/own                          # one process
    torchrun --nproc-per-node=2 examples/own_loop.py --out runs/own2 --tier 4
    python -m dettrain.diff runs/own runs/own2                          # tier 4: identical on 1 and 2 ranks

    python examples/own_loop.py --out runs/r --stop-after 3             # stop after step 3 (checkpoint saved)
    python examples/own_loop.py --out runs/r --resume                   # continue: the same ledger as runs/own
    python examples/own_loop.py --out runs/w --wandb                    # also mirror every step to wandb (offline)
    torchrun --nproc-per-node=2 examples/own_loop.py --out runs/s --shard            # FSDP2 shards, same bits
    torchrun --nproc-per-node=2 examples/own_loop.py --out runs/b --precision bf16   # bf16 compute, fp32 master
    torchrun --nproc-per-node=2 examples/own_loop.py --out runs/d --dataset          # your own map-style Dataset

The lines marked ``# dettrain`` are all it takes: tier settings and seeds, the step sampler (the trainer's global
sample order over a token file or over your own Dataset's indices, resumable), the canonical gradient sync (a DDP
replacement; sharded, FSDP2), bf16 compute with fp32 master weights and reduction, the canonical norm for clipping,
draws keyed by the global micro-batch index, a ledger (with its wandb mirror, your own numbers included) and
checkpoints that resume bit for bit with any extra state (the LR scheduler, your own counters).
"""

from __future__ import annotations

import argparse
import json
import tokenize
from pathlib import Path

import torch
import torch.nn.functional as F
from gru_lm import GRULM  # examples/gru_lm.py: the script's own folder is on sys.path

import dettrain


class ByteWindows(torch.utils.data.Dataset):
    """A user's own map-style dataset: (input, target) byte windows of a few of Python's own sources."""

    def __init__(self, seq_len: int) -> None:
        text = b"".join(Path(m.__file__).read_bytes() for m in (argparse, json, tokenize))
        self.data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
        self.T = seq_len

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.T

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.data[i * self.T : i * self.T + self.T + 1]
        return w[:-1], w[1:]


class Progress:
    """A user's own counter, checkpointed with the model (anything with state_dict/load_state_dict)."""

    def __init__(self) -> None:
        self.tokens_seen = 0

    def state_dict(self) -> dict:
        return {"tokens_seen": self.tokens_seen}

    def load_state_dict(self, state: dict) -> None:
        self.tokens_seen = int(state["tokens_seen"])


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
    ap.add_argument("--shard", action="store_true", help="shard parameters, gradients and optimizer state (FSDP2)")
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16"], help="bf16: bf16 compute, fp32 "
                    "master weights and reduction")
    ap.add_argument("--dataset", action="store_true", help="read (input, target) pairs from a map-style Dataset "
                    "instead of a token array")
    args = ap.parse_args()
    out = Path(args.out)
    micro, per_micro, T, V = 4, 2, 16, 256  # 4 micro-batches of 2 sequences of byte tokens per step

    info = dettrain.setup(tier=args.tier, seed=args.seed)  # dettrain: tier settings, process group, seeds
    torch.manual_seed(args.seed)  # the same initial weights on every rank (any init that does not use the rank)
    model = GRULM(V, hidden=48, layers=1, dropout=0.1).to(info.device)  # your model: any nn.Module
    sync = dettrain.GradSync(model, accumulate="tree" if args.tier >= 4 else "fold",  # dettrain: replaces DDP
                             precision=args.precision, shard=args.shard)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, foreach=False)  # after GradSync: sharded parameters
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))  # warm-up over 3 steps
    progress = Progress()
    # dettrain: this rank's micro-batches of each step, in the global order of (seed, epoch) on any world size;
    # here the embedded corpus (Python's own sources as bytes), a token file from `dettrain prepare`, or your own
    # Dataset (its items collated into micro-batches)
    source = ByteWindows(T) if args.dataset else None
    data = dettrain.sampler(source, seq_len=T, seed=args.seed, global_batch=micro * per_micro,
                            micro_batch=per_micro, max_bytes=200_000, sync=sync)
    extra = {"scheduler": sched, "progress": progress}  # more state for the checkpoints
    start = dettrain.load_checkpoint(out / "checkpoints", model, opt, data, extra=extra) if args.resume \
        else None  # dettrain
    ledger = dettrain.StepLedger(out / "ledger.jsonl", model, opt, tier=args.tier, resume_step=start,  # dettrain
                                 config={"example": "own_loop", "seed": args.seed, "steps": args.steps,
                                         "shard": args.shard, "precision": args.precision,
                                         "dataset": args.dataset},
                                 wandb=args.wandb)
    batches = iter(data)
    for step in range(start or 0, args.steps):
        at = data.state_dict()  # (epoch, position) of this step, before next() advances it
        mbs = next(batches)
        losses = []
        for k, mb in enumerate(mbs):  # dettrain: mb.index is the global micro-batch index
            dettrain.seed_micro_batch(args.seed, step, mb.index)  # dettrain: dropout keyed by the global index
            if args.dataset:
                x, y = (t.to(info.device) for t in mb.batch)
            else:
                tok = mb.tokens.to(info.device)
                x, y = tok[:, :-1], tok[:, 1:]
            with sync.autocast():  # dettrain: bf16 compute with --precision bf16
                logits = model(x)
            loss = F.cross_entropy(logits.float().reshape(-1, V), y.reshape(-1))
            sync.backward(loss, k, count=len(mbs))  # dettrain: instead of loss.backward()
            losses.append(loss)
        sync.reduce()  # dettrain: p.grad = the step's mean gradient (sharded: this rank's rows of it)
        norm = sync.clip_grad_norm_(1.0)  # dettrain: the canonical norm
        opt.step()
        lr = sched.get_last_lr()[0]
        sched.step()
        progress.tokens_seen += micro * per_micro * T
        # the ledger's batch hash: the step's global sample ids (every rank's micro-batches, the same on any rank)
        ids = torch.from_numpy(data.global_step_ids(at["epoch"], at["position"]).astype("int64"))
        ledger.log(step, loss=sync.mean(losses), batch=ids, grad_norm=norm, lr=lr,  # dettrain
                   tokens_seen=progress.tokens_seen)  # your own numbers: in the ledger and on wandb
        opt.zero_grad(set_to_none=False)
        if info.is_main:
            print(f"step {step}: loss {losses[0].item():.4f} grad norm {norm:.4f}")
        done = step + 1
        if (args.ckpt_every and done % args.ckpt_every == 0) or done == args.stop_after:
            dettrain.save_checkpoint(out / "checkpoints", done, model, opt, data, extra=extra)  # dettrain: collective
        if done == args.stop_after:
            break
    ledger.close()
    dettrain.shutdown()


if __name__ == "__main__":
    main()
