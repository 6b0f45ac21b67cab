"""Forming a ring through a torch.distributed Store: which address to listen on,
the shared secret, publishing and finding addresses, agreeing on the link table and
the ring order, and the final barrier.

Store keys live under ``prime_ring/<job_id>/`` (prime.comm.store_keys). The
address, link, plan, ready and failure records are signed under the ring secret and bound
to their key and the job id (prime.comm.signed_store): a record rewritten by
someone without the secret is ignored, so a rank never dials an address that
a stranger planted. A job whose ranks are on more than one host must be given
the secret; drawing one into the store is allowed only when everything is on
loopback.
"""

from __future__ import annotations

import errno
import ipaddress
import json
import logging
import os
import secrets
import socket
import time
from datetime import timedelta
from typing import List, Optional, Tuple, Union

import torch.distributed as dist

from prime.comm import store_keys as keys
from prime.comm.errors import CommError
from prime.comm.links import LinkTable, plan_order
from prime.comm.signed_store import SignedStore, read_now

logger = logging.getLogger("prime.comm")

ENV_BIND = "PRIME_RING_BIND_ADDR"
ENV_ADVERTISE = "PRIME_RING_ADDR"
ENV_SECRET = "PRIME_RING_SECRET"


SECRET_HELP = (
    "set the same secret on every machine of the job, e.g. `export PRIME_RING_SECRET=$(cat /path/to/secret)` "
    "(make one with `python3 -c 'import secrets; print(secrets.token_hex(32))'` and copy it to every machine; "
    "see docs/security.md)"
)


def namespace(job_id: str) -> str:
    """The store key prefix of the ring named job_id."""
    return keys.ring_namespace(job_id)


def is_loopback(host: str) -> bool:
    """True for localhost, 127.0.0.0/8, ::1 (and names that resolve to them)."""
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
        if endpoint is None or is_loopback(endpoint[0]):
            advertise = "127.0.0.1"
        else:
            advertise = local_address_towards(*endpoint)
    bind = bind_addr or os.environ.get(ENV_BIND) or advertise
    return bind, advertise


# How often a rendezvous wait asks the store: one round trip per poll.
_POLL_S = 0.02


def _wait(store: dist.Store, keys, deadline: float) -> bool:
    """Whether every key exists by the deadline. Polls with store.check rather than one store.wait to the
    deadline: a store.wait holds the main thread inside C++, where a stop signal's handler cannot run until
    it returns (prime/stop.py), up to the whole ring timeout."""
    while True:
        if store.check(keys):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(min(_POLL_S, max(0.0, deadline - time.monotonic())))


def _read_by(store: dist.Store, key: str, deadline: float) -> Optional[bytes]:
    """The bytes under `key`, polling (one read_now per poll, never a blocking get) until the deadline; None
    then. A stranger who deletes the key between polls delays the reader, but cannot make it block."""
    while True:
        raw = read_now(store, key)
        if raw is not None:
            return raw
        if time.monotonic() >= deadline:
            return None
        time.sleep(min(_POLL_S, max(0.0, deadline - time.monotonic())))


def claim_job(store: dist.Store, ns: str, rank: int, world_size: int, job_id: str) -> None:
    """Counts this rank in; a count beyond world_size means the job id was used before."""
    joined = store.add(keys.ring_joined(ns), 1)
    if joined > world_size:
        raise ValueError(
            f"job_id {job_id!r} was already used by a ring on this store ({joined} joins for world_size "
            f"{world_size}); pass a new job_id for every new ring, e.g. f'{job_id}-gen2'"
        )


def one_host(store: dist.Store, advertise: Optional[str] = None) -> bool:
    """True when the job cannot span machines: the store is local or on loopback, and so is `advertise`."""
    endpoint = store_endpoint(store)
    if endpoint is not None and not is_loopback(endpoint[0]):
        return False
    return advertise is None or is_loopback(advertise)


