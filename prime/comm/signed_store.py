"""Store records that only holders of the job secret can write.

Anyone who reaches a TCPStore can read, write and delete any key in it: the
store has no credentials. So PRIME signs every record it reads back:

    record = "ps1:" <64 hex: HMAC-SHA256(Kr, key | 0x00 | body)> ":" <body: JSON>
    Kr     = HMAC-SHA256(secret, "prime store records v1|" + job)

(The record starts with a letter so that the store's `add`, which parses the
value as an integer, fails on it and leaves it as it is: with a leading digit
`add` would replace it with a number.)

The MAC binds the record to its key (a record copied under another key, e.g.
an outcome of outer step k replayed as the one of k+1, fails) and, through
Kr, to the job id and the job secret. Records that need freshness carry it in
the body (a heartbeat's sequence number, an outer step number) and the reader
checks it. A record that fails the check is ignored: the reader treats the
key as unwritten and logs one warning per kind of key (not one per read).

Reads never wait for a key (read_now): a TCPStore `get` of a missing key blocks
until the client's timeout, and a stranger can delete a key between a `check`
that saw it and the `get` that follows. Reads of many keys (a heartbeat sweep,
an agreement's offers) take two round trips instead of one per key: a `check`
of them all and, when every one is there, a `multi_get` under a short timeout
(4 x the check's round trip, at least 0.25 s); a key deleted in between costs
that timeout, and then each key is read on its own as above.

HMAC and SHA-256 come from Python's hmac/hashlib, i.e. from OpenSSL.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import re
import secrets
import threading
import time
from datetime import timedelta
from typing import Any, Callable, Optional

from prime.comm import store_keys as keys

logger = logging.getLogger("prime.store")

_TAG = b"ps1:"
_MAC_HEX = 64
_INVALID = object()


class ForgedRecordsError(RuntimeError):
    """A first-writer-wins key holds nothing but forged records in all its slots: the store is under attack."""


def read_now(store, key: str) -> Optional[bytes]:
    """The bytes under `key`, or None when it is missing; never waits, whatever happens to the key meanwhile.

    One round trip: store.compare_set(key, X, X) with a fresh random sentinel X. On a missing key a
    compare_set whose expected value is not empty writes nothing and returns the expected value X (an
    empty expected value would create the key: X never is empty); on a present key it returns the value
    there, and writes X over it only when the value already is X, i.e. changes nothing. A stored value
    equal to X reads as missing: X is drawn per call (128 random bits) and is not a signed record.
    A check() followed by a get() is not safe: a get of a key deleted in between waits until the
    client's timeout (up to diloco.timeout_s)."""
    sentinel = b"prime-absent:" + secrets.token_hex(16).encode()
    got = store.compare_set(key, sentinel, sentinel)
    got = got.encode() if isinstance(got, str) else bytes(got)
    return None if got == sentinel else got


def read_counter(store, key: str) -> int:
    """The value of a counter that the store's `add` keeps, read without an `add`: an add on a value that is not
    a number (a stranger's) makes the server drop the connection, which would leave a reading thread blind for
    good. 0 when the key is missing or holds no number."""
    raw = read_now(store, key)
    try:
        return max(0, int(raw)) if raw is not None else 0
    except ValueError:
        return 0


BATCH_WAIT_MIN_S = 0.25
"""The shortest wait of a batched read (its multi_get) for keys that its check saw; 4 x the check's round
trip when that is longer. A key deleted in between costs this wait, then a read of each key on its own."""


def batched_reads(store) -> bool:
    """Whether read_many may read keys that a check saw in one multi_get: a TCPStore client with the libuv
    backend (under any PrefixStores), taken to mean a server with it too (torch's default since 2.4, and the
    stores PRIME hosts). That server answers a key deleted between the multi_get's wait and its read with an
    empty value; the older backend's server drops the connection there, so its clients read a key at a time."""
    import torch.distributed as dist

    while hasattr(store, "underlying_store"):
        store = store.underlying_store
    return isinstance(store, dist.TCPStore) and bool(getattr(store, "libuvBackend", False))


