"""A plain PyTorch training loop on one machine: the starting point of train_diloco.py.

    python examples/train_plain.py
"""

import torch
import torch.nn.functional as F

from prime.data import ShardedLoader, load_source
from prime.model import Transformer, preset

torch.manual_seed(0)
model = Transformer(preset("tiny"))
opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
data = ShardedLoader(load_source("embedded"), seq_len=128, batch_size=8, shard=0, num_shards=1)

for step in range(1, 101):
    inputs, targets = data.next_batch()
    loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
    loss.backward()
    opt.step()
    opt.zero_grad()
    if step % 10 == 0:
        print(f"step {step} loss {loss.item():.3f}", flush=True)
