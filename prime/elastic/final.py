"""The end of an elastic run: the members of the job's last outer step compare their final weights."""

from __future__ import annotations

import time
from typing import Callable, Optional

from prime.elastic.membership import Membership, Plan

__all__ = ["final_agreement"]


def final_agreement(membership: Membership, committed: Optional[Plan], publish: Callable[[str], None],
                    read: Callable[[int], Optional[str]], digest: str, timeout_s: float) -> tuple[list, list]:
    """Compares this node's final weights digest with the other members of the last committed outer step
    (`committed`: the newest outer step this node committed, None before the first).

    publish(digest) writes this node's (signed) record; read(node id) returns a
    member's digest or None. Waits for every member of the last commit that is still
    alive (a member that died, or left without a digest, is not waited for) up to
    timeout_s. Returns (ids holding the same digest, this node included; ids that
    differ), or (None, []) when this node is not a member of the job's newest committed outer step
    (evicted, and the job ended before it got back in): nothing to compare with. Call before the node
    leaves: a node that has left is no longer waited for."""
    m = membership
    latest = m.latest_committed()
    if committed is None or (latest is not None and int(latest["k"]) > committed.k):
        m.log("not a member of the job's last outer step: no final weights to compare", event="final")
        return None, []
    publish(digest)
    me = m.node_id
    same, differ = [me], []
    waiting = [i for i in committed.members if i != me]
    deadline = time.monotonic() + timeout_s
    while waiting and time.monotonic() < deadline:
        for i in list(waiting):
            got = read(i)
            if got is not None:
                (same if got == digest else differ).append(i)
                waiting.remove(i)
            elif m.gone(i):
                waiting.remove(i)  # died (or left without a digest) after the last commit
        if waiting:
            time.sleep(0.05)
    if waiting:
        m.log(f"final weights: no digest from node(s) {waiting} within {timeout_s:g} s", event="final",
              missing=waiting)
    return sorted(same), sorted(differ)