def read_many(store, ks: list[str], batched: bool) -> list[Optional[bytes]]:
    """read_now of every key: None for a missing one. With `batched` (see batched_reads) two round trips when
    every key is there (a check, then a multi_get that waits at most BATCH_WAIT_MIN_S or 4 x the check's
    round trip), else one per key. Never waits for a key for long, whatever happens to it meanwhile: a key
    deleted after the check makes the multi_get time out or read an empty value, and an empty value is never
    a record, so it reads as missing."""
    if batched and len(ks) > 1:
        t0 = time.monotonic()
        if store.check(ks):
            import torch.distributed as dist

            wait_s = max(BATCH_WAIT_MIN_S, 4 * (time.monotonic() - t0))
            before = store.timeout
            shorter = wait_s < before.total_seconds()
            if shorter:
                store.set_timeout(timedelta(seconds=wait_s))
            try:
                got = store.multi_get(ks)
            except dist.DistStoreError as e:  # a key went away after the check: the wait timed out
                logger.debug("a batched store read fell back to one read per key: %s", e)
            else:
                return [bytes(v) or None for v in got]
            finally:
                if shorter:
                    store.set_timeout(before)
    return [read_now(store, k) for k in ks]


def record_kind(key: str) -> str:
    """The kind of a key for warnings: its numbers replaced (b/12/a0/plan -> b/*/a*/plan)."""
    return re.sub(r"\d+", "*", key.split("#", 1)[0])


