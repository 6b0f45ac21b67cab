"""Plain torch, no PRIME: 2-process FSDP2 on CPU / gloo, a few steps, barrier, destroy, normal exit.

Prints the threads still running after destroy_process_group(): torch keeps the gloo
backend alive through FSDP2's DTensor caches (prime/train.py, _end_process).

    for i in $(seq 40); do torchrun --nproc-per-node 2 tools/plain_fsdp_exit.py; done 2>&1 \\
        | grep -c "terminate called"
"""

import os

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
for layer in model:
    fully_shard(layer)
fully_shard(model)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for _ in range(6):
    model(torch.randn(8, 256)).square().mean().backward()
    opt.step()
    opt.zero_grad()
dist.barrier()
dist.destroy_process_group()
names = sorted(open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task"))
print(f"threads after destroy_process_group: {names}", flush=True)
