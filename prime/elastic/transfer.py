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

Deadlines (links are the open internet: a stranger can connect, or sit on the
path and slow the bytes down). The server gives a connection HANDSHAKE_TIMEOUT_S
in all to prove the secret (not per recv()), counts it against max_sessions only
once it did, and holds at most MAX_PENDING_HANDSHAKES unproven connections,
dropping the oldest for a new one: strangers' idle or dribbling connections
cannot keep a joiner out. The joiner gives the handshake HANDSHAKE_TIMEOUT_S in
all, and every later frame timeout_s plus its size at MIN_RATE from when it
starts waiting for it (and nothing at all for timeout_s fails at once); the
download never goes on past give_up_s. A source too slow for that is a failed
source: the joiner resumes from another.
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
"""The whole handshake (both sides' hellos and proofs) must be done within this long: one absolute deadline."""
MAX_PENDING_HANDSHAKES = 32
"""A state server handshakes with at most this many connections that have not proved the secret yet; a new one
drops the oldest (a joiner's handshake takes a few round trips, a flood of strangers cannot starve it)."""
PACE_BYTES = 64 << 10
PACE_S = 0.05
"""A server with a rate cap (max_rate) paces each piece in slices of PACE_BYTES, or of PACE_S at the cap where that
is less (1 KiB at least): its joiner never waits longer than one slice's worth of the cap for the next bytes."""
MIN_RATE = 64 << 10
"""Bytes/s. A joiner gives each frame from a source timeout_s plus its size at this rate (69 s for a 4 MiB piece
with the default 60 s), counted from when it starts waiting for it: a source (or a link) slower than that is
dropped for another. A job whose servers are capped below twice this (elastic.transfer_max_rate_mbit) gives its
joiners half the cap instead (fetch_state's min_rate); a capped server paces each piece (pace_slice_bytes at a time)."""
_MAX_REJECTED_LINES = 256
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


class _RunningDigest:
    """state_digest of the pieces a download verified, from byte 0 on and in order, computed on a thread of
    its own while the next pieces arrive: the joiner does not hash the whole state again after the last
    piece (a 10B model's 20 GB share is about 15 s of SHA-256). Anything else (a resume that skips or goes
    back) leaves it behind, and digest() then hashes the whole state as before."""

    def __init__(self):
        from concurrent.futures import ThreadPoolExecutor

        self._pool = ThreadPoolExecutor(1, thread_name_prefix="prime-state-digest")  # one thread: in order
        self._h, self.upto = hashlib.sha256(), 0

    def add(self, at: int, piece: memoryview) -> None:
        """Piece bytes [at, at + len) just verified (they are not written again unless the download restarts
        at 0)."""
        if at == 0 and self.upto:
            self._h, self.upto = hashlib.sha256(), 0  # a restart: the old hash's pending updates go to waste
        if at != self.upto:
            self.upto = -1  # out of order: digest() hashes the whole state
            return
        self._pool.submit(self._h.update, piece)
        self.upto += len(piece)

    def digest(self, parts: list[torch.Tensor], total: int) -> str:
        if self.upto != total:
            return state_digest(parts)
        h = self._h
        self._pool.submit(lambda: None).result()  # every update before it has run
        return h.hexdigest()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)  # (what is left to hash of a failed download is dropped)


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


class _Due:
    """An absolute deadline (time.monotonic()) for what is being received, and what set it (for the error)."""

    __slots__ = ("at", "why")

    def __init__(self, at: float, why: str):
        self.at, self.why = at, why

    def sooner(self, other: "_Due") -> "_Due":
        return self if self.at <= other.at else other


class _Overdue(TransferError):
    """Bytes that were not all in by their deadline (got of want)."""

    def __init__(self, due: _Due, got: int, want: int):
        super().__init__(f"{got} of {want} bytes had come by {due.why}", "connection")
        self.due, self.got, self.want = due, got, want


