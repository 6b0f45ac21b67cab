"""Every key PRIME keeps in the job's TCPStore, in one place.

Two families, each under its own prefix (the caller's PrefixStore adds the
job's: ``prime/<run_id>/`` for the trainer):

Ring rendezvous (prime.comm.rendezvous), under ``prime_ring/<job_id>/``:

    joined             counter: catches a job id used twice (unsigned: a stranger can only stop the ring)
    secret             the ring secret, only when rank 0 drew one (one-host jobs only)
    addr/<rank>        signed: host:port of the rank's ring listener
    links/<rank>       signed: what the rank measured of its links (round trips, known rates)
    plan               signed by rank 0: the merged link table and the ring order every rank uses
    ready/<rank>       signed: the rank formed its links
    failed/<rank>      signed: why the rank gave up forming the ring
    failures           counter: how many ranks wrote failed/<rank> (unsigned: a stranger can only make the
                       others read those records)

Elastic membership (prime.elastic.membership), under ``elastic/`` of the job: who founded which launch
(prime.elastic.launch), signed for the run id,

    secret                  the job secret when none is configured (one-host jobs only)
    launch/current          signed by node rank 0: the name of the launch it founded last
    launch/asks             counter: ask indices (unsigned: a stranger can only make members read more)
    launch/ask/<i>          signed: a process's fresh nonce, asking for the live launch's name
    launch/for/<nonce>      signed by a member of the live launch: its name

and the records of one launch, under ``elastic/launch/<name>/``, signed for ``<run_id>/<name>``:

    genesis/<r>             signed, first writer wins: claim of initial node r
    joiners                 counter: joiner ids are initial_nodes, initial_nodes + 1, ... (unsigned: ids only)
    hb/<id>                 signed heartbeat {node, seq, left}: liveness is a valid record whose seq grew
    addr/<id>               signed: host:port of the node's state server (live recovery)
    ready/<id>              signed join offer: the node holds the state after outer step s
    b/<k>/arrive/<id>       signed: node id finished the inner steps before outer step k
    b/<k>/a<a>/plan         signed, first writer wins: who takes part in attempt a of outer step k
    b/<k>/a<a>/result/<id>  signed: how the all-reduce of that attempt went on node id
    b/<k>/a<a>/outcome      signed, first writer wins: commit, retry or give up
    members                 signed: the newest committed outer step and its members (for joiners)
    slot/<s>                signed: data position of data slot s after the newest outer step
    ended                   signed: the launch committed its last outer step (for a joiner that starts later)
    ring/<k>/<a>/...        the ring rendezvous of attempt a of outer step k (keys above)

"First writer wins" keys are written with compare_set. A record already
there that is not validly signed (a stranger wrote first) does not block the
decision: the writers move on to the key's next slot (``<key>#1``, ...), and
readers take the first slot that holds a valid record (decision_slot).

The trainer (prime.trainer), under the job's prefix, signed under the job
secret for the job ``trainer/<run_id>``:

    trainer/secret             the job secret when none is configured (one-host jobs only)
    ckpt/<launch>/r<n>/node<r> signed: node r's offer in round n of the resume agreement of this launch
    final/<g>/<r>              signed: the digest of node r's final weights (local rank g); an elastic
                               job's under final/<launch>/<g>/<id>
    finished/<r>/<g>           signed: process g of node r is done with the store
    host/<r>/<g>               signed: the host process g of node r runs on (the memory plan counts them)
    plan/<r>                   signed: whether node r's memory plan fits ("ok" or why not)
    out/<launch>/g<g>/<name>/n<r>  signed: whether node r's all-reduce <name> on ring g worked (prime.outcomes)
    out/<launch>/g<g>/<name>/d     signed, first writer wins: whether every node applies it
"""

from __future__ import annotations

# -- ring rendezvous ---------------------------------------------------------------------------------


def ring_namespace(job_id: str) -> str:
    """The key prefix of the ring named job_id."""
    return f"prime_ring/{job_id}"


def ring_joined(ns: str) -> str:
    return f"{ns}/joined"


def ring_secret(ns: str) -> str:
    return f"{ns}/secret"


def ring_addr(ns: str, rank: int) -> str:
    return f"{ns}/addr/{rank}"


def ring_links(ns: str, rank: int) -> str:
    return f"{ns}/links/{rank}"


def ring_plan(ns: str) -> str:
    return f"{ns}/plan"


def ring_ready(ns: str, rank: int) -> str:
    return f"{ns}/ready/{rank}"


def ring_failed(ns: str, rank: int) -> str:
    return f"{ns}/failed/{rank}"


def ring_failures(ns: str) -> str:
    return f"{ns}/failures"


# -- elastic membership ------------------------------------------------------------------------------

