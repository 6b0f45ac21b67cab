"""Live recovery: a node serves its outer state to joiners over an authenticated TCP connection.

Every member runs a StateServer (a listening socket and a thread per
session) that serves the state after its newest committed outer step: the
outer weights and the outer momentum (fp32, the bytes DiLoCo holds), plus a
small JSON header with the counters and the settings. Training goes on while
it serves: the buffers only change at an outer step, and when a session is
still reading then, the server first copies the state it is serving
(`retract()`), so a slow joiner never stalls the others.

Protocol (all integers little-endian):

    client -> server  hello_c = "PRIMEST1" | u32 node id | 32-byte nonce
    server -> client  hello_s (same layout) | HMAC(K, "prime-state server" | job | hello_c | hello_s)
    client -> server  HMAC(K, "prime-state client" | job | hello_c | hello_s)
    server -> client  1 byte: 0 accepted, 1 rejected
    then messages:    u32 length | JSON | HMAC(Ks, direction | u64 frame counter | u32 length | JSON)
    and state pieces: u32 length | u32 CRC32C | HMAC(Ks, direction | counter | length, CRC) | bytes

K is the job secret, job the run id, Ks = HMAC(K, "prime-state session" | hello_c
| hello_s). Both sides prove the secret on fresh nonces (no replay), and every
frame is numbered and authenticated (messages whole, state pieces through
their header and CRC32C, the whole state through the SHA-256 in the trailer),
so a stranger can neither download the state nor feed a joiner a forged one,
and a corrupted or reordered frame is caught. The data are not encrypted (as
the ring's).

Frames after the handshake: the request {"step": s or -1 (newest), "offset": o}
(JSON), the header {"ok", "step", "total", "meta"} (JSON), the state bytes from
offset o in pieces of PIECE bytes (a piece never spans two tensors), and a
trailer {"digest": SHA-256 of the whole state}. A joiner that loses its source
asks another node for the same step from the last verified piece; the digest
proves that the pieces from different sources make up one state.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import secrets
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from prime import faults

__all__ = ["StateServer", "fetch_state", "FetchResult", "TransferError", "state_digest", "PIECE"]

logger = logging.getLogger("prime.elastic")

MAGIC = b"PRIMEST1"
_HELLO = struct.Struct("<8sI32s")
_LEN = struct.Struct("<I")
_COUNTER = struct.Struct("<QI")
_PIECE = struct.Struct("<II")  # length, CRC32C
_MAC = 32
# 4 MiB pieces: the per-piece HMAC and Python overhead are noise at this size, and a
# resumed transfer repeats at most one piece.
PIECE = 4 << 20
_MAX_JSON = 1 << 20
HANDSHAKE_TIMEOUT_S = 10.0
# A joiner waits this long before it asks a source again that just failed (refused, reset,
# closed, stalled), doubling up to RETRY_MAX_S while it keeps failing: a dead source is
# listed until its heartbeat times out, and asking it every few ms only burns the CPU.
RETRY_MIN_S = 0.1
RETRY_MAX_S = 2.0


class TransferError(RuntimeError):
    """A state transfer failed. kind: auth, unavailable, connection, corrupt, mismatch."""

    def __init__(self, message: str, kind: str = "connection"):
        super().__init__(message)
        self.kind = kind


def state_digest(parts: list[torch.Tensor]) -> str:
    """SHA-256 (hex) of the bytes of the tensors, in order: what a transfer's trailer carries."""
    h = hashlib.sha256()
    for p in parts:
        h.update(memoryview(_bytes_view(p).numpy()))
    return h.hexdigest()


