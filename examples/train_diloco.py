"""train_plain.py turned into DiLoCo across nodes: the lines marked # DiLoCo are all that changed
(and the loop moved under `with`, whose optimizer hook runs the outer steps).

Each node trains alone; every 20 steps the nodes average their pseudo-gradients
through the int8 ring and take an outer Nesterov step. Two nodes on one machine:

    python examples/train_diloco.py 0 2 127.0.0.1:29600 &
    python examples/train_diloco.py 1 2 127.0.0.1:29600

On two machines, run the first line on machine A and the second on machine B
with A's address instead of 127.0.0.1 (port 29600 and the ring's ports open),
after exporting the same job secret on both: a job over several hosts refuses to
start without it (docs/security.md):

    export PRIME_RING_SECRET=$(cat prime.secret)   # the same file on A and B

Node 0 hosts the store with prime.comm.host_store, which listens on the given
address only (torch's TCPStore server listens on every interface, and then even a
one-machine job refuses to run without a secret).
"""

import sys  # DiLoCo
from datetime import timedelta  # DiLoCo

import torch
import torch.distributed as dist  # DiLoCo
import torch.nn.functional as F

import prime  # DiLoCo
from prime.data import ShardedLoader, load_source
from prime.model import Transformer, preset

node, nodes, (host, port) = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3].rsplit(":", 1)  # DiLoCo
if node == 0:  # DiLoCo: node 0 hosts the store, listening on `host` only
    store = prime.comm.host_store(host, int(port))  # DiLoCo
else:  # DiLoCo
    store = dist.TCPStore(host, int(port), is_master=False)  # DiLoCo
ring = prime.comm.Ring(store, node, nodes, timeout=timedelta(seconds=60))  # DiLoCo

torch.manual_seed(0)  # the same seed on every node: the same initial weights (unchanged line)
model = Transformer(preset("tiny"))
opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
data = ShardedLoader(load_source("embedded"), seq_len=128, batch_size=8, shard=node, num_shards=nodes)  # DiLoCo
# DiLoCo: inside `with`, every 20th opt.step() also runs an outer step (the optimizer's step hook drives it)
with prime.DiLoCo(model, opt, ring, inner_steps=20) as diloco:  # DiLoCo
    for step in range(1, 101):
        inputs, targets = data.next_batch()
        loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step % 10 == 0:
            print(f"node {node} step {step} loss {loss.item():.3f}", flush=True)  # DiLoCo: says which node
        if diloco.result.did_sync:  # DiLoCo
            r = diloco.result
            print(f"node {node} outer step {r.outer_step}: all-reduce {r.allreduce_s:.2f} s", flush=True)

ring.close()  # DiLoCo: the ring is ours; leaving `with` closed only what DiLoCo built
