"""The state transfer's deadlines (prime.elastic.transfer) against strangers and slowed links.

Threat model: links are the open internet. A stranger (without the job secret)
can connect to a state server's port and sit on the path of a joiner's
download. Promises checked here: idle or dribbling strangers cannot keep a
joiner out of a state server (the handshake has one deadline, only proven
connections count against max_sessions, the oldest unproven one is dropped for
a new one), and a download whose bytes are dripped fails within its deadlines
(never past give_up_s) and goes on from another source, with an error that
says what happened. A normal download still lands bit for bit, checked as
before.
"""

from __future__ import annotations

import random
import select
import socket
import threading
import time

import pytest
import torch

from prime.elastic import transfer

SECRET = b"k" * 32


def _state(seed: int, n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g), torch.randn(n // 3 + 5, generator=g)]


def _fetch(dst, sources, **kw):
    kw.setdefault("timeout_s", 5)
    return transfer.fetch_state(dst, sources, secret=SECRET, job="job", my_id=kw.pop("my_id", 0),
                                check_meta=lambda meta: None, **kw)


def _in_thread(fn) -> tuple[threading.Thread, dict]:
    """Runs fn on a daemon thread (an old build could block for good): out['result'|'error'], out['seconds']."""
    out: dict = {}

    def run():
        t0 = time.monotonic()
        try:
            out["result"] = fn()
        except Exception as e:  # noqa: BLE001 - reported by the test
            out["error"] = e
        out["seconds"] = time.monotonic() - t0

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


class _Strangers:
    """n connections without the secret to a server, each reopened as soon as the server drops it: `idle` ones
    send nothing, the others the hello one byte every `every` s."""

    def __init__(self, port: int, n: int, idle: int, every: float = 0.5, reopen_after: float = 0.0):
        self.port, self.every, self.reopen_after = port, every, reopen_after
        self.stop = threading.Event()
        self.opened = 0
        self.threads = [threading.Thread(target=self._run, args=(i < idle,), daemon=True) for i in range(n)]
        for t in self.threads:
            t.start()

    def _run(self, idle: bool) -> None:
        while not self.stop.is_set():
            try:
                s = socket.create_connection(("127.0.0.1", self.port), timeout=2)
            except OSError:
                self.stop.wait(0.05)
                continue
            self.opened += 1
            try:
                data = b"" if idle else b"PRIMEST1" + bytes(36)
                i = 0
                while not self.stop.is_set():
                    if i < len(data):
                        s.sendall(data[i:i + 1])
                        i += 1
                    r, _, _ = select.select([s], [], [], self.every)
                    if r and not s.recv(4096):
                        break  # the server dropped it: open another
            except OSError:
                pass
            finally:
                s.close()
            self.stop.wait(self.reopen_after)

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(5)


class _Proxy:
    """On the path between joiners and a server: client -> server bytes untouched; server -> client the first
    `free` bytes untouched, then (drip) one byte every `every` s, or (flip) one byte changed on the first
    connection only."""

    def __init__(self, port: int, *, free: int, every: float = 0.5, flip: bool = False):
        self.port, self.free, self.every, self.flip = port, free, every, flip
        self.lsock = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.lsock.getsockname()[1]}"
        self.stop = threading.Event()
        self.conns = 0
        self.socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                c, _ = self.lsock.accept()
            except OSError:
                return
            try:
                s = socket.create_connection(("127.0.0.1", self.port))
            except OSError:  # the server is gone (the test is over)
                c.close()
                continue
            self.socks += [c, s]
            self.conns += 1
            threading.Thread(target=self._pipe, args=(c, s), daemon=True).start()
            threading.Thread(target=self._down, args=(s, c, self.conns == 1), daemon=True).start()

    @staticmethod
    def _pipe(a: socket.socket, b: socket.socket) -> None:
        try:
            while d := a.recv(65536):
                b.sendall(d)
        except OSError:
            pass

    def _down(self, s: socket.socket, c: socket.socket, first: bool) -> None:
        sent = 0
        try:
            while not self.stop.is_set():
                d = s.recv(self.free - sent if sent < self.free else (65536 if self.flip else 1))
                if not d:
                    return
                if self.flip and first and sent >= self.free:
                    d = bytes([d[0] ^ 0x40]) + d[1:]
                    first = False
                c.sendall(d)
                sent += len(d)
                if sent >= self.free and not self.flip:
                    self.stop.wait(self.every)
        except OSError:
            pass

    def close(self) -> None:
        self.stop.set()
        self.lsock.close()
        for s in self.socks:
            try:
                s.close()
            except OSError:
                pass