def _bytes_view(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


def _pieces(sizes: list[int]):
    """(global offset, part index, start, end) of every piece: the same cut on every node."""
    off = 0
    for i, n in enumerate(sizes):
        for s in range(0, n, PIECE):
            e = min(n, s + PIECE)
            yield off, i, s, e
            off += e - s


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"".join(parts), hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    _recv_into(sock, memoryview(buf))
    return bytes(buf)


def _recv_into(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise TransferError("the peer closed the connection (did it die?)")
        got += n


def _crc32c(view) -> int:
    """CRC32C of a buffer with the ring's hardware implementation (csrc/ring/crypto, 5-12 GB/s here)."""
    from prime import _extension

    return int(_extension.require()._ring_crc32c(view, False))


class _Channel:
    """Frames with an HMAC and a counter per direction, over one socket.

    Messages (JSON) are authenticated whole. State pieces carry a CRC32C of the
    bytes, and only the frame header (direction, counter, length, CRC) is
    authenticated: that catches transmission errors per piece at memory speed
    (a piece that fails is fetched again, from another node if need be) while
    the SHA-256 of the whole state, sent in an authenticated trailer, is what
    proves the bytes came from a node that knows the secret (a forged piece
    with a matching CRC fails there and the download starts over)."""

    def __init__(self, sock: socket.socket, key: bytes, send_dir: bytes, recv_dir: bytes):
        self.sock, self.key = sock, key
        self.send_dir, self.recv_dir = send_dir, recv_dir
        self.sent = self.received = 0

    def _tag(self, direction: bytes, counter: int, body) -> bytes:
        m = hmac.new(self.key, direction + _COUNTER.pack(counter, len(body)), hashlib.sha256)
        m.update(body)
        return m.digest()

    def send(self, body) -> None:
        body = memoryview(body).cast("B")
        tag = self._tag(self.send_dir, self.sent, body)
        self.sent += 1
        self.sock.sendall(_LEN.pack(len(body)))
        self.sock.sendall(body)
        self.sock.sendall(tag)

    def send_json(self, obj) -> None:
        self.send(json.dumps(obj).encode())

    def send_piece(self, body) -> None:
        """A piece of state: u32 length | u32 CRC32C | HMAC(header) | bytes."""
        body = memoryview(body).cast("B")
        head = _PIECE.pack(len(body), _crc32c(body))
        tag = self._tag(self.send_dir, self.sent, head)
        self.sent += 1
        self.sock.sendall(head + tag)
        self.sock.sendall(body)

    def recv_piece_into(self, view: memoryview) -> None:
        """Receives one piece of exactly len(view) bytes into view; checks the header's tag and the CRC."""
        head = _recv_exact(self.sock, _PIECE.size)
        tag = _recv_exact(self.sock, _MAC)
        if not hmac.compare_digest(tag, self._tag(self.recv_dir, self.received, head)):
            raise TransferError(f"frame {self.received} failed its authentication tag", "corrupt")
        self.received += 1
        n, crc = _PIECE.unpack(head)
        if n != len(view):
            raise TransferError(f"protocol error: a piece of {n} bytes where {len(view)} were expected", "corrupt")
        _recv_into(self.sock, view)
        if _crc32c(view) != crc:
            raise TransferError("a piece failed its CRC32C (corrupted in transit)", "corrupt")

    def recv_json(self) -> dict:
        (n,) = _LEN.unpack(_recv_exact(self.sock, _LEN.size))
        if n > _MAX_JSON:
            raise TransferError(f"protocol error: a {n}-byte message", "corrupt")
        body = _recv_exact(self.sock, n)
        tag = _recv_exact(self.sock, _MAC)
        if not hmac.compare_digest(tag, self._tag(self.recv_dir, self.received, body)):
            raise TransferError(f"message {self.received} failed its authentication tag", "corrupt")
        self.received += 1
        return json.loads(body)


def _transcript_keys(secret: bytes, job: bytes, hello_c: bytes, hello_s: bytes):
    t = job + b"|" + hello_c + hello_s
    return (
        _mac(secret, b"prime-state server|", t),
        _mac(secret, b"prime-state client|", t),
        _mac(secret, b"prime-state session|", t),
    )


class _Snapshot:
    def __init__(self, step: int, parts: list[torch.Tensor], meta: dict):
        self.step, self.meta = step, meta
        self.set_parts(parts)
        self.users = 0
        self.frozen = False

    def set_parts(self, parts: list[torch.Tensor]) -> None:
        self.parts = parts
        self.views = [_bytes_view(p) for p in parts]
        self.sizes = [v.numel() for v in self.views]
        self.total = sum(self.sizes)


@dataclass
class ServerStats:
    sessions: int = 0
    rejected: int = 0
    bytes_sent: int = 0
    frozen_copies: int = 0
    """Times retract() had to copy the state for a session still reading it."""
    rejected_log: list = field(default_factory=list)


class StateServer:
    """Serves this node's newest committed outer state to joiners (see the module docstring).

    publish(step, parts, meta) makes the tensors servable; retract() must be
    called before they change (it copies the state for sessions still reading
    it). Sessions run on their own threads; at most max_sessions at once.
    """

    def __init__(self, secret: bytes, job: str, node_id: int, *, bind_addr: str = "127.0.0.1",
                 advertise_addr: Optional[str] = None, max_rate: float = 0.0, timeout_s: float = 60.0,
                 max_sessions: int = 4, log: Optional[Callable[[str], None]] = None):
        self.secret, self.job, self.node_id = secret, job.encode(), node_id
        self.max_rate, self.timeout_s, self.max_sessions = max_rate, timeout_s, max_sessions
        self._log = log or (lambda m: logger.info("%s", m))
        self._lock = threading.Condition()
        self._current: Optional[_Snapshot] = None
        self._frozen: list[_Snapshot] = []
        self._sessions = 0
        self._closed = False
        self.stats = ServerStats()
        self._sock = socket.create_server((bind_addr, 0), family=socket.AF_INET6 if ":" in bind_addr else socket.AF_INET)
        self._sock.settimeout(0.2)
        self.port = self._sock.getsockname()[1]
        host = advertise_addr or bind_addr
        self.address = f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"
        self._thread = threading.Thread(target=self._accept_loop, name=f"prime-state-server-{node_id}", daemon=True)
        self._thread.start()

    # -- what is served ------------------------------------------------------------

    def publish(self, step: int, parts: list[torch.Tensor], meta: dict) -> None:
        """Serves `parts` (CPU tensors, not copied) as the state after outer step `step` from now on."""
        with self._lock:
            self._current = _Snapshot(step, parts, dict(meta, outer_step=step))
            self._lock.notify_all()

    def retract(self) -> None:
        """Stops serving the current tensors because they are about to change.

        Sessions still reading them go on from a copy (costs one copy of the
        state, only when a joiner is downloading at that moment)."""
        with self._lock:
            cur, self._current = self._current, None
            if cur is not None and cur.users > 0:
                cur.set_parts([p.clone() for p in cur.parts])
                cur.frozen = True
                self.stats.frozen_copies += 1
                self._frozen.append(cur)

    @property
    def step(self) -> Optional[int]:
        with self._lock:
            return None if self._current is None else self._current.step

    def _acquire(self, step: int) -> Optional[_Snapshot]:
        with self._lock:
            # An outer update in progress: wait a little for the new state.
            self._lock.wait_for(lambda: self._current is not None or self._closed, timeout=5.0)
            for snap in ([self._current] if self._current else []) + self._frozen:
                if step < 0 or snap.step == step:
                    snap.users += 1
                    return snap
            return None

    def _release(self, snap: _Snapshot) -> None:
        with self._lock:
            snap.users -= 1
            if snap.frozen and snap.users == 0:
                self._frozen.remove(snap)

    # -- sessions -----------------------------------------------------------------

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, peer = self._sock.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            with self._lock:
                busy = self._sessions >= self.max_sessions
                if not busy:
                    self._sessions += 1
            if busy:
                conn.close()  # the joiner tries another node
                continue
            threading.Thread(target=self._session, args=(conn, peer), daemon=True,
                             name=f"prime-state-session-{self.node_id}").start()

    def _reject(self, peer, why: str) -> None:
        line = f"state server of node {self.node_id}: rejected a connection from {peer[0]}:{peer[1]}: {why}"
        self.stats.rejected += 1
        self.stats.rejected_log.append(line)
        self._log(line)

    def _session(self, conn: socket.socket, peer) -> None:
        snap = None
        try:
            with conn:
                conn.settimeout(HANDSHAKE_TIMEOUT_S)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                hello_c = _recv_exact(conn, _HELLO.size)
                magic, client_id, _ = _HELLO.unpack(hello_c)
                if magic != MAGIC:
                    self._reject(peer, "not a PRIME state request (bad magic)")
                    return
                hello_s = _HELLO.pack(MAGIC, self.node_id, secrets.token_bytes(32))
                mac_s, mac_c, session = _transcript_keys(self.secret, self.job, hello_c, hello_s)
                conn.sendall(hello_s + mac_s)
                try:
                    got = _recv_exact(conn, _MAC)
                except TransferError:
                    self._reject(peer, f"node {client_id} hung up during the handshake (it could not verify this "
                                       "node's proof: the two sides have different job secrets)")
                    return
                if not hmac.compare_digest(got, mac_c):
                    conn.sendall(b"\x01")
                    self._reject(peer, f"node {client_id} did not prove the job secret (wrong secret?)")
                    return
                conn.sendall(b"\x00")
                conn.settimeout(self.timeout_s)
                ch = _Channel(conn, session, b"s2c", b"c2s")
                req = ch.recv_json()
                want, offset = int(req.get("step", -1)), int(req.get("offset", 0))
                snap = self._acquire(want)
                if snap is None:
                    ch.send_json({"ok": False, "newest": self.step if self.step is not None else -1,
                                  "error": f"node {self.node_id} no longer holds the state after outer step {want}"
                                  if want >= 0 else f"node {self.node_id} has no committed state to serve yet"})
                    return
                cuts = list(_pieces(snap.sizes))
                if offset not in {c[0] for c in cuts} | {snap.total}:
                    ch.send_json({"ok": False, "newest": snap.step, "error": f"offset {offset} is not a piece boundary"})
                    return
                ch.send_json({"ok": True, "step": snap.step, "total": snap.total, "meta": snap.meta,
                              "piece": PIECE})
                self.stats.sessions += 1
                self._log(f"state server of node {self.node_id}: serving outer step {snap.step} to node {client_id} "
                          f"from byte {offset} of {snap.total}")
                self._stream(ch, snap, cuts, offset)
        except (OSError, TransferError) as e:
            self._log(f"state server of node {self.node_id}: session with {peer[0]}:{peer[1]} ended: {e}")
        finally:
            if snap is not None:
                self._release(snap)
            with self._lock:
                self._sessions -= 1

    def _stream(self, ch: _Channel, snap: _Snapshot, cuts, offset: int) -> None:
        h = hashlib.sha256()
        t0, sent = time.monotonic(), 0
        for off, i, s, e in cuts:
            with self._lock:  # retract() may swap the tensors for copies between two pieces
                data = snap.views[i][s:e].numpy().tobytes()
            h.update(data)
            if off < offset:
                continue  # the joiner has it from another node; still part of the digest
            ch.send_piece(data)
            sent += len(data)
            self.stats.bytes_sent += len(data)
            faults.hit("transfer.serve", sent / max(1, snap.total - offset), log=self._log)
            if self.max_rate > 0:  # keep the average at max_rate: the node still trains on this uplink
                ahead = sent / self.max_rate - (time.monotonic() - t0)
                if ahead > 0:
                    time.sleep(ahead)
        ch.send_json({"digest": h.hexdigest()})

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        try:
            self._sock.close()
        finally:
            self._thread.join(timeout=5)


@dataclass
class FetchResult:
    """A completed download."""

    step: int
    meta: dict
    total_bytes: int
    seconds: float
    digest: str
    segments: list = field(default_factory=list)
    """[source id, first byte, end byte] for every stretch received (several after a resume)."""
    failures: list = field(default_factory=list)
    """Errors on the way (each followed by a retry elsewhere)."""


def _connect(address: str, timeout: float) -> socket.socket:
    host, _, port = address.rpartition(":")
    sock = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _handshake(sock: socket.socket, secret: bytes, job: bytes, my_id: int, source: int) -> _Channel:
    hello_c = _HELLO.pack(MAGIC, my_id, secrets.token_bytes(32))
    sock.sendall(hello_c)
    reply = _recv_exact(sock, _HELLO.size + _MAC)
    hello_s, mac_s = reply[: _HELLO.size], reply[_HELLO.size:]
    if _HELLO.unpack(hello_s)[0] != MAGIC:
        raise TransferError(f"node {source} did not answer as a PRIME state server", "auth")
    want_s, mac_c, session = _transcript_keys(secret, job, hello_c, hello_s)
    if not hmac.compare_digest(mac_s, want_s):
        raise TransferError(f"node {source} could not prove the job secret: this node and the job have different "
                            "secrets (set the same PRIME_RING_SECRET on every node)", "auth")
    sock.sendall(mac_c)
    if _recv_exact(sock, 1) != b"\x00":
        raise TransferError(f"node {source} rejected this node's proof of the job secret", "auth")
    return _Channel(sock, session, b"c2s", b"s2c")


def fetch_state(
    parts: list[torch.Tensor],
    sources: Callable[[], list[tuple[int, str]]],
    *,
    secret: bytes,
    job: str,
    my_id: int,
    check_meta: Callable[[dict], Optional[str]],
    timeout_s: float = 60.0,
    give_up_s: float = 600.0,
    log: Optional[Callable[[str], None]] = None,
    step: Optional[int] = None,
) -> FetchResult:
    """Downloads the newest committed state from a live peer into `parts` (written in place).

    sources() lists (node id, address) of candidate peers, asked again after
    each failure. When a source dies or stalls (nothing for timeout_s), the
    download resumes at the last verified piece from another source that
    holds the same outer step, or restarts from the newest step if none does.
    A source that failed is asked again only after a pause (RETRY_MIN_S,
    doubling up to RETRY_MAX_S while it keeps failing); the others meanwhile.
    check_meta(meta) returns an error message when the peer's settings do not
    fit this node (then TransferError(kind="mismatch")). step: the outer step
    wanted (None: the newest; when no source holds it any more, the newest). Raises
    TransferError(kind="auth") when every peer rejects the handshake.
    """
    fetch = _Fetch(parts, secret=secret, job=job.encode(), my_id=my_id, check_meta=check_meta,
                   timeout_s=timeout_s, log=log or (lambda m: logger.info("%s", m)), step=step)
    while True:
        cands = [s for s in sources() if s[0] not in fetch.auth_failed]
        source = fetch.choose(cands, give_up_s)
        if source is None:
            continue  # ask sources() again: a dead source drops out of it, a new one may appear
        sid, addr = source
        try:
            return fetch.download_from(sid, addr)
        except (TransferError, OSError) as e:
            if isinstance(e, TransferError) and e.kind == "mismatch":
                raise
            fetch.failed(sid, e, several=len(cands) > 1)
        if time.monotonic() - fetch.t0 > give_up_s:
            raise TransferError(f"could not download the state within {give_up_s:g} s: "
                                + "; ".join(fetch.failures[-3:]), "unavailable")


class _Fetch:
    """One download in progress (fetch_state): what was received so far, from whom, and which sources failed
    (asked again only after a pause, or never when they failed the handshake)."""

    def __init__(self, parts: list[torch.Tensor], *, secret: bytes, job: bytes, my_id: int,
                 check_meta: Callable[[dict], Optional[str]], timeout_s: float, log: Callable[[str], None],
                 step: Optional[int]):
        self.parts = parts
        self.views = [_bytes_view(p) for p in parts]
        for v, p in zip(self.views, parts):
            if not p.is_contiguous() or p.device.type != "cpu":
                raise ValueError("fetch_state writes into contiguous CPU tensors")
        sizes = [v.numel() for v in self.views]
        self.cuts = list(_pieces(sizes))
        self.total = sum(sizes)
        self.secret, self.job, self.my_id = secret, job, my_id
        self.check_meta, self.timeout_s, self.log = check_meta, timeout_s, log
        self.step = step  # the outer step being downloaded (None: the newest, until a source names it)
        self.t0 = time.monotonic()
        self.meta: dict = {}
        self.received = 0  # bytes verified so far (a resume continues from here)
        self.segments: list = []
        self.failures: list = []
        self.auth_failed: dict[int, str] = {}
        # source id -> (monotonic time before which it is not asked again, the delay that set it)
        self.backoff: dict[int, tuple[float, float]] = {}
        self.turn = my_id  # the first choice is id mod #sources: joiners spread over the members
        self.start, self.moved_on = 0, False  # of the source being asked: where it started, it serves a newer step

    def choose(self, cands: list, give_up_s: float) -> Optional[tuple]:
        """The source to ask next, or None after a short wait (none is free now: ask sources() again). Raises
        TransferError when every source failed the handshake, or when give_up_s passed without one."""
        if not cands:
            if self.auth_failed:
                raise TransferError("; ".join(self.auth_failed.values()), "auth")
            if time.monotonic() - self.t0 > give_up_s:
                raise TransferError(f"no live node to download the state from within {give_up_s:g} s", "unavailable")
            time.sleep(0.2)
            return None
        # In turn from id mod #sources, skipping the ones that failed a moment ago: a source
        # that died stays listed until its heartbeat times out, while another one answers.
        now = time.monotonic()
        rotation = [cands[(self.turn + j) % len(cands)] for j in range(len(cands))]
        free = [c for c in rotation if self.backoff.get(c[0], (0.0, 0.0))[0] <= now]
        if not free:
            if now - self.t0 > give_up_s:
                raise TransferError(f"could not download the state within {give_up_s:g} s: "
                                    + "; ".join(self.failures[-3:]), "unavailable")
            time.sleep(min(min(self.backoff[c[0]][0] for c in cands) - now, 0.2))
            return None
        self.turn = cands.index(free[0]) + 1
        return free[0]

    def download_from(self, sid: int, addr: str) -> FetchResult:
        """The rest of the state from source `sid` (from the last verified piece when it holds the same outer
        step). Raises TransferError or OSError when the source fails."""
        self.start, self.moved_on = self.received, False
        with _connect(addr, min(self.timeout_s, HANDSHAKE_TIMEOUT_S)) as sock:
            sock.settimeout(HANDSHAKE_TIMEOUT_S)
            ch = _handshake(sock, self.secret, self.job, self.my_id, sid)
            sock.settimeout(self.timeout_s)
            step = self.step
            ch.send_json({"step": -1 if step is None else step, "offset": self.received if step is not None else 0})
            self._accept_header(sid, ch.recv_json())
            for off, i, s, e in self.cuts:
                if off < self.received:
                    continue
                ch.recv_piece_into(memoryview(self.views[i][s:e].numpy()))
                self.received = off + (e - s)
            trailer = ch.recv_json()
            self.segments.append([sid, self.start, self.received])
            digest = state_digest(self.parts)
            if digest != trailer.get("digest"):
                # pieces from two sources that do not make one state: start over
                self.step, self.received = None, 0
                raise TransferError(f"the assembled state does not match node {sid}'s digest", "corrupt")
            return FetchResult(step=self.step, meta=self.meta, total_bytes=self.total,
                               seconds=time.monotonic() - self.t0, digest=digest, segments=self.segments,
                               failures=self.failures)

    def _accept_header(self, sid: int, hdr: dict) -> None:
        """Checks a source's answer to the request: it serves the step asked for, of this node's job and size."""
        if not hdr.get("ok"):
            if self.step is not None and int(hdr.get("newest", -1)) > self.step:
                self.log(f"node {sid} moved on to outer step {hdr['newest']}: restarting the download there")
                self.step, self.received, self.moved_on = None, 0, True
            raise TransferError(hdr.get("error", "refused"), "unavailable")
        if self.step is None or not self.meta:
            problem = self.check_meta(hdr["meta"])
            if problem:
                raise TransferError(problem, "mismatch")
            if int(hdr["total"]) != self.total:
                raise TransferError(f"node {sid} serves {hdr['total']} bytes of state, this node holds "
                                    f"{self.total}: another model or block size", "mismatch")
            self.step, self.meta = int(hdr["step"]), hdr["meta"]
            self.start = self.received = 0
            self.log(f"downloading the state after outer step {self.step} ({self.total / 2**20:.1f} MiB) "
                     f"from node {sid}")

    def failed(self, sid: int, e: BaseException, several: bool) -> None:
        """Records a failed source (never asked again after a failed handshake) and when to ask it again."""
        if isinstance(e, TransferError) and e.kind == "auth":
            self.auth_failed[sid] = str(e)
        if self.received > self.start:
            self.segments.append([sid, self.start, self.received])
        self.failures.append(f"node {sid}: {e}")
        if self.moved_on:
            self.backoff.pop(sid, None)  # it answered and serves a newer state: ask at once
            then = ""
        else:
            # Wait before asking this source again: longer each time it fails in a row, short
            # when it sent something (it was alive a moment ago).
            last = self.backoff.get(sid, (0.0, 0.0))[1]
            delay = RETRY_MIN_S if self.received > self.start or last == 0.0 else min(2 * last, RETRY_MAX_S)
            self.backoff[sid] = (time.monotonic() + delay, delay)
            then = ("" if sid in self.auth_failed else "; trying another node" if several
                    else f"; asking it again in {delay:.1f} s")
        self.log(f"download from node {sid} failed at byte {self.received} of {self.total}: {e}{then}")
