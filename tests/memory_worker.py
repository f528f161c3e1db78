"""A measured FSDP2 run for test_memory.py: one real Gloo rank, the model sharded by ``shard_model``, AdamW, real
tensors, FSDPMemTracker's peak printed as JSON.  Written without dettrain.memory's step code, so the planner is
checked against an independent loop.

    python tests/memory_worker.py INIT_FILE [hydra overrides ...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dettrain.models.llama import build_model  # noqa: E402
from dettrain.sync.fsdp import shard_model  # noqa: E402
from dettrain.tools.memory import compose_config  # noqa: E402


def main() -> None:
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.device_mesh import init_device_mesh

    init_file, overrides = sys.argv[1], sys.argv[2:]
    cfg = compose_config(overrides, 1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    model = build_model(cfg.model, cfg.seed, "cpu")
    shard_model(model, mesh, mixed_precision=cfg.train.precision == "bf16")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    micro = min(2, cfg.train.global_batch // cfg.train.micro_batch)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.model.vocab_size, (cfg.train.micro_batch, cfg.model.seq_len + 1), generator=g)
    tracker = FSDPMemTracker(model, opt)
    tracker.track_inputs((tokens,))
    with tracker:
        for _step in range(2):
            for _ in range(micro):
                logits = model(tokens[:, :-1])
                loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
                loss.backward()
                del logits, loss
                tracker.reset_mod_stats()
            opt.step()
            opt.zero_grad(set_to_none=True)
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    dist.destroy_process_group()
    print(json.dumps({"peak": peak}))


if __name__ == "__main__":
    main()
