"""Attacks on the ring's links (docs/wire-format.md, "Authentication").

A man in the middle on loopback: a Python TCP proxy between rank 0 and rank 1 that
relays the handshake untouched and then does the best it can against the frame
format it sees (version 1, the CRC32C frames of before, or version 2, the tagged
frames): it rewrites a payload byte and recomputes the checksums, replays an
earlier frame, or swaps two. Every rank must raise CommError, with its tensor
unchanged (the sender of an altered all-gather frame may instead finish first, with
the true result). And a hundred idle connections to a rank's port must not keep a ring
from forming. Ranks are the session's pool of processes (tests/conftest.py).
"""

from __future__ import annotations

import hashlib
import hmac
import random
import select
import socket
import struct
import threading
import time
from datetime import timedelta

import pytest
import torch

prime = pytest.importorskip("prime")
from prime import _extension  # noqa: E402

pytestmark = pytest.mark.skipif(not _extension.available(), reason="prime._C is not built")

SEED = random.SystemRandom().randrange(1 << 30)
N = 60000  # values: with 16 KiB segments, several segments per chunk and phase
SEGMENT_BYTES = 1 << 14
HEADER = 64
TAG = 16
HELLO_C = 72 + 32  # the client's hello and its MAC: what precedes the first frame


@pytest.fixture(autouse=True)
def _print_seed():
    print(f"test_ring_security SEED={SEED}")


def _note() -> str:
    return f"(SEED={SEED})"


def _secret(seed: int) -> bytes:
    """The job secret (the ranks' processes draw their own SEED at import: pass it on)."""
    return b"test-ring-security-%d" % seed


def make_input(seed: int, rank: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1009 + rank)
    return torch.randn(n, generator=g)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


# ---------------------------------------------------------------------------
# primitives


