"""torchft's DiLoCo with PRIME's TCP ring as its cross-replica process group.

torchft (pip install torchft; 0.2.0 needs torch >= 2.7 and keeps the installed one)
reaches its replicas through a Manager, which all-reduces over a torchft
ProcessGroup. torchft rebuilds that group on every quorum change through
ProcessGroupWrapper._create_pg(store, rank, world_size); returning a
prime.comm.backend.PrimeProcessGroup there puts the pseudo-gradients of torchft's
DiLoCo on our ring, exact by default or int8 with --int8. That is the whole
integration (ProcessGroupPrime below); the rest of this file is a small run on
this machine:

    python examples/torchft_diloco.py                 # 2 replica groups, CPU, exact
    python examples/torchft_diloco.py --int8 --replicas 3
    GLOO_SOCKET_IFNAME=lo python examples/torchft_diloco.py --gloo   # torchft's gloo group, to compare

It starts a torchft lighthouse on 127.0.0.1 and one process per replica group (one
rank each, each with its own TCPStore), trains a small regression model with AdamW
inside and torchft's DiLoCo (Nesterov SGD outside) every --sync-every steps, and
prints each replica's loss and the digest of its final weights: after every outer
step all replicas hold the same weights. With 2 replicas the exact ring and gloo
both sum two float32 values per element, so the exact run and --gloo end with the
same weights, bit for bit. torchft's own servers (lighthouse,
manager, checkpoint transport) bind to every interface, as torchft does.
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing as mp
import sys
from datetime import timedelta

import torch

try:
    from torchft.local_sgd import DiLoCo
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo, ProcessGroupWrapper
except ImportError:  # say what to do instead of a traceback
    sys.exit("examples/torchft_diloco.py needs torchft: pip install torchft")

import torch.distributed as dist

from prime.comm.backend import PrimeOptions, PrimeProcessGroup


class ProcessGroupPrime(ProcessGroupWrapper):
    """A reconfigurable torchft process group on the prime ring: a new ring per quorum."""

    def __init__(self, timeout: timedelta = timedelta(seconds=60), options: PrimeOptions | None = None):
        super().__init__(timeout=timeout)
        self._options = options or PrimeOptions()

    def _create_pg(self, store: dist.Store, rank: int, world_size: int) -> dist.ProcessGroup:
        # torchft passes a store under a fresh prefix for every quorum, so every ring gets
        # fresh keys; the secret follows prime.comm's rules ($PRIME_RING_SECRET, else drawn
        # by rank 0 and shared through this store).
        return PrimeProcessGroup(store, rank, world_size, timeout=self._timeout, options=self._options)

    def getBackendName(self) -> str:
        return "torchft-prime"


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)  # every replica starts from the same weights
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))


def make_batch(replica: int, step: int, batch: int = 32):
    g = torch.Generator().manual_seed(1000 * replica + step)  # each replica its own data
    x = torch.randn(batch, 16, generator=g)
    return x, (x[:, :4].sum(1, keepdim=True)).sin() + 0.05 * torch.randn(batch, 1, generator=g)


def replica_main(replica: int, args, lighthouse_addr: str, results) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # this replica's own store
    model = make_model()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    if args.gloo:  # torchft's own group, for comparison
        pg = ProcessGroupGloo(timeout=timedelta(seconds=60))
    else:
        pg = ProcessGroupPrime(options=PrimeOptions(codec="int8" if args.int8 else "none"))
    manager = Manager(
        pg=pg,
        min_replica_size=args.replicas,
        use_async_quorum=False,  # torchft's DiLoCo requires it
        load_state_dict=lambda sd: (model.load_state_dict(sd["model"]), inner.load_state_dict(sd["inner"])),
        state_dict=lambda: {"model": model.state_dict(), "inner": inner.state_dict()},
        replica_id=f"replica_{replica}",
        store_addr="127.0.0.1",
        store_port=store.port,
        rank=0,
        world_size=1,
        lighthouse_addr=lighthouse_addr,
        hostname="127.0.0.1",
        timeout=timedelta(seconds=60),
        quorum_timeout=timedelta(seconds=60),
    )
    losses = []
    try:
        with DiLoCo(manager, [model], inner, outer, sync_every=args.sync_every):
            for step in range(args.steps):
                x, y = make_batch(replica, step)
                loss = torch.nn.functional.mse_loss(model(x), y)
                inner.zero_grad()
                loss.backward()
                inner.step()  # DiLoCo's hook on the inner optimizer runs the outer step
                losses.append(loss.item())
        digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
        results.put((replica, losses, digest, manager.current_step(), repr(pg.parent)))
    finally:
        manager.shutdown()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--replicas", type=int, default=2, help="replica groups (processes), default 2")
    p.add_argument("--steps", type=int, default=40, help="inner steps per replica (a multiple of --sync-every)")
    p.add_argument("--sync-every", type=int, default=10, help="inner steps per outer step")
    p.add_argument("--int8", action="store_true", help="all-reduce the pseudo-gradients in int8")
    p.add_argument("--gloo", action="store_true", help="torchft's gloo group instead, for comparison")
    args = p.parse_args()
    if args.replicas < 2 or args.steps % args.sync_every:
        p.error(f"need --replicas >= 2 and --steps({args.steps}) a multiple of --sync-every({args.sync_every})")

    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=args.replicas)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=replica_main, args=(r, args, lighthouse.address(), results))
             for r in range(args.replicas)]
    try:
        for proc in procs:
            proc.start()
        out = sorted(results.get(timeout=600) for _ in procs)
        for proc in procs:
            proc.join(60)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        lighthouse.shutdown()
    for replica, losses, digest, outer_steps, group in out:
        k = args.sync_every
        print(f"replica {replica}: loss first {sum(losses[:k]) / k:.4f} last {sum(losses[-k:]) / k:.4f}, "
              f"{outer_steps} outer steps, weights {digest[:16]}, group {group}")
    same = len({d for _, _, d, _, _ in out}) == 1
    print("all replicas hold the same weights" if same else "REPLICAS DIFFER")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