def require_secret_or_one_host(store: dist.Store, advertise: Optional[str], what: str) -> None:
    """Raises ValueError when no secret is configured and drawing one into the store would be
    readable from another machine: the job may span more than one host, or its store's server
    listens beyond loopback (torch's TCPStore listens on every interface; host_store does not)."""
    endpoint = store_endpoint(store)
    where = f"store {format_address(*endpoint)}" if endpoint else "a local store"
    if not one_host(store, advertise):
        raise ValueError(
            f"{what}: no job secret is set, and this job spans more than one host ({where}, this node "
            f"advertises {advertise}): drawing a secret into the store would hand it to anyone who reaches "
            f"the store. {SECRET_HELP}"
        )
    exposed = store_exposure(store)
    if exposed:
        raise ValueError(
            f"{what}: no job secret is set, and the server of {where} {exposed}: a secret drawn into it could be "
            f"read from another machine. Host the store with prime.comm.host_store('127.0.0.1', port) (it "
            f"listens on loopback only), or {SECRET_HELP}"
        )


def host_store(host: str = "127.0.0.1", port: int = 0, timeout: timedelta = timedelta(seconds=300),
               world_size: Optional[int] = None, wait_for_workers: bool = False,
               any_if_not_local: bool = False) -> dist.TCPStore:
    """The server of a TCPStore that listens on `host` only.

    torch's TCPStore server listens on every interface of its machine, whatever host it is
    given; this one binds the listening socket to `host` and hands it to torch
    (master_listen_fd), so a store on 127.0.0.1 cannot be reached from another address
    (tests/test_store_privacy.py). any_if_not_local: when `host` is not an address of this
    machine (behind NAT), listen on every interface instead of failing."""
    family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(addr)
        except OSError as e:
            if not any_if_not_local or e.errno != errno.EADDRNOTAVAIL:
                raise
            logger.warning("prime store: %s is not an address of this machine; listening on every interface", host)
            sock.close()
            sock = socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True)
        sock.listen(4096)
        bound = sock.getsockname()[1]
    except BaseException:
        sock.close()
        raise
    fd = sock.detach()  # the store owns the socket from here on (and closes it)
    try:
        return dist.TCPStore(host, bound, world_size, is_master=True, timeout=timeout,
                             wait_for_workers=wait_for_workers, master_listen_fd=fd, use_libuv=True)
    except BaseException:
        os.close(fd)
        raise


def _listening_addresses(port: int) -> List[str]:
    """Local addresses a TCP socket listens on at `port`, in this network namespace (/proc/net/tcp, tcp6)."""
    found = []
    for path, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        try:
            with open(path) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 4 or fields[3] != "0A":  # 0A: LISTEN
                continue
            hexaddr, hexport = fields[1].split(":")
            if int(hexport, 16) != port:
                continue
            raw = bytes.fromhex(hexaddr)
            # the kernel prints each 32-bit word in host (little-endian) order
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            found.append(str(ipaddress.ip_address(raw)))
    return found


def store_exposure(store: dist.Store) -> Optional[str]:
    """Why a store on this machine's loopback may be reached from another address, or None:
    its server listens on a non-loopback address (torch's default: every interface), or it
    cannot be found listening here. None for local stores (HashStore, FileStore)."""
    endpoint = store_endpoint(store)
    if endpoint is None:
        return None
    host, port = endpoint
    if not is_loopback(host):
        return f"is at the non-loopback address {host}"
    addresses = _listening_addresses(port)
    if not addresses:
        return f"was not found listening on port {port} of this machine"
    wide = [a for a in addresses if not ipaddress.ip_address(a).is_loopback]
    if wide:
        return f"listens on {wide[0]} ({'every interface' if ipaddress.ip_address(wide[0]).is_unspecified else 'a network address'})"
    return None


def shared_secret(
    store: dist.Store,
    ns: str,
    rank: int,
    secret: Optional[bytes | str],
    deadline: float,
    timeout_ms: int,
    advertise: Optional[str] = None,
) -> bytes:
    """The ring secret: the argument, else $PRIME_RING_SECRET, else -- only when the whole
    job is on one host (store and `advertise` on loopback) -- one rank 0 draws and shares
    through the store. Raises ValueError for a multi-host job without a secret."""
    if secret is None:
        secret = os.environ.get(ENV_SECRET)
    if secret:
        return secret.encode() if isinstance(secret, str) else bytes(secret)
    require_secret_or_one_host(store, advertise, f"prime ring rank {rank}")
    key = keys.ring_secret(ns)
    if rank == 0:
        store.set(key, secrets.token_hex(32))
        logger.info("prime ring: no secret given; rank 0 generated one and shared it through the (loopback) store")
    got = _read_by(store, key, deadline)
    if got is None:
        raise CommError(
            f"rank {rank}: timed out after {timeout_ms} ms waiting for rank 0 to publish the ring secret "
            f"(store key {key!r}); is rank 0 running with the same job_id?",
            kind="timeout",
            rank=rank,
            peer=0,
            origin=rank,
            phase="rendezvous",
        )
    return got