def _hkdf(ikm: bytes, salt: bytes, info: bytes, length: int) -> bytes:
    """RFC 5869, written from the RFC with Python's hmac."""
    prk = hmac.new(salt or bytes(32), ikm, hashlib.sha256).digest()
    okm, block = b"", b""
    for i in range(1, -(-length // 32) + 1):
        block = hmac.new(prk, block + info + bytes([i]), hashlib.sha256).digest()
        okm += block
    return okm[:length]


def test_hkdf_matches_rfc5869_and_a_python_reference():
    C = _extension.require()
    assert "OpenSSL" in C._ring_libcrypto()
    # RFC 5869 A.1
    okm = C._ring_hkdf_sha256(bytes([0x0B] * 22), bytes(range(13)), bytes(range(0xF0, 0xFA)), 42)
    assert okm.hex() == ("3cb25f25faacd57a90434f64d0362f2a2d2d0a90cf1a5a4c5db02d56ecc4c5bf"
                         "34007208d5b887185865")
    rng = random.Random(SEED)
    for _ in range(20):
        ikm, salt, info = (rng.randbytes(rng.randrange(0, 100)) for _ in range(3))
        length = rng.randrange(1, 200)
        assert C._ring_hkdf_sha256(ikm, salt, info, length) == _hkdf(ikm, salt, info, length), _note()


# ---------------------------------------------------------------------------
# the man in the middle


def _recv_exact(s: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = s.recv(n - len(out))
        if not chunk:
            raise EOFError
        out += chunk
    return out


class FrameProxy:
    """Listens on 127.0.0.1, connects each client to `target`, relays the handshake and
    the return path untouched, and attacks the client's frames once (`attack`):

      tamper   flip a byte in the middle of the first data frame of `phase`; a
               version-1 frame gets its payload and header CRC32C recomputed
      replay   send an earlier data frame of `phase` again in place of the next one
               (version 1: its payload under the current header, CRCs recomputed;
               version 2: the whole frame as it was, tag included)
      reorder  swap two consecutive data frames of `phase` (version 1: their
               payloads, CRCs recomputed; version 2: the whole frames)
    """

    def __init__(self, target: str, attack: str, phase: int):
        import prime._C as C

        self._crc = lambda b: C._ring_crc32c(b, False)
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self.attack, self.phase = attack, phase
        self.attacked = False
        self.versions = set()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._sockets = [self._listener]
        self._threads = []
        self._spawn(self._accept_loop)

    def _spawn(self, fn, *args):
        t = threading.Thread(target=fn, args=args, daemon=True)
        t.start()
        self._threads.append(t)

    def close(self):
        for s in self._sockets:
            try:  # shutdown wakes a thread blocked in accept() or recv() on it; close() alone does not on Linux
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            try:
                s.close()
            except OSError:
                pass
        for t in self._threads:
            t.join(5)

    def _accept_loop(self):
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.target)
            self._sockets += [client, server]
            self._spawn(self._pump, server, client)  # the handshake's server side, the return path
            self._spawn(self._intercept, client, server)

    @staticmethod
    def _pump(src, dst):
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def _read_frame(self, src):
        header = bytearray(_recv_exact(src, HEADER))
        version = struct.unpack_from("<H", header, 4)[0]
        self.versions.add(version)
        length = struct.unpack_from("<I", header, 12)[0]
        rest = _recv_exact(src, length + (TAG if version >= 2 else 0))
        return header, bytearray(rest[:length]), rest[length:]

    def _reseal_v1(self, header, payload):
        """What an attacker does to a version-1 frame he changed: recompute its CRC32Cs."""
        if struct.unpack_from("<H", header, 8)[0] & 1:  # the payload checksum flag
            struct.pack_into("<I", header, 44, self._crc(bytes(payload)))
        struct.pack_into("<I", header, 60, self._crc(bytes(header[:60])))

    def _target(self, header) -> bool:
        return header[6] == 1 and header[7] == self.phase and not self.attacked

    def _intercept(self, src, dst):
        try:
            dst.sendall(_recv_exact(src, HELLO_C))  # the handshake, untouched
            held = None  # reorder: a frame waiting for its successor
            previous = None  # replay: the last data frame of the phase
            while True:
                header, payload, tag = self._read_frame(src)
                version = struct.unpack_from("<H", header, 4)[0]
                out = [(header, payload, tag)]
                if self._target(header) and len(payload) > 0:
                    if self.attack == "tamper":
                        payload[len(payload) // 2] ^= 0x01
                        if version == 1:
                            self._reseal_v1(header, payload)
                        self.attacked = True
                    elif self.attack == "replay":
                        if previous is not None and len(previous[1]) == len(payload):
                            if version == 1:
                                payload[:] = previous[1]
                                self._reseal_v1(header, payload)
                            else:
                                out = [previous]
                            self.attacked = True
                        previous = (bytearray(header), bytearray(payload), tag)
                    elif self.attack == "reorder":
                        if held is None:
                            held, out = (header, payload, tag), []
                        elif len(held[1]) == len(payload):
                            if version == 1:
                                held[1][:], payload[:] = bytes(payload), bytes(held[1])
                                self._reseal_v1(held[0], held[1])
                                self._reseal_v1(header, payload)
                                out = [held, (header, payload, tag)]
                            else:
                                out = [(header, payload, tag), held]
                            held = None
                            self.attacked = True
                        else:  # lengths differ: let the held one go, hold this one
                            out, held = [held], (header, payload, tag)
                for h, p, t in out:
                    dst.sendall(bytes(h) + bytes(p) + bytes(t))
        except (EOFError, OSError):
            pass
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass


def _rank_behind_proxy(ctx, seed, codec, encrypt, schedule):
    """Rank 0 builds its ring only once the test has put the proxy in place."""
    from prime.comm import CommError

    if ctx.rank == 0:
        ctx.store.wait([f"{ctx.job}/go"], timedelta(seconds=60))
    x = make_input(seed, ctx.rank, N)
    keep = x.clone()
    kwargs = dict(secret=_secret(seed), job_id=f"{ctx.job}/ring", timeout=20, segment_bytes=SEGMENT_BYTES,
                  schedule=schedule)
    if encrypt:
        kwargs["encrypt"] = True
    with ctx.ring(**kwargs) as ring:
        try:
            ring.all_reduce(x, op="avg", codec=codec).wait()
            return {"raised": False, "y": x}
        except CommError as e:
            return {"raised": True, "kind": e.kind, "peer": e.peer, "origin": e.origin, "step": e.step,
                    "phase": e.phase, "message": str(e), "intact": bool(torch.equal(_bits(x), _bits(keep)))}


def _address(store, job_id: str, rank: int, seed: int) -> str:
    """`rank`'s published address, read through the signed view the ranks use."""
    from prime.comm import rendezvous

    ns = rendezvous.namespace(job_id)
    return str(rendezvous.records(store, _secret(seed), ns).get(f"{ns}/addr/{rank}"))


def _divert(store, job_id: str, rank: int, address: str, seed: int) -> None:
    """Points the ring's record of `rank`'s address at `address`, signed as the rank
    itself publishes it (prime/comm/rendezvous.py): the test knows the job's secret,
    so it plays an attacker on the path, not one who only reaches the store (whose
    forged records the ranks ignore: tests/test_store_security.py)."""
    from prime.comm import rendezvous

    ns = rendezvous.namespace(job_id)
    rendezvous.records(store, _secret(seed), ns).put(f"{ns}/addr/{rank}", address)


def _wait_key(ranks, job, world, key, timeout=60.0):
    """Waits for a store key the ranks publish; on timeout, the ranks' own errors."""
    end = time.monotonic() + timeout
    while not ranks.store.check([key]):
        if time.monotonic() > end:
            ranks.gather(job, world, timeout=5)  # raises with the ranks' tracebacks
            raise AssertionError(f"no rank published {key} within {timeout} s")
        time.sleep(0.05)


def _run_with_proxy(ranks, attack, phase, codec, encrypt=False, world=3, schedule="ring"):
    """Every connection to rank 1 goes through the proxy: in the ring schedule only rank 0
    sends it data (ranks 0 -> 1 -> 2 -> 0), in the direct schedule ranks 0 and 2 do."""
    job = ranks.start(_rank_behind_proxy, SEED, codec, encrypt, schedule, world_size=world)
    key = f"prime_ring/{job}/ring/addr/1"
    _wait_key(ranks, job, world, key)
    proxy = FrameProxy(_address(ranks.store, f"{job}/ring", 1, SEED), attack, phase)
    try:
        _divert(ranks.store, f"{job}/ring", 1, proxy.address, SEED)
        ranks.store.set(f"{job}/go", "1")
        results = ranks.gather(job, world, timeout=120)
    finally:
        proxy.close()
    return proxy, results


def _assert_every_rank_failed_intact(proxy, results, codec, world=3, may_complete=(), senders=(0,)):
    """Every rank raised with its tensor unchanged, except that a rank in may_complete
    may have finished first with the right result: the sender of an altered all-gather
    frame (in the direct schedule any rank but the receiver) already has everything it
    needs (the inherent limit of docs/ring.md, "Failure behaviour"); it must then hold
    the true average, not a forged one. senders: the ranks whose frames the proxy sees."""
    assert proxy.attacked, f"the proxy found no frame to attack (frame versions seen: {proxy.versions}) {_note()}"
    ref = sum(make_input(SEED, r, N).double() for r in range(world)) / world
    for r in range(world):
        res = results[r]
        if not res["raised"] and r in may_complete:
            rel = float((res["y"].double() - ref).norm() / ref.norm())
            assert rel < (0.03 if codec == "int8" else 1e-6), f"rank {r} completed with a wrong result {_note()}"
            continue
        assert res["raised"], f"rank {r} completed the all-reduce although a frame was {proxy.attack}ed {_note()}"
        assert res["intact"], f"rank {r}: the tensor changed although the all-reduce failed {_note()}"
        assert "authentication failed" in res["message"], f"rank {r}: {res['message']}"
    detector = results[1]  # the receiving end of the attacked link
    assert detector["kind"] == "corrupt_frame" and detector["peer"] in senders, detector
    assert " step " in detector["message"], detector["message"]
    for r in (0, 2):
        assert not results[r]["raised"] or results[r]["origin"] == 1, results[r]


@pytest.mark.parametrize("codec", ["int8", "none"])
@pytest.mark.parametrize("phase", [1, 2], ids=["reduce-scatter", "all-gather"])
def test_rewritten_frame_with_recomputed_checksums_fails_every_rank(ranks, phase, codec):
    proxy, results = _run_with_proxy(ranks, "tamper", phase, codec)
    _assert_every_rank_failed_intact(proxy, results, codec, may_complete=(0,) if phase == 2 else ())


@pytest.mark.parametrize("attack", ["tamper", "replay", "reorder"])
@pytest.mark.parametrize("phase", [1, 2], ids=["reduce-scatter", "all-gather"])
def test_attacked_frame_fails_the_direct_schedule(ranks, attack, phase):
    """The direct schedule: ranks 0 and 2 both send to rank 1 through the proxy."""
    proxy, results = _run_with_proxy(ranks, attack, phase, "int8", schedule="direct")
    _assert_every_rank_failed_intact(proxy, results, "int8", may_complete=(0, 2) if phase == 2 else (),
                                     senders=(0, 2))


def test_rewritten_frame_is_caught_with_encryption_on(ranks):
    proxy, results = _run_with_proxy(ranks, "tamper", 2, "int8", encrypt=True)
    _assert_every_rank_failed_intact(proxy, results, "int8", may_complete=(0,))


@pytest.mark.parametrize("attack", ["replay", "reorder"])
def test_replayed_or_reordered_frame_fails_every_rank(ranks, attack):
    proxy, results = _run_with_proxy(ranks, attack, 1, "int8")
    _assert_every_rank_failed_intact(proxy, results, "int8")
    assert "replayed, dropped or reordered" in results[1]["message"], results[1]["message"]


# ---------------------------------------------------------------------------
# encryption is a setting every rank shares


def _rank_encrypt(ctx, seed, flags):
    from prime.comm import CommError

    x = make_input(seed, ctx.rank, N)
    try:
        with ctx.ring(secret=_secret(seed), timeout=10, encrypt=flags[ctx.rank]) as ring:
            ring.all_reduce(x, op="sum", codec="none").wait()
            return x
    except CommError as e:
        return str(e)


def test_encrypted_ring_gives_the_same_bits_and_a_mixed_one_is_refused(ranks):
    plain = ranks.run(_rank_encrypt, SEED, [False, False], world_size=2)
    sealed = ranks.run(_rank_encrypt, SEED, [True, True], world_size=2)
    for r in range(2):
        assert torch.equal(_bits(plain[r]), _bits(sealed[r])), _note()
    mixed = ranks.run(_rank_encrypt, SEED, [True, False], world_size=2)
    assert any(isinstance(m, str) and "configuration differs" in m and "encryption" in m for m in mixed), mixed


# ---------------------------------------------------------------------------
# idle connections while the ring forms


def _rank_late(ctx, seed, n):
    if ctx.rank == 1:
        ctx.store.wait([f"{ctx.job}/go"], timedelta(seconds=60))
    x = make_input(seed, ctx.rank, n)
    with ctx.ring(secret=_secret(seed), job_id=f"{ctx.job}/ring", timeout=20) as ring:
        ring.all_reduce(x, op="sum", codec="none").wait()
        return {"y": x, "rejected": len(ring.rejected_connections)}


def _dribble(sockets, stop: threading.Event):
    """Sends one byte of a plausible hello every half second on each socket."""
    i = 0
    while not stop.wait(0.5):
        for s in sockets:
            try:
                s.send(b"PRIMEHS1"[i % 8 : i % 8 + 1])
            except OSError:
                pass
        i += 1


def test_hundred_idle_connections_do_not_stop_the_ring(ranks):
    """100 connections to rank 0's port before its neighbour comes: 80 silent, 20 that
    dribble a byte every half second (each would keep a serial handshake busy)."""
    world, n = 2, 100003
    job = ranks.start(_rank_late, SEED, n, world_size=world)
    key = f"prime_ring/{job}/ring/addr/0"
    _wait_key(ranks, job, world, key)
    host, port = _address(ranks.store, f"{job}/ring", 0, SEED).rsplit(":", 1)
    idle = []
    stop = threading.Event()
    try:
        for _ in range(100):
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex((host, int(port)))
            idle.append(s)
        # Wait (up to 5 s) until the kernel has completed them, so they all queue
        # before the real neighbour; they then stay silent.
        end = time.monotonic() + 5
        waiting = list(idle)
        while waiting and time.monotonic() < end:
            _, writable, _ = select.select([], waiting, [], 0.2)
            waiting = [s for s in waiting if s not in writable]
        threading.Thread(target=_dribble, args=(idle[:20], stop), daemon=True).start()
        ranks.store.set(f"{job}/go", "1")
        results = ranks.gather(job, world, timeout=120)
    finally:
        stop.set()
        for s in idle:
            s.close()
    ref = sum(make_input(SEED, r, n).double() for r in range(world))
    bound = world * 2.0**-24 * sum(make_input(SEED, r, n).double().abs() for r in range(world))
    for r in range(world):
        y = results[r]["y"].double()
        assert ((y - ref).abs() <= bound).all(), f"rank {r}: result off the float64 sum {_note()}"
    assert torch.equal(_bits(results[0]["y"]), _bits(results[1]["y"]))
    assert results[0]["rejected"] >= 1  # the idle connections were dropped and listed