@pytest.fixture
def served():
    """A state server (timeout_s 5, so that abandoned sessions end soon) with a small state."""
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    parts = _state(seed, 10_000)  # two frames, 53 KB: well inside one piece each
    logs: list = []
    server = transfer.StateServer(SECRET, "job", 0, timeout_s=5, log=logs.append)
    server.publish(3, parts, {"inner_step": 30})
    try:
        yield server, parts, logs
    finally:
        server.close()


# The handshake, the header and the first frame's piece header: what a proxy lets through before it drips.
_BEFORE_STATE = 44 + 32 + 1 + 400


# -- (a) strangers holding the server's connections --------------------------------------------------------------


def test_idle_and_dribbling_strangers_do_not_keep_a_joiner_out(served):
    """More strangers than max_sessions keep connections open (idle, or sending the hello one byte at a time
    and reconnecting whenever dropped): a joiner with the secret still downloads at once."""
    server, parts, _ = served
    strangers = _Strangers(server.port, n=2 * server.max_sessions, idle=server.max_sessions)
    try:
        time.sleep(0.5)  # every stranger connected
        dst = [torch.zeros_like(p) for p in parts]
        t, out = _in_thread(lambda: _fetch(dst, lambda: [(0, server.address)], give_up_s=12))
        t.join(15)
        assert "result" in out, f"the joiner could not download while strangers held connections: {out}"
        assert out["seconds"] < 3, out["seconds"]  # give_up_s is 12
        assert all(torch.equal(a, b) for a, b in zip(dst, parts))
        assert server.stats.sessions == 1
    finally:
        strangers.close()


def test_a_flood_of_strangers_drops_the_oldest_handshake_not_the_joiner(served):
    """More strangers than the pending-handshake bound: each new connection drops the oldest unproven one, and
    the joiner (whose handshake takes a few round trips) still gets through."""
    server, parts, logs = served
    server.max_pending = 6
    strangers = _Strangers(server.port, n=12, idle=12, reopen_after=0.1)
    try:
        time.sleep(1.0)
        dst = [torch.zeros_like(p) for p in parts]
        t, out = _in_thread(lambda: _fetch(dst, lambda: [(0, server.address)], give_up_s=12))
        t.join(15)
        assert "result" in out, f"the joiner could not download during the flood: {out}"
        assert out["seconds"] < 5, out["seconds"]
        assert all(torch.equal(a, b) for a, b in zip(dst, parts))
        assert server.stats.dropped > 0 and any("dropped to make room" in line for line in logs), logs[-5:]
    finally:
        strangers.close()


def test_the_handshake_has_one_deadline_not_one_per_recv(served, monkeypatch):
    """A stranger sending the hello one byte every 0.2 s (each recv() gets a byte well within any per-recv
    timeout) is cut off once HANDSHAKE_TIMEOUT_S passed since it connected."""
    server, _, logs = served
    monkeypatch.setattr(transfer, "HANDSHAKE_TIMEOUT_S", 1.0)
    s = socket.create_connection(("127.0.0.1", server.port))
    t0, cut = time.monotonic(), None
    try:
        for b in (b"PRIMEST1" + bytes(36) + bytes(32)) * 2:
            if time.monotonic() - t0 > 5:
                break
            try:
                s.sendall(bytes([b]))
                r, _, _ = select.select([s], [], [], 0.2)
                if r and not s.recv(4096):
                    cut = time.monotonic() - t0
                    break
            except OSError:
                cut = time.monotonic() - t0
                break
    finally:
        s.close()
    assert cut is not None and cut < 2.5, f"the dribbling connection was still open after {time.monotonic() - t0:.1f} s"
    deadline = time.monotonic() + 2
    while not any("did not finish the handshake within 1 s" in line for line in logs) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert any("did not finish the handshake within 1 s" in line for line in logs), logs