def _arm(sock: socket.socket, due: Optional[_Due], idle: Optional[float] = None, got: int = 0, want: int = 0) -> bool:
    """Sets the socket's timeout to the time left before `due` (at most `idle`); raises _Overdue when none is
    left. True when `due`, not `idle`, bounds the wait."""
    if due is None:
        return False
    left = due.at - time.monotonic()
    if left <= 0:
        raise _Overdue(due, got, want)
    sock.settimeout(left if idle is None else min(left, idle))
    return idle is None or left <= idle


def _recv_exact(sock: socket.socket, n: int, due: Optional[_Due] = None, idle: Optional[float] = None) -> bytes:
    buf = bytearray(n)
    _recv_into(sock, memoryview(buf), due, idle)
    return bytes(buf)


def _recv_into(sock: socket.socket, view: memoryview, due: Optional[_Due] = None,
               idle: Optional[float] = None) -> None:
    """Fills view. With `due`, every recv() waits at most the time left before it (and at most `idle`): raises
    _Overdue at the deadline, TransferError when nothing came for `idle` s. Without, the socket's timeout."""
    got = 0
    while got < len(view):
        by_due = _arm(sock, due, idle, got, len(view))
        try:
            n = sock.recv_into(view[got:])
        except socket.timeout:
            if due is None:
                raise
            if by_due or time.monotonic() >= due.at:
                raise _Overdue(due, got, len(view)) from None
            raise TransferError(f"nothing came for {idle:g} s (a stalled source or link)") from None
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
        # due(t, n): the deadline of a frame of n bytes that the receiver started waiting for at time t (None:
        # the socket's timeout per recv()); idle: the longest wait for a single recv() under it.
        self.due: Optional[Callable[[float, int], _Due]] = None
        self.idle: Optional[float] = None

    def _due(self, t: float, n: int) -> Optional[_Due]:
        return None if self.due is None else self.due(t, n)

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

    def send_piece(self, body, pace: Optional[Callable[[int], None]] = None, slice_bytes: int = PACE_BYTES) -> None:
        """A piece of state: u32 length | u32 CRC32C | HMAC(header) | bytes. pace(n), if given, is called before
        each slice_bytes of the body with the bytes about to go (a rate cap waits there, so that a throttled piece
        trickles instead of pausing for its whole length between pieces)."""
        body = memoryview(body).cast("B")
        head = _PIECE.pack(len(body), _crc32c(body))
        tag = self._tag(self.send_dir, self.sent, head)
        self.sent += 1
        self.sock.sendall(head + tag)
        if pace is None:
            self.sock.sendall(body)
            return
        for at in range(0, len(body), slice_bytes):
            part = body[at: at + slice_bytes]
            pace(len(part))
            self.sock.sendall(part)

    def recv_piece_into(self, view: memoryview) -> None:
        """Receives one piece of exactly len(view) bytes into view; checks the header's tag and the CRC."""
        size = _PIECE.size + _MAC + len(view)
        due = self._due(time.monotonic(), size)
        try:
            head = _recv_exact(self.sock, _PIECE.size, due, self.idle)
        except _Overdue as e:
            raise _Overdue(e.due, e.got, size) from None
        try:
            tag = _recv_exact(self.sock, _MAC, due, self.idle)
        except _Overdue as e:
            raise _Overdue(e.due, _PIECE.size + e.got, size) from None
        if not hmac.compare_digest(tag, self._tag(self.recv_dir, self.received, head)):
            raise TransferError(f"frame {self.received} failed its authentication tag", "corrupt")
        self.received += 1
        n, crc = _PIECE.unpack(head)
        if n != len(view):
            raise TransferError(f"protocol error: a piece of {n} bytes where {len(view)} were expected", "corrupt")
        try:
            _recv_into(self.sock, view, due, self.idle)
        except _Overdue as e:
            raise _Overdue(e.due, _PIECE.size + _MAC + e.got, size) from None
        if _crc32c(view) != crc:
            raise TransferError("a piece failed its CRC32C (corrupted in transit)", "corrupt")

    def recv_json(self) -> dict:
        t = time.monotonic()
        (n,) = _LEN.unpack(_recv_exact(self.sock, _LEN.size, self._due(t, _LEN.size), self.idle))
        if n > _MAX_JSON:
            raise TransferError(f"protocol error: a {n}-byte message", "corrupt")
        size = _LEN.size + n + _MAC
        due = self._due(t, size)
        try:
            body = _recv_exact(self.sock, n, due, self.idle)
        except _Overdue as e:
            raise _Overdue(e.due, _LEN.size + e.got, size) from None
        try:
            tag = _recv_exact(self.sock, _MAC, due, self.idle)
        except _Overdue as e:
            raise _Overdue(e.due, _LEN.size + n + e.got, size) from None
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
    """The first 256 rejections (all of them are counted in `rejected`)."""
    dropped: int = 0
    """Connections dropped before they proved the secret to make room for newer ones (MAX_PENDING_HANDSHAKES)."""