class SignedStore:
    """A store client whose records are signed under the job secret (see the module docstring).

    store:  a torch.distributed Store (TCPStore, PrefixStore, HashStore); not shared between threads
    secret: the job secret (bytes)
    job:    the job id the records are bound to
    warn:   called with one line per kind of rejected record (default: the logger)
    """

    def __init__(self, store, secret: bytes, job: str, warn: Optional[Callable[[str], None]] = None):
        if not secret:
            raise ValueError("SignedStore needs a non-empty secret")
        self.store = store
        self.job = job
        self._key = hmac.new(bytes(secret), b"prime store records v1|" + job.encode(), hashlib.sha256).digest()
        self._warn = warn or (lambda msg: logger.warning("%s", msg))
        self._batched = batched_reads(store)
        self._lock = threading.Lock()
        self._warned: set[str] = set()
        self.rejected: dict[str, int] = {}
        """Kind of key -> number of records ignored (forged, replayed, or signed with another secret)."""

    # -- the record format -----------------------------------------------------------------------

    def _mac(self, key: str, body: bytes) -> str:
        return hmac.new(self._key, key.encode() + b"\0" + body, hashlib.sha256).hexdigest()

    def seal(self, key: str, value: Any) -> str:
        """The signed record of `value` (JSON-serializable) under `key`."""
        body = json.dumps(value, sort_keys=True, separators=(",", ":")).encode()
        return f"{_TAG.decode()}{self._mac(key, body)}:{body.decode()}"

    def open(self, key: str, raw) -> Any:
        """The value of a record read from `key`, or _INVALID when it is not signed for this key and job."""
        if isinstance(raw, str):
            raw = raw.encode()
        n = len(_TAG)
        if not raw.startswith(_TAG) or len(raw) < n + _MAC_HEX + 1 or raw[n + _MAC_HEX:n + _MAC_HEX + 1] != b":":
            return _INVALID
        mac, body = raw[n:n + _MAC_HEX], raw[n + _MAC_HEX + 1:]
        try:
            if not hmac.compare_digest(mac.decode("ascii"), self._mac(key, body)):
                return _INVALID
            return json.loads(body)
        except (UnicodeDecodeError, ValueError):
            return _INVALID

    def reject(self, key: str, why: str = "not signed with the job secret (forged, or another secret)") -> None:
        """Counts an ignored record and warns once per kind of key."""
        kind = record_kind(key)
        with self._lock:
            self.rejected[kind] = self.rejected.get(kind, 0) + 1
            first = kind not in self._warned
            self._warned.add(kind)
        if first:
            self._warn(f"ignoring a store record under {key!r}: {why}; further ones of this kind "
                       f"({kind!r}) are ignored silently")

    # -- reads and writes ---------------------------------------------------------------------------

    def put(self, key: str, value: Any, landed: bool = False) -> None:
        """Writes the signed record of `value` under key.

        A TCPStore `set` is not answered: the record may reach the server after a read that another connection
        makes later, and a store that is gone shows only at this connection's next request. landed=True returns
        once the server holds the record (one more round trip on this connection, answered after the write)
        and raises when the store is gone: for a record that a reader elsewhere reads once, on the strength of
        something this node does next (its leave). Like every request of torch's store client, the round trip
        waits for a server that is frozen rather than gone (measured with torch 2.13: past its timeout)."""
        self.store.set(key, self.seal(key, value))
        if landed:
            self.store.check([key])

    def exists(self, key: str) -> bool:
        return self.store.check([key])

    def _raw(self, key: str):
        """The raw bytes under key, or None when it does not exist (read_now: never waits for the key)."""
        return read_now(self.store, key)

    def get(self, key: str) -> Any:
        """The value under key; None when the key is missing or its record is not validly signed (logged)."""
        raw = self._raw(key)
        if raw is None:
            return None
        v = self.open(key, raw)
        if v is _INVALID:
            self.reject(key)
            return None
        return v

    def raw_many(self, ks: list[str]) -> list:
        """The raw bytes under every key, None where missing (read_many: two round trips when all are there)."""
        return read_many(self.store, ks, self._batched)

    def get_many(self, ks: list[str]) -> list:
        """get() of every key (read_many: two round trips when all are there, none of which waits for long)."""
        out = []
        for k, raw in zip(ks, self.raw_many(ks)):
            if raw is None:
                out.append(None)
                continue
            v = self.open(k, raw)
            if v is _INVALID:
                self.reject(k)
                v = None
            out.append(v)
        return out

    def delete(self, key: str) -> None:
        self.store.delete_key(key)

    # -- first writer wins ---------------------------------------------------------------------------

    def first(self, key: str) -> Any:
        """The first validly signed record among the slots of a first-writer-wins key (None: none yet)."""
        for n in range(keys.MAX_SLOTS):
            slot = keys.decision_slot(key, n)
            raw = self._raw(slot)
            if raw is None:
                return None
            v = self.open(slot, raw)
            if v is not _INVALID:
                return v
            self.reject(slot)
        return None

    def set_first(self, key: str, value: Any) -> Any:
        """Writes value unless a valid record is there first; returns the record that won (ours or theirs).

        A forged record in a slot does not block: the next slot is tried. Raises
        ForgedRecordsError when every slot holds a forged record."""
        for n in range(keys.MAX_SLOTS):
            slot = keys.decision_slot(key, n)
            mine = self.seal(slot, value)
            got = self.store.compare_set(slot, "", mine)
            got = got.encode() if isinstance(got, str) else bytes(got)
            if got == mine.encode():
                return json.loads(json.dumps(value))  # the value as every reader will see it
            v = self.open(slot, got)
            if v is not _INVALID:
                return v
            self.reject(slot)
        raise ForgedRecordsError(f"every slot of store key {key!r} holds a forged record ({keys.MAX_SLOTS} of "
                                 "them): someone who is not part of the job writes to its store")

    def replace(self, key: str, expected_raw, value: Any) -> bool:
        """compare_set from the exact bytes read (None: the key was missing) to a signed value; True if it took."""
        mine = self.seal(key, value)
        got = self.store.compare_set(key, b"" if expected_raw is None else expected_raw, mine)
        got = got.encode() if isinstance(got, str) else bytes(got)
        return got == mine.encode()

    def get_raw_and_value(self, key: str):
        """(raw bytes or None, value or None): for replace()."""
        raw = self._raw(key)
        if raw is None:
            return None, None
        v = self.open(key, raw)
        if v is _INVALID:
            self.reject(key)
            return raw, None
        return raw, v


class SignedKV:
    """Per-writer records over a SignedStore, for code written against a store's set/get.

    set(key, text) writes a signed record; get(key) waits until `key` holds a
    validly signed record and returns its text as bytes (as Store.get does).
    A forged record is ignored (logged once per kind) and the wait goes on, so
    a stranger can delay the reader until `timeout_s` but never feed it a value.
    """

    def __init__(self, records: SignedStore, timeout_s: float, poll_s: float = 0.02):
        self.records, self.timeout_s, self.poll_s = records, timeout_s, poll_s

    def set(self, key: str, text: str) -> None:
        self.records.put(key, text)

    def get(self, key: str) -> bytes:
        deadline = time.monotonic() + self.timeout_s
        while True:
            v = self.records.get(key)
            if isinstance(v, str):
                return v.encode()
            if v is not None:
                self.records.reject(key, "not a text record")
            if time.monotonic() >= deadline:
                raise TimeoutError(f"timed out after {self.timeout_s:g} s waiting for a validly signed record "
                                   f"under store key {key!r} (missing, or only forged ones)")
            time.sleep(self.poll_s)
