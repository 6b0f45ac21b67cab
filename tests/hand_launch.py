"""A launch of an elastic job founded by hand, for tests that write its members' records themselves.

    with HandLaunch(port, "m", b"m-secret") as launch:
        launch.records.put("hb/0", {...})      # signed for the launch, under its prefix
        joiner.register()                      # its ask is answered with launch.name

Real members answer asks on their heartbeat-watch thread (prime.elastic.launch.LaunchDoor); here a thread of
the test does, until close().

A TCPStore `set` does not wait for the server's answer, so a read on another connection (the node's under test)
may reach the server first. Every record written here is waited for (a round trip on the writing connection
after it), so that a test's next read sees it.
"""

from __future__ import annotations

import threading
from datetime import timedelta

from prime.comm import store_keys as keys


def client(port: int, prefix: str):
    import torch.distributed as dist

    return dist.PrefixStore(prefix, dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30)))


def launch_client(port: int, membership):
    """A store client under the prefix of `membership`'s launch (what a stranger writes to)."""
    return client(port, f"{membership.run_id}/elastic/{keys.launch_prefix(membership.launch)}")


def landed_set(store, key: str, value) -> None:
    """store.set, returning once the server holds the value (the next request on the same connection is
    answered only after it)."""
    store.set(key, value)
    store.check([key])


def signed(port: int, prefix: str, secret: bytes, job: str):
    """A SignedStore under `prefix` whose put returns once the server holds the record (landed_set)."""
    from prime.comm.signed_store import SignedStore

    class Landed(SignedStore):
        def put(self, key, value, landed=True):
            super().put(key, value, landed=True)

    return Landed(client(port, prefix), secret, job)


class HandLaunch:
    def __init__(self, port: int, run_id: str, secret: bytes):
        import secrets

        from prime.comm.signed_store import SignedStore
        from prime.elastic.launch import LaunchDoor, launch_job

        self.name = secrets.token_hex(8)
        signed(port, f"{run_id}/elastic", secret, run_id).put(keys.LAUNCH_CURRENT, {"launch": self.name})
        self.records = signed(port, f"{run_id}/elastic/{keys.launch_prefix(self.name)}", secret,
                              launch_job(run_id, self.name))
        door = LaunchDoor(SignedStore(client(port, f"{run_id}/elastic"), secret, run_id), self.name)
        self._stop = threading.Event()

        def answer():
            while not self._stop.wait(0.02):
                door.answer()

        self._thread = threading.Thread(target=answer, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def __enter__(self) -> "HandLaunch":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