class _Pending:
    """A connection that has not proved the job secret yet."""

    def __init__(self, conn: socket.socket, peer):
        self.conn, self.peer = conn, peer
        self.evicted = False


class StateServer:
    """Serves this node's newest committed outer state to joiners (see the module docstring).

    publish(step, parts, meta) makes the tensors servable; retract() must be
    called before they change (it copies the state for sessions still reading
    it). Sessions run on their own threads; at most max_sessions at once that
    proved the job secret (a joiner over that is told the server is busy and
    asks another node), and at most max_pending (MAX_PENDING_HANDSHAKES) that
    have not yet, each for HANDSHAKE_TIMEOUT_S at most (a new connection drops
    the oldest).
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
        self.max_pending = MAX_PENDING_HANDSHAKES
        self._pending: list[_Pending] = []  # oldest first
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
            p = _Pending(conn, peer)
            with self._lock:
                # Make room: drop the oldest connection that has not proved the secret yet (its thread sees
                # EOF at once and ends). A joiner's handshake takes a few round trips, so strangers would
                # have to open max_pending connections within them to drop it.
                while len(self._pending) >= max(1, self.max_pending):
                    self._evict(self._pending.pop(0))
                self._pending.append(p)
            try:
                threading.Thread(target=self._session, args=(p,), daemon=True,
                                 name=f"prime-state-session-{self.node_id}").start()
            except RuntimeError as e:  # out of threads: refuse this one, keep accepting
                with self._lock:
                    self._unlist(p)
                conn.close()
                self._reject(peer, f"cannot start a session thread: {e}")

    def _evict(self, p: _Pending) -> None:
        """With the lock held: p is no longer listed, and its connection is cut (it is still open: a session
        unlists itself under the lock before it closes the connection)."""
        p.evicted = True
        self.stats.dropped += 1
        try:
            p.conn.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _unlist(self, p: _Pending) -> None:
        if p in self._pending:
            self._pending.remove(p)

    def _reject(self, peer, why: str) -> None:
        line = f"state server of node {self.node_id}: rejected a connection from {peer[0]}:{peer[1]}: {why}"
        with self._lock:
            self.stats.rejected += 1
            n = self.stats.rejected
            listed = len(self.stats.rejected_log) < _MAX_REJECTED_LINES
            if listed:
                self.stats.rejected_log.append(line)
        if listed:
            self._log(line)
        elif n % _MAX_REJECTED_LINES == 0:  # a flood: a line now and then, not one per connection
            self._log(f"{line} ({n} connections rejected so far)")

    def _session(self, p: _Pending) -> None:
        conn, peer = p.conn, p.peer
        snap, slot = None, False
        try:
            try:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                ch, client_id, slot = self._handshake(p)
            finally:
                with self._lock:
                    self._unlist(p)  # before the connection closes: _evict never cuts a closed one
            if ch is None:
                return
            # The request follows at once: it has timeout_s in all (not per recv()), then each send
            # timeout_s (sendall's timeout is for the whole call).
            ch.due = lambda t, n: _Due(t + self.timeout_s, f"{self.timeout_s:g} s (timeout_s)")
            req = ch.recv_json()
            ch.due = None
            conn.settimeout(self.timeout_s)
            if not slot:
                ch.send_json({"ok": False, "error": f"node {self.node_id} is busy: it serves {self.max_sessions} "
                                                    "joiners already"})
                self._log(f"state server of node {self.node_id}: turned node {client_id} away: it serves "
                          f"{self.max_sessions} joiners already")
                return
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
            conn.close()
            if snap is not None:
                self._release(snap)
            if slot:
                with self._lock:
                    self._sessions -= 1

    def _handshake(self, p: _Pending) -> tuple:
        """The server's side of the handshake, all of it within HANDSHAKE_TIMEOUT_S: (channel, client id, whether
        it holds a session slot), or (None, None, False) after a rejection (logged)."""
        conn, peer = p.conn, p.peer
        limit = HANDSHAKE_TIMEOUT_S
        due = _Due(time.monotonic() + limit, f"the handshake's deadline ({limit:g} s after it connected)")
        client_id = None
        try:
            hello_c = _recv_exact(conn, _HELLO.size, due)
            magic, client_id, _ = _HELLO.unpack(hello_c)
            if magic != MAGIC:
                self._reject(peer, "not a PRIME state request (bad magic)")
                return None, None, False
            hello_s = _HELLO.pack(MAGIC, self.node_id, secrets.token_bytes(32))
            mac_s, mac_c, session = _transcript_keys(self.secret, self.job, hello_c, hello_s)
            _arm(conn, due)
            conn.sendall(hello_s + mac_s)
            try:
                got = _recv_exact(conn, _MAC, due)
            except _Overdue:
                raise
            except TransferError:
                if p.evicted:
                    raise
                self._reject(peer, f"node {client_id} hung up during the handshake (it could not verify this "
                                   "node's proof: the two sides have different job secrets)")
                return None, None, False
            if not hmac.compare_digest(got, mac_c):
                _arm(conn, due)
                conn.sendall(b"\x01")
                self._reject(peer, f"node {client_id} did not prove the job secret (wrong secret?)")
                return None, None, False
            with self._lock:  # it proved the secret: now it counts against max_sessions
                if p.evicted:
                    raise TransferError("dropped")
                self._unlist(p)
                slot = self._sessions < self.max_sessions
                if slot:
                    self._sessions += 1
            try:
                _arm(conn, due)
                conn.sendall(b"\x00")
            except BaseException:
                if slot:
                    with self._lock:
                        self._sessions -= 1
                raise
            return _Channel(conn, session, b"s2c", b"c2s"), client_id, slot
        except (OSError, TransferError) as e:
            who = "a client" if client_id is None else f"node {client_id}"
            if p.evicted:
                why = (f"dropped to make room for new connections ({self.max_pending} handshakes were pending; "
                       "this one had not finished)")
            elif isinstance(e, _Overdue):
                why = f"{who} did not finish the handshake within {limit:g} s ({e})"
            else:
                why = f"the handshake with {who} failed: {e}"
            self._reject(peer, why)
            return None, None, False

    def _stream(self, ch: _Channel, snap: _Snapshot, cuts, offset: int) -> None:
        h = hashlib.sha256()
        t0, sent, paced = time.monotonic(), 0, [0]

        def pace(n: int) -> None:  # keep the average at max_rate: the node still trains on this uplink
            paced[0] += n
            ahead = paced[0] / self.max_rate - (time.monotonic() - t0)
            if ahead > 0:
                time.sleep(ahead)

        for off, i, s, e in cuts:
            with self._lock:  # retract() may swap the tensors for copies between two pieces
                data = snap.views[i][s:e].numpy().tobytes()
            h.update(data)
            if off < offset:
                continue  # the joiner has it from another node; still part of the digest
            ch.send_piece(data, pace if self.max_rate > 0 else None, pace_slice_bytes(self.max_rate))
            sent += len(data)
            self.stats.bytes_sent += len(data)
            faults.hit("transfer.serve", sent / max(1, snap.total - offset), log=self._log)
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


def _handshake(sock: socket.socket, secret: bytes, job: bytes, my_id: int, source: int,
               due: Optional[_Due] = None) -> _Channel:
    hello_c = _HELLO.pack(MAGIC, my_id, secrets.token_bytes(32))
    _arm(sock, due)
    sock.sendall(hello_c)
    reply = _recv_exact(sock, _HELLO.size + _MAC, due)
    hello_s, mac_s = reply[: _HELLO.size], reply[_HELLO.size:]
    if _HELLO.unpack(hello_s)[0] != MAGIC:
        raise TransferError(f"node {source} did not answer as a PRIME state server", "auth")
    want_s, mac_c, session = _transcript_keys(secret, job, hello_c, hello_s)
    if not hmac.compare_digest(mac_s, want_s):
        raise TransferError(f"node {source} could not prove the job secret: this node and the job have different "
                            "secrets (set the same PRIME_RING_SECRET on every node)", "auth")
    _arm(sock, due)
    sock.sendall(mac_c)
    if _recv_exact(sock, 1, due) != b"\x00":
        raise TransferError(f"node {source} rejected this node's proof of the job secret", "auth")
    return _Channel(sock, session, b"c2s", b"s2c")


def pace_slice_bytes(max_rate: float) -> int:
    """The bytes a server capped at max_rate (bytes/s; 0: no cap) sends between two waits: PACE_BYTES, or PACE_S at
    the cap where that is less, 1 KiB at least (a slice of PACE_BYTES at 32 KiB/s was a 2 s silence)."""
    if max_rate <= 0:
        return PACE_BYTES
    return max(1 << 10, min(PACE_BYTES, int(max_rate * PACE_S)))


def joiner_min_rate(max_rate: float) -> float:
    """The least rate (bytes/s) a joiner accepts from a source of a job whose servers are capped at max_rate
    (0: no cap): MIN_RATE, or half the cap when that is lower."""
    return MIN_RATE if max_rate <= 0 else min(MIN_RATE, max_rate / 2)


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
    min_rate: float = MIN_RATE,
) -> FetchResult:
    """Downloads the newest committed state from a live peer into `parts` (written in place).

    sources() lists (node id, address) of candidate peers, asked again after
    each failure. When a source dies, stalls (nothing for timeout_s) or is too
    slow (a frame not in within timeout_s plus its size at min_rate; the
    handshake not done within HANDSHAKE_TIMEOUT_S), the download resumes at
    the last verified piece from another source that holds the same outer
    step, or restarts from the newest step if none does. Nothing waits past
    give_up_s after the start: then TransferError(kind="unavailable").
    A source that failed is asked again only after a pause (RETRY_MIN_S,
    doubling up to RETRY_MAX_S while it keeps failing); the others meanwhile.
    check_meta(meta) returns an error message when the peer's settings do not
    fit this node (then TransferError(kind="mismatch")). step: the outer step
    wanted (None: the newest; when no source holds it any more, the newest). Raises
    TransferError(kind="auth") when every peer rejects the handshake.
    """
    fetch = _Fetch(parts, secret=secret, job=job.encode(), my_id=my_id, check_meta=check_meta,
                   timeout_s=timeout_s, log=log or (lambda m: logger.info("%s", m)), step=step, give_up_s=give_up_s,
                   min_rate=min_rate)
    try:
        return _fetch_from_sources(fetch, sources, give_up_s)
    finally:
        fetch.running.close()


def _fetch_from_sources(fetch: "_Fetch", sources: Callable[[], list], give_up_s: float) -> FetchResult:
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
        if time.monotonic() - fetch.t0 >= give_up_s:
            raise TransferError(f"could not download the state within {give_up_s:g} s: "
                                + "; ".join(fetch.failures[-3:]), "unavailable")


class _Fetch:
    """One download in progress (fetch_state): what was received so far, from whom, and which sources failed
    (asked again only after a pause, or never when they failed the handshake)."""

    def __init__(self, parts: list[torch.Tensor], *, secret: bytes, job: bytes, my_id: int,
                 check_meta: Callable[[dict], Optional[str]], timeout_s: float, log: Callable[[str], None],
                 step: Optional[int], give_up_s: float = float("inf"), min_rate: float = MIN_RATE):
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
        if not min_rate > 0:
            raise ValueError(f"min_rate must be positive bytes/s, got {min_rate}")
        self.min_rate = min_rate
        self.step = step  # the outer step being downloaded (None: the newest, until a source names it)
        self.t0 = time.monotonic()
        # Nothing is waited for past this: a source slower than the frames' deadlines is left for another, and
        # the last one is cut off here.
        self.give_up = _Due(self.t0 + give_up_s, f"the give-up deadline ({give_up_s:g} s after the download "
                                                 "began, elastic.join_timeout_s)")
        self.meta: dict = {}
        self.received = 0  # bytes verified so far (a resume continues from here)
        self.segments: list = []
        self.failures: list = []
        self.auth_failed: dict[int, str] = {}
        # source id -> (monotonic time before which it is not asked again, the delay that set it)
        self.backoff: dict[int, tuple[float, float]] = {}
        self.turn = my_id  # the first choice is id mod #sources: joiners spread over the members
        self.running = _RunningDigest()  # of the pieces received so far (closed by fetch_state)
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
        limit = HANDSHAKE_TIMEOUT_S
        due = _Due(time.monotonic() + limit, f"the handshake's deadline ({limit:g} s)").sooner(self.give_up)
        try:
            sock = _connect(addr, max(1e-3, min(self.timeout_s, due.at - time.monotonic())))
        except socket.timeout:
            raise TransferError(f"could not connect to node {sid} at {addr} by {due.why}") from None
        with sock:
            try:
                ch = _handshake(sock, self.secret, self.job, self.my_id, sid, due)
                # Every frame from now on: timeout_s plus its size at MIN_RATE from when this node starts waiting
                # for it (and at most timeout_s without a byte), never past give_up_s.
                ch.due, ch.idle = self._frame_due, self.timeout_s
                step = self.step
                _arm(sock, self._frame_due(time.monotonic(), 0))
                ch.send_json({"step": -1 if step is None else step,
                              "offset": self.received if step is not None else 0})
                self._accept_header(sid, ch.recv_json())
                for off, i, s, e in self.cuts:
                    if off < self.received:
                        continue
                    piece = memoryview(self.views[i][s:e].numpy())
                    ch.recv_piece_into(piece)
                    self.received = off + (e - s)
                    self.running.add(off, piece)
                trailer = ch.recv_json()
            except _Overdue as e:
                what = (f"{e.got} of the {e.want} bytes of the frame it was sending had come by {e.due.why}"
                        if e.want else f"{e.due.why} passed")
                raise TransferError(
                    f"node {sid} at {addr} was too slow (a slowed or stalled link?): {what}; "
                    f"{self.received - self.start} bytes of state came from it ({self.received} of {self.total} "
                    "verified in all)", "connection") from None
            self.segments.append([sid, self.start, self.received])
            digest = self.running.digest(self.parts, self.total)
            if digest != trailer.get("digest"):
                # pieces from two sources that do not make one state: start over
                self.step, self.received = None, 0
                raise TransferError(f"the assembled state does not match node {sid}'s digest", "corrupt")
            return FetchResult(step=self.step, meta=self.meta, total_bytes=self.total,
                               seconds=time.monotonic() - self.t0, digest=digest, segments=self.segments,
                               failures=self.failures)

    def _frame_due(self, t: float, n: int) -> _Due:
        """The deadline of a frame of n bytes that this node started waiting for at time t."""
        limit = self.timeout_s + n / self.min_rate
        return _Due(t + limit, f"its deadline ({limit:.3g} s: timeout_s {self.timeout_s:g} s + {n} bytes at the "
                               f"minimum rate of {self.min_rate / 1024:g} KiB/s)").sooner(self.give_up)

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
