"""Elastic DiLoCo: nodes join and leave mid-training (docs/elastic.md).

    membership = prime.elastic.Membership(store_factory, node_rank=r, initial_nodes=N, run_id="demo")
    diloco = prime.elastic.ElasticDiLoCo(model, opt, membership, inner_steps=100)
    if diloco.is_joiner:
        info = diloco.join()            # download the state from a live peer, admitted at the next outer step
    else:
        diloco.start()
    for step in ...:
        ...; result = diloco.step()     # outer steps with whoever is alive
        if getattr(result, "rejoined", None): ...   # evicted and back: continue from result.rejoined.step
    diloco.close()                      # leave cleanly: the others drop this node at once

membership.py: registration, heartbeats and the per-outer-step decisions in the
TCPStore; transfer.py: the authenticated state download; node.py: the outer
step with membership changes; store.py: a standalone store host.
"""

from prime.elastic.membership import Evicted, JobFinished, JoinError, Membership, MembershipError, Outcome, Plan
from prime.elastic.node import ElasticDiLoCo, ElasticStepResult, JoinInfo
from prime.elastic.transfer import FetchResult, StateServer, TransferError, fetch_state, state_digest

__all__ = [
    "ElasticDiLoCo",
    "ElasticStepResult",
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