def records(store: dist.Store, secret: bytes, ns: str) -> SignedStore:
    """The signed view of the ring's store keys (bound to the ring's namespace, i.e. its job id)."""
    return SignedStore(store, secret, ns, warn=lambda msg: logger.warning("prime ring: %s", msg))


def format_address(host: str, port: int) -> str:
    """host:port, with IPv6 hosts in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_address(text: str) -> Tuple[str, int]:
    """The inverse of format_address."""
    host, _, port = text.rpartition(":")
    return host.strip("[]"), int(port)


def _wait_signed(signed: SignedStore, store: dist.Store, key: str, deadline: float):
    """The value of a validly signed record under `key`, waiting for one until the deadline
    (a record that is not signed is ignored: the wait goes on); None at the deadline."""
    while True:
        if _wait(store, [key], deadline):
            got = signed.get(key)  # never waits: None if a stranger deleted the key since the check
            if got is not None:
                return got
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.05)  # a forged record is there (or the key went away): wait for the rank to write a valid one


def _wait_all_signed(signed: SignedStore, store: dist.Store, ks: dict, deadline: float) -> dict:
    """{rank: value} of the validly signed records under ks = {rank: key}, waiting for them until the deadline:
    once every key exists, one batched read of all (SignedStore.get_many), then a wait of its own for each that
    was not there or not validly signed. A rank missing from the result had none by the deadline."""
    got: dict = {}
    if ks and _wait(store, list(ks.values()), deadline):
        got = {r: v for r, v in zip(ks, signed.get_many(list(ks.values()))) if v is not None}
    for r, key in ks.items():
        if r not in got:
            v = _wait_signed(signed, store, key, deadline)
            if v is not None:
                got[r] = v
    return got


def _missing_record(rank: int, other: int, key: str, timeout_ms: int, signed: SignedStore, what: str) -> CommError:
    why = (
        f"the record there is not signed with this ring's secret (rewritten by someone outside the job, or rank "
        f"{other} has another secret); no record that is not signed is ever used"
        if signed.rejected
        else f"did rank {other} start, with the same store and job_id?"
    )
    return CommError(
        f"rank {rank}: timed out after {timeout_ms} ms waiting for rank {other} to publish {what} "
        f"(store key {key!r}); {why}",
        kind="timeout",
        rank=rank,
        peer=other,
        origin=rank,
        phase="rendezvous",
    )


def publish_and_find_all(
    store: dist.Store,
    ns: str,
    rank: int,
    world_size: int,
    address: str,
    deadline: float,
    timeout_ms: int,
    secret: bytes = b"",
) -> List[Tuple[str, int]]:
    """Publishes this rank's address (signed) and returns every rank's, ours included.

    A record under another rank's key that is not signed with `secret` for this ring is
    ignored (logged once): the wait goes on for a valid one, and the timeout error says
    that a forged record was seen. No address that is not signed is ever dialled."""
    signed = records(store, secret, ns)
    signed.put(keys.ring_addr(ns, rank), address)
    ks = {r: keys.ring_addr(ns, r) for r in range(world_size) if r != rank}
    got = {rank: address, **_wait_all_signed(signed, store, ks, deadline)}
    for r in range(world_size):
        if r not in got:
            raise _missing_record(rank, r, ks[r], timeout_ms, signed, "its address")
    return [parse_address(str(got[r])) for r in range(world_size)]


def agree_links(
    store: dist.Store,
    ns: str,
    rank: int,
    world_size: int,
    rtt_row: List[float],
    rate_row: List[float],
    order: Union[str, List[int]],
    deadline: float,
    timeout_ms: int,
    secret: bytes = b"",
) -> Tuple[List[int], LinkTable]:
    """Every rank publishes what it measured of its links (signed); rank 0 merges the rows,
    plans the ring order (`order`: "auto" plans it from the table, "rank" keeps the rank
    order, or an explicit permutation) and publishes both (signed); every rank returns rank
    0's (order, table), so decisions taken from them agree without further messages."""
    signed = records(store, secret, ns)
    signed.put(keys.ring_links(ns, rank), json.dumps({"rtt_s": rtt_row, "rate": rate_row}))
    plan_key = keys.ring_plan(ns)
    if rank == 0:
        rtt_rows, rate_rows = [], []
        ks = {r: keys.ring_links(ns, r) for r in range(world_size)}
        rows = _wait_all_signed(signed, store, ks, deadline)
        for r in range(world_size):
            if r not in rows:
                raise _missing_record(rank, r, ks[r], timeout_ms, signed, "its link measurements")
            row = json.loads(str(rows[r]))
            if len(row["rtt_s"]) != world_size or len(row["rate"]) != world_size:
                raise CommError(f"rank {rank}: rank {r} published link measurements for another world size",
                                kind="protocol", rank=rank, peer=r, origin=r, phase="rendezvous")
            rtt_rows.append(row["rtt_s"])
            rate_rows.append(row["rate"])
        table = LinkTable.from_rows(rtt_rows, rate_rows)
        chosen = plan_order(table) if order == "auto" else list(range(world_size)) if order == "rank" else list(order)
        signed.put(plan_key, json.dumps({"order": chosen, "table": table.to_json()}))
    got = _wait_signed(signed, store, plan_key, deadline)
    if got is None:
        raise _missing_record(rank, 0, plan_key, timeout_ms, signed, "the ring's plan")
    plan = json.loads(str(got))
    return [int(r) for r in plan["order"]], LinkTable.from_json(plan["table"])