def test_only_proven_sessions_count_and_a_busy_server_says_so(served):
    """max_sessions bounds the sessions of joiners that proved the secret: one over it is told the server is
    busy (and tries again later), instead of a dropped connection."""
    server, parts, _ = served
    server.max_sessions = 1
    server.max_rate = sum(p.numel() * 4 for p in parts) / 1.5  # the first download takes ~1.5 s
    first = [torch.zeros_like(p) for p in parts]
    t, out = _in_thread(lambda: _fetch(first, lambda: [(0, server.address)], my_id=1, give_up_s=10))
    time.sleep(0.3)
    dst = [torch.zeros_like(p) for p in parts]
    r = _fetch(dst, lambda: [(0, server.address)], my_id=2, give_up_s=10)
    t.join(10)
    assert "result" in out, out
    assert all(torch.equal(a, b) for a, b in zip(dst, parts)) and all(torch.equal(a, b) for a, b in zip(first, parts))
    assert r.failures and all("busy" in f for f in r.failures), r.failures


# -- (b) a dripped download ---------------------------------------------------------------------------------------


def test_a_dripped_download_gives_up_within_give_up_s(served):
    """Someone on the path passes the handshake and header, then drips the server's bytes (one every 0.5 s,
    below timeout_s per recv): fetch_state raises within give_up_s, naming the source, what came and the
    deadline."""
    server, parts, _ = served
    proxy = _Proxy(server.port, free=_BEFORE_STATE, every=0.5)
    try:
        dst = [torch.zeros_like(p) for p in parts]
        give_up = 4.0
        t, out = _in_thread(lambda: _fetch(dst, lambda: [(0, proxy.address)], timeout_s=2, give_up_s=give_up))
        t.join(give_up + 6)
        assert not t.is_alive(), f"fetch_state was still downloading {give_up + 6:g} s in (give_up_s {give_up:g})"
        assert "error" in out, out
        assert out["seconds"] < give_up + 1.5, out["seconds"]
        e = out["error"]
        assert isinstance(e, transfer.TransferError) and e.kind == "unavailable", repr(e)
        msg = str(e)
        assert f"within {give_up:g} s" in msg and "node 0" in msg and proxy.address in msg, msg
        assert "too slow" in msg and "give-up deadline" in msg and "bytes" in msg, msg
    finally:
        proxy.close()


def test_a_dripped_source_is_left_for_another_within_its_frame_deadline(served):
    """The same drip on the first source: once a frame is overdue (timeout_s + its size at MIN_RATE), the joiner
    takes the other source and downloads the whole state from it, long before give_up_s."""
    server, parts, _ = served
    proxy = _Proxy(server.port, free=_BEFORE_STATE, every=0.5)
    try:
        timeout_s, give_up = 2.0, 30.0
        frame = parts[0].numel() * 4 + 40  # the first piece: its bytes and header
        limit = timeout_s + frame / getattr(transfer, "MIN_RATE", 64 << 10)
        dst = [torch.zeros_like(p) for p in parts]
        t, out = _in_thread(lambda: _fetch(dst, lambda: [(0, proxy.address), (1, server.address)],
                                           timeout_s=timeout_s, give_up_s=give_up))
        t.join(limit + 6)
        assert not t.is_alive(), f"fetch_state was still on the dripped source after {limit + 6:.1f} s"
        assert "result" in out, out
        r = out["result"]
        assert out["seconds"] < limit + 3, (out["seconds"], limit)
        assert all(torch.equal(a, b) for a, b in zip(dst, parts))
        assert r.segments == [[1, 0, r.total_bytes]], r.segments
        assert len(r.failures) == 1 and r.failures[0].startswith("node 0: "), r.failures
        assert "too slow" in r.failures[0] and "its deadline" in r.failures[0], r.failures
    finally:
        proxy.close()


# -- (c) normal downloads ---------------------------------------------------------------------------------------


