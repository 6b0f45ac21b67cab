"""Forming a ring through a torch.distributed Store: which address to listen on,
the shared secret, publishing and finding addresses, and the final barrier.

Store keys live under ``prime_ring/<job_id>/``: ``joined`` (a counter that catches
a reused job id), ``secret`` (only when rank 0 generated it), ``addr/<rank>``,
``ready/<rank>`` and ``failed/<rank>``.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import secrets
import socket
import time
from datetime import timedelta
from typing import Optional, Tuple

import torch.distributed as dist

from prime.comm.errors import CommError

logger = logging.getLogger("prime.comm")

ENV_BIND = "PRIME_RING_BIND_ADDR"
ENV_ADVERTISE = "PRIME_RING_ADDR"
ENV_SECRET = "PRIME_RING_SECRET"


def namespace(job_id: str) -> str:
    """The store key prefix of the ring named job_id."""
    return f"prime_ring/{job_id}"


def _is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        try:
            return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
        except OSError:
            return False


def store_endpoint(store: dist.Store) -> Optional[Tuple[str, int]]:
    """(host, port) of the TCPStore behind `store` (through PrefixStores), None for a
    local store such as HashStore or FileStore."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    if isinstance(store, dist.TCPStore):
        return store.host, store.port
    return None


def local_address_towards(host: str, port: int) -> str:
    """The local address this host uses to reach host:port (no packet is sent: a UDP
    connect only picks the route)."""
    family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(sockaddr)
        return s.getsockname()[0]


def resolve_addresses(
    store: dist.Store, bind_addr: Optional[str], advertise_addr: Optional[str]
) -> Tuple[str, str]:
    """Returns (bind, advertise).

    advertise: the argument, else $PRIME_RING_ADDR, else 127.0.0.1 when the store is
    local or on a loopback address, else the local address that routes to the store's
    host (the interface the other ranks most likely reach us on).
    bind: the argument, else $PRIME_RING_BIND_ADDR, else the advertised address, so
    that nothing listens on an interface the user did not name or imply. Behind NAT
    set bind_addr="0.0.0.0" and advertise_addr=<public address>.
    """
    advertise = advertise_addr or os.environ.get(ENV_ADVERTISE)
    if not advertise:
        endpoint = store_endpoint(store)
        if endpoint is None or _is_loopback(endpoint[0]):
            advertise = "127.0.0.1"
        else:
            advertise = local_address_towards(*endpoint)
    bind = bind_addr or os.environ.get(ENV_BIND) or advertise
    return bind, advertise


def _wait(store: dist.Store, keys, deadline: float) -> bool:
    left = deadline - time.monotonic()
    if left <= 0:
        return store.check(keys)
    try:
        store.wait(keys, timedelta(seconds=left))
        return True
    except Exception:  # the store raises its own timeout types (DistStoreError, RuntimeError)
        return store.check(keys)


def claim_job(store: dist.Store, ns: str, rank: int, world_size: int, job_id: str) -> None:
    """Counts this rank in; a count beyond world_size means the job id was used before."""
    joined = store.add(f"{ns}/joined", 1)
    if joined > world_size:
        raise ValueError(
            f"job_id {job_id!r} was already used by a ring on this store ({joined} joins for world_size "
            f"{world_size}); pass a new job_id for every new ring, e.g. f'{job_id}-gen2'"
        )


def shared_secret(
    store: dist.Store, ns: str, rank: int, secret: Optional[bytes | str], deadline: float, timeout_ms: int
) -> bytes:
    """The ring secret: the argument, else $PRIME_RING_SECRET, else one rank 0 draws
    and shares through the store (then anyone who can read the store can join)."""
    if secret is None:
        secret = os.environ.get(ENV_SECRET)
    if secret is not None:
        return secret.encode() if isinstance(secret, str) else bytes(secret)
    key = f"{ns}/secret"
    if rank == 0:
        store.set(key, secrets.token_hex(32))
        logger.info("prime ring: no secret given; rank 0 generated one and shared it through the store")
    elif not _wait(store, [key], deadline):
        raise CommError(
            f"rank {rank}: timed out after {timeout_ms} ms waiting for rank 0 to publish the ring secret "
            f"(store key {key!r}); is rank 0 running with the same job_id?",
            kind="timeout",
            rank=rank,
            peer=0,
            origin=rank,
            phase="rendezvous",
        )
    return store.get(key)


def format_address(host: str, port: int) -> str:
    """host:port, with IPv6 hosts in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_address(text: str) -> Tuple[str, int]:
    """The inverse of format_address."""
    host, _, port = text.rpartition(":")
    return host.strip("[]"), int(port)


def publish_and_find_right(
    store: dist.Store, ns: str, rank: int, world_size: int, address: str, deadline: float, timeout_ms: int
) -> Tuple[str, int]:
    """Publishes this rank's address and returns its right neighbour's."""
    store.set(f"{ns}/addr/{rank}", address)
    right = (rank + 1) % world_size
    key = f"{ns}/addr/{right}"
    if not _wait(store, [key], deadline):
        raise CommError(
            f"rank {rank}: timed out after {timeout_ms} ms waiting for rank {right} to publish its address "
            f"(store key {key!r}); did rank {right} start, with the same store and job_id?",
            kind="timeout",
            rank=rank,
            peer=right,
            origin=rank,
            phase="rendezvous",
        )
    return parse_address(store.get(key).decode())


def report_failure(store: dist.Store, ns: str, rank: int, message: str) -> None:
    """Tells the ranks waiting in barrier() that this rank will not come."""
    try:
        store.set(f"{ns}/failed/{rank}", message)
    except Exception as e:  # the store itself may be what failed
        logger.warning("prime ring: could not report the failure of rank %d to the store: %s", rank, e)


def barrier(store: dist.Store, ns: str, rank: int, world_size: int, deadline: float, timeout_ms: int) -> None:
    """Returns once every rank formed its links; raises CommError naming the ranks
    that did not (and why, when they said)."""
    store.set(f"{ns}/ready/{rank}", "1")
    ready = [f"{ns}/ready/{r}" for r in range(world_size)]
    while True:
        # A store round trip per poll: cheap next to forming TCP links.
        if store.check(ready):
            return
        failed = [r for r in range(world_size) if store.check([f"{ns}/failed/{r}"])]
        if failed or time.monotonic() >= deadline:
            missing = [r for r in range(world_size) if not store.check([ready[r]])]
            if failed:
                why = store.get(f"{ns}/failed/{failed[0]}").decode()
                msg = f"rank {rank}: rank(s) {failed} failed to join the ring: {why}"
                peer, kind = failed[0], "peer_failed"
            else:
                msg = (
                    f"rank {rank}: timed out after {timeout_ms} ms waiting for rank(s) {missing} to join the "
                    "ring; did they start?"
                )
                peer, kind = (missing[0] if missing else -1), "timeout"
            raise CommError(msg, kind=kind, rank=rank, peer=peer, origin=peer, phase="rendezvous")
        time.sleep(0.05)