def report_failure(store: dist.Store, ns: str, rank: int, message: str, secret: bytes = b"") -> None:
    """Tells the ranks waiting in barrier() that this rank will not come (signed; unsigned when the
    secret is not known yet, and then ignored by the others, who time out instead)."""
    try:
        if secret:
            records(store, secret, ns).put(keys.ring_failed(ns, rank), message)
        else:
            store.set(keys.ring_failed(ns, rank), message)
        store.add(keys.ring_failures(ns), 1)  # the others read the failure records only once this moved
    except Exception as e:  # the store itself may be what failed
        logger.warning("prime ring: could not report the failure of rank %d to the store: %s", rank, e)


def barrier(
    store: dist.Store,
    ns: str,
    rank: int,
    world_size: int,
    deadline: float,
    timeout_ms: int,
    secret: bytes = b"",
) -> None:
    """Returns once every rank formed its links; raises CommError naming the ranks
    that did not (and why, when they said). Unsigned or forged ready and failure
    records are ignored."""
    signed = records(store, secret, ns)
    signed.put(keys.ring_ready(ns, rank), "1")
    ready: set[int] = set()
    while True:
        # Two store round trips per poll while ranks are missing (the check and the failure counter): cheap
        # next to forming TCP links, whatever the ring's size. Once every pending key exists, they are read in
        # one batch (SignedStore.raw_many: never a blocking get, a stranger may delete a key after the check;
        # it then counts as not ready yet).
        pending = [r for r in range(world_size) if r not in ready]
        pending_keys = [keys.ring_ready(ns, r) for r in pending]
        if store.check(pending_keys):
            for r, k, raw in zip(pending, pending_keys, signed.raw_many(pending_keys)):
                if raw is None:
                    continue
                if signed.open(k, raw) == "1":
                    ready.add(r)
                else:
                    signed.reject(k)
        if len(ready) == world_size:
            return
        failed = {}
        if int(store.add(keys.ring_failures(ns), 0)) > 0:  # some rank reported a failure (or a stranger added)
            failure_keys = [keys.ring_failed(ns, r) for r in range(world_size)]
            failed = {r: str(why) for r, why in enumerate(signed.get_many(failure_keys)) if why is not None}
        if failed or time.monotonic() >= deadline:
            missing = [r for r in range(world_size) if r not in ready]
            if failed:
                first = min(failed)
                msg = f"rank {rank}: rank(s) {sorted(failed)} failed to join the ring: {failed[first]}"
                peer, kind = first, "peer_failed"
            else:
                msg = (
                    f"rank {rank}: timed out after {timeout_ms} ms waiting for rank(s) {missing} to join the "
                    "ring; did they start?"
                )
                peer, kind = (missing[0] if missing else -1), "timeout"
            raise CommError(msg, kind=kind, rank=rank, peer=peer, origin=peer, phase="rendezvous")
        time.sleep(0.05)