ELASTIC_PREFIX = "elastic"
"""The membership's keys live under <job prefix>/elastic."""
SECRET = "secret"
JOINERS = "joiners"
COMMITTED = "members"


LAUNCH_CURRENT = "launch/current"
"""The launch rank 0 founded last (a hint: whether a launch of this run may be live; prime.elastic.launch)."""
LAUNCH_ASKS = "launch/asks"
"""The counter that hands out ask indices."""


LAUNCH_ENDED = "ended"
"""Under a launch's prefix: it committed its last outer step (prime.elastic.launch)."""


def launch_prefix(name: str) -> str:
    """Where every other record of launch `name` lives (under the elastic prefix)."""
    return f"launch/{name}"


def launch_ask(i: int) -> str:
    return f"launch/ask/{i}"


def launch_answer(nonce: str) -> str:
    """A member's answer to the ask that carried `nonce`: the launch's name."""
    return f"launch/for/{nonce}"


def genesis(rank: int) -> str:
    return f"genesis/{rank}"


def heartbeat(node: int) -> str:
    return f"hb/{node}"


def state_addr(node: int, local_rank: int = 0) -> str:
    """The state server of local rank g of a node (it serves shard g of the outer state)."""
    return f"addr/{node}" if local_rank == 0 else f"addr/{node}/{local_rank}"


def join_offer(node: int) -> str:
    return f"ready/{node}"


def arrival(k: int, node: int) -> str:
    return f"b/{k}/arrive/{node}"


def plan(k: int, attempt: int) -> str:
    return f"b/{k}/a{attempt}/plan"


def result(k: int, attempt: int, node: int) -> str:
    return f"b/{k}/a{attempt}/result/{node}"


def outcome(k: int, attempt: int) -> str:
    return f"b/{k}/a{attempt}/outcome"


def slot(s: int) -> str:
    return f"slot/{s}"


def ring_prefix(k: int, attempt: int, local_rank: int = 0) -> str:
    """The PrefixStore under which ring g (local rank g of every member) of attempt `attempt` of outer step k
    meets."""
    return f"ring/{k}/{attempt}" if local_rank == 0 else f"ring/{k}/{attempt}/{local_rank}"


def ring_job_id(run_id: str, k: int, attempt: int, local_rank: int = 0) -> str:
    """The job id of that ring (binds its signed records to the outer step, attempt and local rank)."""
    return f"{run_id}/elastic/{k}/{attempt}" if local_rank == 0 else f"{run_id}/elastic/{k}/{attempt}/{local_rank}"


def elastic_ring_keys(run_id: str, k: int, attempt: int, rank: int, local_rank: int = 0) -> list[str]:
    """The keys a member of rank `rank` writes when forming that ring (as seen through the membership's store)."""
    ns = f"{ring_prefix(k, attempt, local_rank)}/{ring_namespace(ring_job_id(run_id, k, attempt, local_rank))}"
    return [ring_addr(ns, rank), ring_ready(ns, rank), ring_failed(ns, rank), ring_failures(ns), ring_joined(ns)]


# -- first-writer-wins slots --------------------------------------------------------------------------

MAX_SLOTS = 16
"""How many forged records a first-writer-wins key tolerates before the writers give up."""


def decision_slot(key: str, n: int) -> str:
    """Slot n of a first-writer-wins key: the key itself, then key#1, key#2, ..."""
    return key if n == 0 else f"{key}#{n}"


# -- the trainer ---------------------------------------------------------------------------------------

TRAINER_NS = "trainer"
"""Namespace of the trainer's secret (rendezvous.shared_secret adds /secret)."""


def resume_offer(rnd: int, node: int, scope: str = "") -> str:
    return f"ckpt/{scope}/r{rnd}/node{node}" if scope else f"ckpt/r{rnd}/node{node}"


def final_digest(local_rank: int, node: int, scope: str = "") -> str:
    """scope: an elastic launch's name (its node ids repeat in every launch of the run)."""
    return f"final/{scope}/{local_rank}/{node}" if scope else f"final/{local_rank}/{node}"


def finished(node: int, local_rank: int) -> str:
    return f"finished/{node}/{local_rank}"


def host_of(node: int, local_rank: int) -> str:
    return f"host/{node}/{local_rank}"


def memory_plan(node: int) -> str:
    return f"plan/{node}"


def outcome_report(scope: str, name: str, node: int) -> str:
    """Node `node`'s outcome of all-reduce `name` (prime.outcomes; scope: the launch and the ring)."""
    return f"out/{scope}/{name}/n{node}"


def outcome_decision(scope: str, name: str) -> str:
    """Whether every node applies all-reduce `name` (first writer wins)."""
    return f"out/{scope}/{name}/d"
