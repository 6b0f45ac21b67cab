"""Hosts the job's TCPStore on its own, so that no training node is the store.

    python -m prime.elastic.store --port 29600

Run it on the steadiest machine you have (it holds a few kilobytes per node and
per outer step, and serves a handful of small requests per node and second),
then start every node with `--nodes.store_addr <that host>:29600
--elastic.external_store true` and the same PRIME_RING_SECRET (a job on more
than one host refuses to start without it; docs/security.md). The store
itself holds no secret: the nodes sign every record they write, and ignore
records that anyone else wrote. When it dies, the nodes keep training their
inner steps but cannot agree on the next outer step: each stops with status 3
(and a checkpoint when checkpoint.dir is set) once its store calls fail.
Restart the store, then restart the nodes: they resume from the newest
checkpoint all of them have (docs/elastic.md).
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from datetime import timedelta


def main(argv=None) -> int:
    """Runs the store until SIGINT/SIGTERM."""
    import torch.distributed as dist

    p = argparse.ArgumentParser(prog="python -m prime.elastic.store", description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, default=29600, help="port (default 29600; 0: pick a free one)")
    args = p.parse_args(argv)
    # torch's TCPStore server listens on every interface of the machine, whatever host it is
    # given: keep the port reachable only by the job's machines (firewall, VPN).
    store = dist.TCPStore("127.0.0.1", args.port, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=60), use_libuv=True)  # batched reads rely on it (signed_store)
    print(f"prime store listening on port {store.port} (every interface of this machine)", flush=True)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    try:
        while not stop:
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