def test_a_normal_download_lands_bit_for_bit_with_its_digest(served):
    server, parts, _ = served
    dst = [torch.zeros_like(p) for p in parts]
    r = _fetch(dst, lambda: [(0, server.address)], give_up_s=10)
    assert r.step == 3 and r.meta["inner_step"] == 30 and r.failures == []
    assert all(torch.equal(a, b) for a, b in zip(dst, parts))
    assert r.digest == transfer.state_digest(parts) and r.segments == [[0, 0, r.total_bytes]]


def test_a_byte_changed_on_the_path_is_caught_and_fetched_again(served):
    """A byte of a piece changed in transit fails its CRC32C: the joiner fetches it again from another source."""
    server, parts, _ = served
    proxy = _Proxy(server.port, free=_BEFORE_STATE + 100, flip=True)
    try:
        dst = [torch.zeros_like(p) for p in parts]
        r = _fetch(dst, lambda: [(0, proxy.address), (1, server.address)], give_up_s=10)
        assert all(torch.equal(a, b) for a, b in zip(dst, parts))
        assert r.digest == transfer.state_digest(parts)
        assert len(r.failures) == 1 and "CRC32C" in r.failures[0], r.failures
    finally:
        proxy.close()


def test_a_server_capped_below_the_minimum_rate_still_serves_a_joiner_of_its_job():
    """elastic.transfer_max_rate_mbit may cap the servers below the joiner's minimum rate (MIN_RATE): a joiner of
    such a job accepts half the cap (joiner_min_rate), and the capped server paces within a piece in slices of
    PACE_S at the cap, so that its joiner is never silent for timeout_s. 107 KB at 24 KiB/s with timeout_s 2 s:
    about 4.4 s (slices of PACE_BYTES would leave 2.7 s between two)."""
    seed = random.randrange(1 << 30)
    parts = _state(seed, 20_000)  # 107 KB in two frames of one piece each
    cap = 24 << 10
    assert transfer.joiner_min_rate(cap) == cap / 2 and transfer.joiner_min_rate(0) == transfer.MIN_RATE
    assert transfer.pace_slice_bytes(cap) == int(cap * transfer.PACE_S)
    assert transfer.pace_slice_bytes(0) == transfer.pace_slice_bytes(1e9) == transfer.PACE_BYTES
    assert transfer.pace_slice_bytes(1) == 1 << 10
    server = transfer.StateServer(SECRET, "job", 0, timeout_s=2, max_rate=cap)
    server.publish(3, parts, {"inner_step": 30})
    try:
        dst = [torch.zeros_like(p) for p in parts]
        t0 = time.monotonic()
        r = _fetch(dst, lambda: [(0, server.address)], timeout_s=2, give_up_s=30,
                   min_rate=transfer.joiner_min_rate(cap))
        took = time.monotonic() - t0
        assert r.failures == [], (r.failures, f"seed {seed}")
        assert all(torch.equal(a, b) for a, b in zip(dst, parts))
        total = sum(p.numel() * 4 for p in parts)
        assert took >= 0.8 * total / cap, took  # the cap held
    finally:
        server.close()


def test_the_running_digest_is_the_state_digest_whatever_order_the_pieces_came_in():
    """The joiner hashes the pieces while the next ones arrive: in order it gives state_digest without a second
    pass; a restart at byte 0 starts it over; a piece out of order leaves it behind, and the digest is then
    computed over the whole state, never wrong."""
    seed = random.randrange(1 << 30)
    parts = _state(seed, 50_000)
    views = [transfer._bytes_view(p) for p in parts]
    cuts = [(off, memoryview(views[i][s:e].numpy())) for off, i, s, e in
            transfer._pieces([v.numel() for v in views])]
    total = sum(v.numel() for v in views)
    want = transfer.state_digest(parts)
    orders = {"in order": cuts, "a restart at 0": cuts[: len(cuts) // 2] + cuts,
              "out of order": cuts[1:] + cuts[:1]}
    for what, order in orders.items():
        running = transfer._RunningDigest()
        try:
            for off, piece in order:
                running.add(off, piece)
            assert (running.upto == total) == (what != "out of order"), (what, running.upto, total, seed)
            assert running.digest(parts, total) == want, (what, seed)
        finally:
            running.close()
