"""Elastic DiLoCo: nodes join and leave mid-training (docs/elastic.md).

    membership = prime.elastic.Membership(store_factory, node_rank=r, initial_nodes=N, run_id="demo")
    sync = prime.elastic.ElasticSync(membership)        # registers the node, serves its state to joiners
    diloco = prime.DiLoCo(model, opt, sync, inner_steps=100)
    if sync.is_joiner:
        result = diloco.sync()          # download the state from a live peer, admitted at the next outer step
    else:
        sync.start(diloco.outer_step, diloco.inner_step)
    for step in ...:
        ...; result = diloco.step()     # outer steps with whoever is alive
        if result.did_sync and result.details.rejoined: ...   # evicted and back: continue from result.inner_step
    diloco.close(); sync.close()        # leave cleanly: the others drop this node at once

membership.py: registration, heartbeats and the per-outer-step decisions in the
TCPStore; launch.py: each launch's fresh name, under which its records live; transfer.py: the authenticated state download; node.py: the
ElasticSync (the average with membership changes); join.py: its joins (the
download and the admission); store.py: a standalone store host.
"""

from prime.elastic.membership import Evicted, JobFinished, JoinError, Membership, MembershipError, Outcome, Plan
from prime.elastic.node import ElasticReport, ElasticSync, JoinInfo
from prime.elastic.transfer import FetchResult, StateServer, TransferError, fetch_state, state_digest

__all__ = [
    "ElasticSync",
    "ElasticReport",
    "JoinInfo",
    "Membership",
    "Plan",
    "Outcome",
    "Evicted",
    "JobFinished",
    "JoinError",
    "MembershipError",
    "StateServer",
    "fetch_state",
    "FetchResult",
    "TransferError",
    "state_digest",
]
