"""A stranger who reaches the job's TCPStore cannot steer the job (docs/security.md).

The store has no credentials: anyone who reaches its port can read, write,
`add` to and delete any key. Every record PRIME reads back is signed under the
job secret and bound to its key and job (prime.comm.signed_store), so a
stranger's writes are ignored. Each test below plays one attack against real
in-process TCPStores and Memberships or Rings (threads, loopback), and failed
against the code before signed records (commit a8a1120):

- heartbeat `add`: one add of 2^40 on a live node's counter marked it as left;
- outcome first: a `give_up` outcome written before the nodes decided stopped them;
- plan first: a plan without node 1 evicted it;
- address rewrite: a rank dialled the address a stranger wrote over its neighbour's.
"""

import json
import random
import socket
import threading
import time
from dataclasses import asdict
from datetime import timedelta

import pytest
import torch
from conftest import needs_ring
from hand_launch import HandLaunch, landed_set, launch_client

SECRET = b"store-security-secret"
HB_INTERVAL, HB_TIMEOUT = 0.1, 1.5


def _tcp_store():
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))


def _client(port: int, prefix: str):
    import torch.distributed as dist

    return dist.PrefixStore(prefix, dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30)))


def _stranger_add(stranger, port: int, membership, key: str, amount: int):
    """A stranger's add to `key`. The store refuses to add to a signed record (it is not a number) and
    drops the connection; that happens whenever the node's beat lands first (even between a delete and
    the add), so the refused try still counts as an attack, and the stranger reconnects."""
    try:
        stranger.add(key, amount)
    except Exception:
        return launch_client(port, membership)
    return stranger


def _membership(port: int, rank: int, initial: int, run_id: str, **kw):
    from prime.elastic import Membership

    kw = dict(dict(heartbeat_interval_s=HB_INTERVAL, heartbeat_timeout_s=HB_TIMEOUT, barrier_timeout_s=20,
                   report_timeout_s=20), **kw)
    return Membership(lambda: _client(port, f"{run_id}/elastic"), node_rank=rank, initial_nodes=initial,
                      run_id=run_id, secret=SECRET, **kw)


def _register_all(port: int, n: int, run_id: str, **kw) -> list:
    ms = [_membership(port, r, n, run_id, **kw) for r in range(n)]
    out, errs = [None] * n, []

    def reg(i):
        try:
            ms[i].register(start_timeout_s=20)
        except BaseException as e:  # surfaced below
            errs.append(e)

    ts = [threading.Thread(target=reg, args=(i,), daemon=True) for i in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert not errs, errs
    return ms


def _outer_step(ms: list, k: int, step: int) -> list:
    """Outer step k on every membership in threads, with an all-reduce that always works; returns the
    committed (plan, outcome) of each node, or the exception it raised."""
    prev = ms[0].genesis_plan(k - 1, step - 1)
    out: list = [None] * len(ms)

    def run(i):
        m = ms[i]
        try:
            a = m.attempt(k, 0, prev=prev, prev_outcome=None, step=step, since=time.monotonic(),
                          allreduce=lambda plan: (True, "", -1, {}))
            out[i] = (a.plan, a.outcome)
        except BaseException as e:  # the test looks at it
            out[i] = e

    ts = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(ms))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert not any(t.is_alive() for t in ts), "a node hung"
    return out


def _leave(ms):
    for m in ms:
        m.leave()


# -- heartbeats -------------------------------------------------------------------------------------


def test_a_strangers_heartbeat_add_or_replay_does_not_evict_a_live_node():
    """A stranger adds 2^40 to node 1's heartbeat key (the old 'left' mark), replaces it with a counter,
    and replays an old valid record: node 0 keeps seeing node 1 alive, and never as left."""
    store = _tcp_store()
    ms = _register_all(store.port, 2, "hb")
    stranger = launch_client(store.port, ms[0])
    try:
        old = stranger.get("hb/1")
        time.sleep(3 * HB_INTERVAL)
        stranger = _stranger_add(stranger, store.port, ms[0], "hb/1", 1 << 40)
        time.sleep(3 * HB_INTERVAL)  # node 0 read the key again meanwhile
        assert not ms[0].gone(1), "one add by a stranger evicted a live node"
        deadline = time.monotonic() + 2 * HB_TIMEOUT
        # Keep attacking for longer than the heartbeat timeout, each forgery followed by time for node 1's
        # next beat (a stranger who overwrites the key faster than the node beats can hide it: that is
        # denial of service, docs/security.md; what must not happen is a forgery counted as the node's).
        while time.monotonic() < deadline:
            stranger.delete_key("hb/1")
            stranger = _stranger_add(stranger, store.port, ms[0], "hb/1", 1 << 40)
            time.sleep(1.5 * HB_INTERVAL)
            stranger.set("hb/1", old)  # a replay of node 1's own, older, validly signed heartbeat
            time.sleep(1.5 * HB_INTERVAL)
            assert not ms[0].gone(1), "a forged or replayed heartbeat evicted a live node"
        assert not ms[0].monitor.left(1)
        # ... while a node that really stops beating is dead after the timeout
        ms[1].monitor.stop(leave=False)
        time.sleep(HB_TIMEOUT + 4 * HB_INTERVAL)
        assert ms[0].gone(1) and not ms[0].monitor.left(1)
    finally:
        _leave(ms)


def test_a_stranger_cannot_keep_a_dead_node_alive():
    """A stranger who keeps writing counters and replays under a dead node's key does not keep it alive."""
    store = _tcp_store()
    ms = _register_all(store.port, 2, "dead")
    stranger = launch_client(store.port, ms[0])
    try:
        old = stranger.get("hb/1")
        ms[1].monitor.stop(leave=False)
        deadline = time.monotonic() + HB_TIMEOUT + 5 * HB_INTERVAL
        n = 0
        while time.monotonic() < deadline:
            stranger.set("hb/1", old if n % 2 else str(n))
            n += 1
            time.sleep(HB_INTERVAL / 3)
        assert ms[0].gone(1)
    finally:
        _leave(ms)


# -- decisions ---------------------------------------------------------------------------------------


def test_an_outcome_written_first_by_a_stranger_does_not_stop_the_job():
    """Before the nodes decide outer step 1, a stranger writes its outcome: give up. They commit anyway."""
    from prime.elastic import Outcome

    store = _tcp_store()
    ms = _register_all(store.port, 2, "out")
    stranger = launch_client(store.port, ms[0])
    try:
        forged = Outcome(k=1, attempt=0, commit=False, members=[], give_up="stop, says the stranger", by=0)
        landed_set(stranger, "b/1/a0/outcome", json.dumps(asdict(forged), sort_keys=True))
        got = _outer_step(ms, 1, 10)
        for r in got:
            assert not isinstance(r, BaseException), got
            plan, outcome = r
            assert outcome.commit and outcome.members == [0, 1] and not outcome.give_up, outcome
        assert ms[0].records.rejected, "the forged outcome was not noticed"
    finally:
        _leave(ms)


def test_a_forged_plan_does_not_evict_a_node():
    """A stranger writes the plan of outer step 1 first, leaving node 1 out: both nodes take part anyway."""
    from prime.elastic import Plan

    store = _tcp_store()
    ms = _register_all(store.port, 2, "plan")
    stranger = launch_client(store.port, ms[0])
    try:
        forged = Plan(k=1, attempt=0, members=[0], contributors=[0], slots={"0": 0}, step=10,
                      evicted=[[1, "evicted by a stranger"]], by=0)
        landed_set(stranger, "b/1/a0/plan", json.dumps(asdict(forged), sort_keys=True))
        got = _outer_step(ms, 1, 10)
        for r in got:
            assert not isinstance(r, BaseException), got
            plan, outcome = r
            assert plan.members == [0, 1] and plan.evicted == [] and outcome.commit, (plan, outcome)
    finally:
        _leave(ms)


def test_a_signed_decision_replayed_under_another_outer_step_is_ignored():
    """A stranger copies outer step 1's (validly signed) plan under outer step 2's key, and forges node 0's
    arrival there: outer step 2 is decided afresh, at its own inner step."""
    store = _tcp_store()
    ms = _register_all(store.port, 2, "replay")
    stranger = launch_client(store.port, ms[0])
    try:
        first = _outer_step(ms, 1, 10)
        assert all(not isinstance(r, BaseException) for r in first), first
        landed_set(stranger, "b/2/a0/plan", stranger.get("b/1/a0/plan"))
        landed_set(stranger, "b/2/arrive/1", stranger.get("b/1/arrive/1"))
        got = _outer_step(ms, 2, 20)
        for r in got:
            assert not isinstance(r, BaseException), got
            plan, outcome = r
            assert plan.k == 2 and plan.step == 20 and plan.members == [0, 1] and outcome.commit, plan
    finally:
        _leave(ms)


# -- launches ------------------------------------------------------------------------------------------


def _copy_keys(src, dst, ks) -> list:
    """A stranger's replay: the keys of `ks` that `src` holds, written under the same keys in `dst`."""
    copied = []
    for k in ks:
        if src.check([k]):
            landed_set(dst, k, src.get(k))
            copied.append(k)
    return copied


def test_an_earlier_launch_replayed_into_the_store_does_not_steer_the_next_one():
    """A stranger kept every record of launch A (same run id and secret: node 0's claim of its initial slot,
    the heartbeats, the newest committed outer step, the store's current launch) and writes them into the
    store of launch B before its nodes start. B's nodes still start as B's initial nodes, in a launch of
    their own, and read nothing of A's: node 0 founds B once A neither answers nor beats."""
    from prime.comm import store_keys as keys

    store_a = _tcp_store()
    a = _register_all(store_a.port, 2, "again")
    assert all(not isinstance(r, BaseException) for r in _outer_step(a, 1, 10))
    for m, (plan, outcome) in zip(a, _outer_step(a, 2, 20)):
        m.commit(plan, outcome)
    name_a = a[0].launch
    for m in a:
        m.monitor.stop(leave=False)  # killed: A's heartbeats stay as they were
    store_b = _tcp_store()
    kept = _copy_keys(_client(store_a.port, "again/elastic"), _client(store_b.port, "again/elastic"),
                      [keys.LAUNCH_CURRENT])
    kept += _copy_keys(launch_client(store_a.port, a[0]), _client(store_b.port, f"again/elastic/launch/{name_a}"),
                       [keys.genesis(0), keys.genesis(1), keys.heartbeat(0), keys.heartbeat(1), keys.COMMITTED])
    assert len(kept) == 6, kept
    t0 = time.monotonic()
    b = _register_all(store_b.port, 2, "again")
    try:
        assert b[0].launch == b[1].launch != name_a
        assert [m.node_id for m in b] == [0, 1] and all(m.genesis for m in b), "B's nodes became joiners"
        assert all(m.latest_committed() is None for m in b), "a node of B read A's committed outer step"
        assert time.monotonic() - t0 < 15, "founding B waited for the start timeout (20 s)"
        got = _outer_step(b, 1, 10)
        assert all(not isinstance(r, BaseException) and r[1].commit for r in got), got
    finally:
        _leave(b)


def test_a_restarted_node_0_enters_the_live_launch_as_a_joiner():
    """Node 0 dies and starts again while node 1 lives, and a stranger deleted the record that names the
    store's current launch: the live launch still answers node 0's ask, and it joins that launch with a new id
    (its initial slot is taken) instead of founding another; the record is written back."""
    from prime.comm import store_keys as keys

    slow = dict(heartbeat_timeout_s=10.0)  # founding instead would take 10 s
    store = _tcp_store()
    ms = _register_all(store.port, 2, "restart", **slow)
    ms[0].monitor.stop(leave=False)
    run = _client(store.port, "restart/elastic")
    run.delete_key(keys.LAUNCH_CURRENT)
    again = _membership(store.port, 0, 2, "restart", **slow)
    t0 = time.monotonic()
    again.register(start_timeout_s=20)
    try:
        assert again.launch == ms[1].launch
        assert not again.genesis and again.node_id == 2
        assert time.monotonic() - t0 < 5, "a live launch answers within a sweep or two"
        assert ms[1].launch in run.get(keys.LAUNCH_CURRENT).decode()
    finally:
        _leave([again, ms[1]])


def test_a_job_started_again_in_the_same_store_founds_a_new_launch_and_a_late_joiner_stops():
    """Every node of launch A left cleanly. The same ranks started again in the same store found launch B
    at once (as its initial nodes). A joiner that starts when no node of B is alive is told the job ended
    where B recorded its end (its last outer step committed), and that there is nothing to join otherwise."""
    from prime.elastic import JobFinished, JoinError

    slow = dict(heartbeat_timeout_s=10.0)  # waiting for the old launch's heartbeats to stop would take 10 s
    store = _tcp_store()
    a = _register_all(store.port, 2, "twice", **slow)
    _leave(a)
    t0 = time.monotonic()
    b = _register_all(store.port, 2, "twice", **slow)
    assert b[0].launch == b[1].launch != a[0].launch
    assert all(m.genesis for m in b) and [m.node_id for m in b] == [0, 1]
    assert time.monotonic() - t0 < 5, "a launch whose nodes all left is over at once"
    _leave(b)
    late = _membership(store.port, 5, 2, "twice", **slow)
    with pytest.raises(JoinError, match="nothing to join"):
        late.register(start_timeout_s=20)
    b[0].mark_ended(40)
    late = _membership(store.port, 6, 2, "twice", **slow)
    with pytest.raises(JobFinished, match="at step 40"):
        late.register(start_timeout_s=20)


def test_an_ended_launch_written_back_as_the_current_one_does_not_make_node_0_found_beside_the_live_one():
    """A stranger kept the record that named an earlier launch C (every node of it left) as the store's current
    launch, and writes it back while launch A lives and its node 0 restarts: node 0 still joins A (A answers
    before node 0 judges C), and A's members write A's name back."""
    from prime.comm import store_keys as keys

    slow = dict(heartbeat_timeout_s=10.0)  # A's node 0 stays silent meanwhile; founding on silence would take 10 s
    store = _tcp_store()
    run = _client(store.port, "ended/elastic")
    c = _register_all(store.port, 2, "ended", **slow)
    kept = run.get(keys.LAUNCH_CURRENT)
    _leave(c)
    a = _register_all(store.port, 2, "ended", **slow)
    a[0].monitor.stop(leave=False)
    landed_set(run, keys.LAUNCH_CURRENT, kept)
    again = _membership(store.port, 0, 2, "ended", **slow)
    again.register(start_timeout_s=20)
    try:
        assert c[0].launch != a[1].launch
        assert again.launch == a[1].launch and not again.genesis, "node 0 founded a launch beside the live one"
        deadline = time.monotonic() + 5
        while a[1].launch not in run.get(keys.LAUNCH_CURRENT).decode():
            assert time.monotonic() < deadline, "the live launch did not write its name back"
            time.sleep(0.05)
    finally:
        _leave([again, a[1]])


def test_a_joiner_that_starts_just_before_node_0_of_a_job_started_again_enters_the_new_launch():
    """Every node of launch A left; the job starts again in the same store, and a joiner is a little faster
    than node 0. The joiner does not take A's end for the job's: it enters the launch node 0 founds."""
    store = _tcp_store()
    a = _register_all(store.port, 2, "early")
    _leave(a)
    joiner = _membership(store.port, 5, 2, "early")
    errs: list = []
    t = threading.Thread(target=lambda: _try(errs, joiner.register, start_timeout_s=20), daemon=True)
    t.start()
    time.sleep(0.3)
    b = _register_all(store.port, 2, "early")
    t.join(30)
    try:
        assert not errs, errs
        assert joiner.launch == b[0].launch != a[0].launch and not joiner.genesis
    finally:
        _leave(b + [joiner])


def _try(errs: list, fn, **kw):
    try:
        fn(**kw)
    except BaseException as e:  # the test looks at it
        errs.append(e)


def test_a_counter_a_stranger_overwrote_blinds_no_node_and_stops_a_newcomer_with_a_clear_error():
    """A stranger writes a non-number over the run's ask counter and the launch's joiner counter (the store's
    `add` on such a value drops the connection): the members still see each other alive, and a process that
    starts then stops with a MembershipError that says what happened."""
    from prime.comm import store_keys as keys
    from prime.elastic import MembershipError

    store = _tcp_store()
    ms = _register_all(store.port, 2, "blind")
    try:
        _client(store.port, "blind/elastic").set(keys.LAUNCH_ASKS, "x")
        launch_client(store.port, ms[0]).set(keys.JOINERS, "y")
        time.sleep(2 * HB_TIMEOUT)
        assert not ms[0].gone(1) and not ms[1].gone(0), "a node lost sight of the other"
        late = _membership(store.port, 5, 2, "blind")
        with pytest.raises(MembershipError, match="not a number"):
            late.register(start_timeout_s=5)
    finally:
        _leave(ms)


def test_an_ask_left_behind_by_an_inflated_counter_is_asked_again_and_answered():
    """A stranger adds more than the members look back over to the ask counter just after a joiner asked (the
    heartbeats sweep once a second, so before any member read the ask): the joiner asks again under the newest
    index and enters the live launch within a few sweeps, instead of waiting out its start timeout."""
    from prime.comm import store_keys as keys
    from prime.elastic.launch import MAX_ASKS

    _a_joiner_enters_although("inflate", lambda run: run.add(keys.LAUNCH_ASKS, MAX_ASKS + 10))


def test_an_ask_above_a_lowered_counter_is_asked_again_and_answered():
    """A stranger sets the ask counter back to 0 just after a joiner asked (before any member's sweep read the
    ask): the members read only the indices below the counter, so the joiner asks again under the counter's
    new value, the members read the indices they had answered again, and it enters the live launch within a
    few sweeps instead of waiting out its start timeout."""
    from prime.comm import store_keys as keys

    _a_joiner_enters_although("lower", lambda run: landed_set(run, keys.LAUNCH_ASKS, "0"))


def _a_joiner_enters_although(run_id: str, stranger) -> None:
    """Two members (heartbeats a second apart) and a joiner; stranger(the run's raw store client) acts just
    after the joiner took its ask index: the joiner still enters the live launch within 8 s."""
    import threading as th

    from prime.comm import store_keys as keys

    slow = dict(heartbeat_interval_s=1.0, heartbeat_timeout_s=5.0)
    store = _tcp_store()
    ms = _register_all(store.port, 2, run_id, **slow)
    run = _client(store.port, f"{run_id}/elastic")
    before = int(run.add(keys.LAUNCH_ASKS, 0))
    assert before >= 2  # the initial nodes' asks
    late = _membership(store.port, 7, 2, run_id, **slow)
    errs: list = []

    def register():
        try:
            late.register(start_timeout_s=20)
        except BaseException as e:  # surfaced below
            errs.append(e)

    t0 = time.monotonic()
    t = th.Thread(target=register, daemon=True)
    t.start()
    try:
        while int(run.add(keys.LAUNCH_ASKS, 0)) == before:  # the joiner took its ask index
            assert time.monotonic() - t0 < 10, "the joiner never asked"
        stranger(run)
        t.join(20)
        assert not t.is_alive() and not errs, errs
        assert late.launch == ms[0].launch and not late.genesis
        assert time.monotonic() - t0 < 8, "the joiner waited for its start timeout"
    finally:
        _leave(ms + ([late] if late.launch else []))


def test_a_founder_that_asked_again_answers_from_its_first_ask_on():
    """Node 0 (the store outside the nodes) asks at index 0; node 1 asks 300 indices later (a stranger inflates
    the counter); another 300, and node 0, now more than half the members' look-back behind, asks again before
    it founds. Its door still starts from its first ask: node 1's ask, more than the door's look-back below
    node 0's second one, is answered."""
    import threading as th

    import torch.distributed as dist

    from prime.comm import store_keys as keys
    from prime.comm.signed_store import SignedStore, read_counter
    from prime.elastic.launch import LOOK_BACK, MAX_ASKS, LaunchDoor, find_launch

    store = _tcp_store()
    run = SignedStore(_client(store.port, "refound/elastic"), SECRET, "refound")
    raw = _client(store.port, "refound/elastic")
    got = []
    t = th.Thread(target=lambda: got.append(find_launch(  # judges nothing for 2 heartbeat intervals: 4 s
        run, lambda name: SignedStore(dist.PrefixStore(keys.launch_prefix(name), run.store), SECRET, f"refound/{name}"),
        node_rank=0, initial_nodes=2, interval=2.0, timeout=6.0, wait_s=30, log=lambda msg: None)), daemon=True)
    t.start()
    deadline = time.monotonic() + 10
    while read_counter(raw, keys.LAUNCH_ASKS) == 0:  # node 0 asked, at index 0
        assert time.monotonic() < deadline
    step = MAX_ASKS // 2 - 200  # node 0 asks again only past MAX_ASKS // 2 behind: after the second
    raw.add(keys.LAUNCH_ASKS, step)
    node1 = SignedStore(_client(store.port, "refound/elastic"), SECRET, "refound")
    j = int(raw.add(keys.LAUNCH_ASKS, 1)) - 1
    node1.put(keys.launch_ask(j), {"nonce": "a" * 32, "rank": 1})
    raw.add(keys.LAUNCH_ASKS, step)
    t.join(30)
    assert got and got[0].founded and got[0].ask == 0, got
    assert read_counter(raw, keys.LAUNCH_ASKS) == 2 * step + 3, "node 0 did not ask again (once)"
    assert 2 * step + 2 - j > LOOK_BACK  # node 1's ask is below the look-back of node 0's second ask
    door = LaunchDoor(SignedStore(_client(store.port, "refound/elastic"), SECRET, "refound"), got[0].name,
                      since=got[0].ask)
    for _ in range(200):  # among the junk indices, a few a sweep: the newest first, then the others in turn
        door.answer()
        if node1.get(keys.launch_answer("a" * 32)) is not None:
            break
    assert node1.get(keys.launch_answer("a" * 32)) == {"launch": got[0].name}


def test_an_answer_is_taken_only_from_the_askers_own_nonce_and_the_secret():
    """A stranger's answers (unsigned, or signed with another secret) are ignored, and an answer signed for
    another nonce is never read: the asker times out with a clear error rather than take a name."""
    import threading as th

    from prime.comm import store_keys as keys
    from prime.comm.signed_store import SignedStore
    from prime.elastic import MembershipError

    store = _tcp_store()
    stranger = _client(store.port, "lone/elastic")
    other = SignedStore(_client(store.port, "lone/elastic"), b"another-secret", "lone")
    mine = SignedStore(_client(store.port, "lone/elastic"), SECRET, "lone")
    stop = th.Event()

    def forge():  # answers every ask as it appears: unsigned, with another secret, and for another nonce
        while not stop.wait(0.01):
            for i in range(int(stranger.add(keys.LAUNCH_ASKS, 0))):
                ask = json.loads(stranger.get(keys.launch_ask(i)).split(b":", 2)[2])
                stranger.set(keys.launch_answer(ask["nonce"]), json.dumps({"launch": "0" * 16}))
                other.put(keys.launch_answer(ask["nonce"]), {"launch": "1" * 16})
                mine.put(keys.launch_answer("f" * 32), {"launch": "2" * 16})

    t = th.Thread(target=forge, daemon=True)
    t.start()
    m = _membership(store.port, 1, 2, "lone")
    try:
        with pytest.raises(MembershipError, match="node rank 0 founds each launch"):
            m.register(start_timeout_s=0.5)
        assert m.launch == ""
    finally:
        stop.set()
        t.join(5)


# -- ring addresses ------------------------------------------------------------------------------------




class _Trap:
    """A listening socket on loopback that counts who connects (a stranger's fake rank)."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.1)
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.connections = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self):
        while not self._stop.is_set():
            try:
                c, _ = self.sock.accept()
                self.connections += 1
                c.close()
            except OSError:
                pass

    def close(self):
        self._stop.set()
        self._t.join(5)
        self.sock.close()


def _ring_in_thread(store, rank, out, job_id, timeout_s, secret=SECRET):
    from prime.comm import Ring

    def run():
        try:
            out[rank] = Ring(store, rank, 2, secret=secret, job_id=job_id, timeout=timedelta(seconds=timeout_s))
        except BaseException as e:  # the test looks at it
            out[rank] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


@needs_ring
def test_a_ring_address_rewritten_by_a_stranger_is_never_dialled():
    """Rank 1 published its address; a stranger rewrites it with the address of its own listener. Rank 0
    never connects there: it fails with an error naming the unsigned record."""
    store = _tcp_store()
    trap = _Trap()
    out: dict = {}
    try:
        t1 = _ring_in_thread(_client(store.port, "r1"), 1, out, "rewrite", 3.0)
        peek = _client(store.port, "r1")
        peek.wait(["prime_ring/rewrite/addr/1"], timedelta(seconds=30))
        landed_set(peek, "prime_ring/rewrite/addr/1", trap.address)
        t0 = _ring_in_thread(_client(store.port, "r1"), 0, out, "rewrite", 3.0)
        t0.join(30)
        t1.join(30)
        err = out[0]
        assert trap.connections == 0, f"rank 0 dialled the address a stranger wrote ({err})"
        assert isinstance(err, Exception) and "not signed" in str(err), err
        assert isinstance(out[1], Exception), out[1]  # its neighbour never came: it fails too, within its timeout
    finally:
        trap.close()
        for r in out.values():
            if not isinstance(r, BaseException) and r is not None:
                r.close()


@needs_ring
def test_a_ring_forms_with_the_right_peer_when_a_stranger_wrote_its_address_first():
    """A stranger plants rank 1's address before rank 1 starts: the ring forms between the two real ranks
    and averages correctly; the stranger's listener sees no connection."""
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    gen = torch.Generator().manual_seed(seed)
    store = _tcp_store()
    trap = _Trap()
    out: dict = {}
    try:
        landed_set(_client(store.port, "r2"), "prime_ring/first/addr/1", trap.address)
        ts = [_ring_in_thread(_client(store.port, "r2"), r, out, "first", 20.0) for r in (1, 0)]
        for t in ts:
            t.join(60)
        assert all(not isinstance(out[r], BaseException) for r in (0, 1)), out
        xs = [torch.randn(1000, generator=gen) for _ in range(2)]
        want = (xs[0].double() + xs[1].double()) / 2
        got = [x.clone() for x in xs]
        works = [out[r].all_reduce(got[r], op="avg", codec="none") for r in (0, 1)]
        for w in works:
            w.wait()
        for g in got:
            assert torch.allclose(g.double(), want, rtol=0, atol=1e-6)
        assert trap.connections == 0
    finally:
        trap.close()
        for r in out.values():
            if not isinstance(r, BaseException) and r is not None:
                r.close()


# -- the secret ----------------------------------------------------------------------------------------


@needs_ring
def test_a_ring_across_hosts_without_a_secret_refuses_to_start(monkeypatch):
    """Advertising a non-loopback address without a secret is a ValueError saying how to set one (before
    anything listens); on loopback a drawn secret is still fine."""
    from prime.comm import Ring

    monkeypatch.delenv("PRIME_RING_SECRET", raising=False)
    store = _tcp_store()
    with pytest.raises(ValueError, match="PRIME_RING_SECRET"):
        Ring(_client(store.port, "multi"), 0, 2, job_id="multi", timeout=timedelta(seconds=5),
             bind_addr="127.0.0.1", advertise_addr="192.168.77.1")


def test_an_elastic_node_across_hosts_without_a_secret_refuses_to_start(monkeypatch):
    from prime.elastic import Membership

    monkeypatch.delenv("PRIME_RING_SECRET", raising=False)
    monkeypatch.setenv("PRIME_RING_ADDR", "192.168.77.1")
    store = _tcp_store()
    m = Membership(lambda: _client(store.port, "nosecret/elastic"), node_rank=0, initial_nodes=1, run_id="nosecret")
    with pytest.raises(ValueError, match="PRIME_RING_SECRET"):
        m.register(start_timeout_s=1)
    assert not _client(store.port, "nosecret/elastic").check(["secret"]), "a secret was drawn into the store"


# -- the record format ---------------------------------------------------------------------------------


def test_signed_records_are_bound_to_key_job_and_secret_and_warned_about_once_per_kind():
    import torch.distributed as dist

    from prime.comm.signed_store import SignedStore

    warnings: list = []
    s = SignedStore(dist.HashStore(), SECRET, "job", warn=warnings.append)
    s.put("b/1/a0/plan", {"members": [0, 1]})
    assert s.get("b/1/a0/plan") == {"members": [0, 1]}
    raw = s.store.get("b/1/a0/plan")
    s.store.set("b/2/a0/plan", raw)  # another key
    other_job = SignedStore(s.store, SECRET, "another-job")
    other_secret = SignedStore(s.store, b"another-secret", "job")
    assert s.get("b/2/a0/plan") is None
    assert other_job.get("b/1/a0/plan") is None and other_secret.get("b/1/a0/plan") is None
    body = raw.decode().split(":", 2)[2]
    for bad in (body, "ps1:" + "0" * 64 + ":" + body, raw.decode()[:-3], raw.decode().replace("1]", "2]"), "",
                raw.decode()[4:]):
        s.store.set("b/3/a0/plan", bad)
        assert s.get("b/3/a0/plan") is None, bad
    assert len(warnings) == 1 and "b/*/a*/plan" in warnings[0], warnings
    assert s.rejected == {"b/*/a*/plan": 7}
    # first writer wins, and a forged first record does not block the decision
    s.store.set("b/4/a0/outcome", "forged")
    assert s.set_first("b/4/a0/outcome", {"commit": True}) == {"commit": True}
    assert s.set_first("b/4/a0/outcome", {"commit": False}) == {"commit": True}
    assert s.first("b/4/a0/outcome") == {"commit": True}


def test_a_strangers_add_cannot_turn_a_signed_record_into_a_number():
    """TCPStore's add parses the value as an integer (a leading digit is enough); a signed record starts with
    a letter, so a stranger's add fails and leaves it as it was, for every record drawn."""
    from prime.comm.signed_store import SignedStore

    store = _tcp_store()
    s = SignedStore(_client(store.port, "add"), SECRET, "job")
    for seq in range(20):  # MACs that start with a digit and with a letter
        s.put("hb/1", {"node": 1, "seq": seq, "left": False})
        before = s.store.get("hb/1")
        stranger = _client(store.port, "add")
        with pytest.raises(Exception):
            stranger.add("hb/1", 1 << 40)
        assert s.store.get("hb/1") == before and s.get("hb/1")["seq"] == seq


def test_a_replayed_older_committed_step_does_not_send_a_joiner_back():
    """A stranger saves the (validly signed) record of committed outer step 2 and writes it back after outer
    step 3 was committed: a joiner keeps seeing outer step 3."""
    from prime.comm.signed_store import SignedStore

    store = _tcp_store()
    launch = HandLaunch(store.port, "back", SECRET)
    nodes = launch.records  # nodes 0 and 1, by hand
    for i in (0, 1):
        nodes.put(f"hb/{i}", {"node": i, "seq": 1, "left": False})
    joiner = _membership(store.port, 5, 2, "back")
    joiner.register()
    try:
        def commit(k):
            nodes.put("members", {"k": k, "members": [0, 1], "step": 10 * k, "time": 0.0, "slots": {"0": 0, "1": 1}})

        commit(2)
        old = nodes.store.get("members")
        assert joiner.latest_committed()["k"] == 2
        commit(3)
        assert joiner.latest_committed()["k"] == 3
        landed_set(nodes.store, "members", old)
        assert joiner.latest_committed()["k"] == 3
    finally:
        joiner.leave()
        launch.close()


# -- the trainer's own records (resume agreement, final digests, finish) ------------------------------


def _trainer_kv(store, secret=SECRET, timeout_s=5.0):
    from prime.comm.signed_store import SignedKV, SignedStore

    return SignedKV(SignedStore(store, secret, "trainer/run"), timeout_s, poll_s=0.01)


def test_trainer_records_ignore_a_strangers_final_digest():
    """A digest a stranger wrote under another node's key is never read as that node's: the reader
    waits for the node's own signed record and gets exactly it."""
    import torch.distributed as dist

    from prime.comm import store_keys as keys

    store = dist.HashStore()
    reader, writer = _trainer_kv(store), _trainer_kv(store)
    key = keys.final_digest(0, 1)
    store.set(key, "0" * 32)  # the stranger's value: what the reader's own digest might be
    got = []
    t = threading.Thread(target=lambda: got.append(reader.get(key)))
    t.start()
    time.sleep(0.1)
    assert not got, "an unsigned digest was accepted"
    real = "%032x" % random.getrandbits(128)
    writer.set(key, real)
    t.join(5)
    assert got == [real.encode()]
    assert reader.records.rejected, "the forged record was not counted"


def test_trainer_records_reject_other_secret_and_other_key():
    """A record signed with another secret, or copied from another key, is ignored until the timeout,
    which names the key."""
    import torch.distributed as dist

    from prime.comm import store_keys as keys

    store = dist.HashStore()
    kv = _trainer_kv(store, timeout_s=0.3)
    _trainer_kv(store, secret=b"another secret").set(keys.resume_offer(0, 1), json.dumps({"steps": [8]}))
    with pytest.raises(TimeoutError, match=r"ckpt/r0/node1"):
        kv.get(keys.resume_offer(0, 1))
    kv.set(keys.resume_offer(0, 0), json.dumps({"steps": [4], "damaged": []}))
    store.set(keys.resume_offer(1, 0), store.get(keys.resume_offer(0, 0)))  # replayed into the next round
    with pytest.raises(TimeoutError, match=r"ckpt/r1/node0"):
        kv.get(keys.resume_offer(1, 0))


def test_resume_agreement_never_takes_a_strangers_offer():
    """A stranger who speaks for node 1 in the resume agreement (offering only an old step, to send the
    job back) is not heard: node 0 waits for node 1's signed offer and times out instead of resuming from
    the stranger's step (with a raw store it resumed from step 4)."""
    import torch.distributed as dist

    from prime.checkpoint import agree_on_resume_step
    from prime.comm import store_keys as keys

    store = dist.HashStore()
    for rnd in range(3):  # every round the agreement may take
        store.set(keys.resume_offer(rnd, 1), json.dumps({"steps": [4], "damaged": []}))
    kv = _trainer_kv(store, timeout_s=0.5)
    with pytest.raises(TimeoutError, match=r"ckpt/r0/node1"):
        agree_on_resume_step([4, 8, 12], lambda s: [], kv, 0, 2, publish=True)


def test_resume_agreement_over_signed_records():
    """Two nodes agree through signed records on the newest step both hold intact."""
    import torch.distributed as dist

    from prime.checkpoint import agree_on_resume_step

    store = dist.HashStore()
    out = [None, None]

    def node(r, steps, bad):
        out[r] = agree_on_resume_step(steps, lambda s: ["x"] if s in bad else [], _trainer_kv(store), r, 2,
                                      publish=True)[0]

    ts = [threading.Thread(target=node, args=(0, [4, 8, 12], ())),
          threading.Thread(target=node, args=(1, [4, 8, 12], (12,)))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(10)
    assert out == [8, 8]


# -- reads never wait for a key ------------------------------------------------------------------------
#
# A TCPStore get of a missing key waits until the client's timeout (diloco.timeout_s). Reads used to be a
# check() and then a get(): a stranger who deleted the key in between stalled the reader (in the elastic
# layer, node 0's heartbeat thread, which got a live node evicted). Reads are now one compare_set with a
# random sentinel (prime.comm.signed_store.read_now), which never waits.


@pytest.mark.parametrize("view", ["tcp", "prefix"])
def test_read_now_never_waits_never_creates_a_missing_key_and_leaves_a_present_one_as_it_is(view, monkeypatch):
    import os

    import prime.comm.signed_store as signed_store
    from prime.comm.signed_store import read_now

    store = _tcp_store()
    tag = "%016x" % random.getrandbits(64)
    s = _client(store.port, f"now{tag}") if view == "prefix" else _client(store.port, "x").underlying_store
    n0 = store.num_keys()
    for _ in range(20):
        missing = "missing/%016x" % random.getrandbits(64)
        t0 = time.monotonic()
        assert read_now(s, missing) is None
        assert time.monotonic() - t0 < 10.0, "read_now waited for a missing key (the store's timeout is 30 s)"
        assert not s.check([missing]), "read_now created a missing key"
    assert store.num_keys() == n0, "read_now wrote a key"
    values = [os.urandom(random.randrange(1, 300)) for _ in range(20)]
    values += [b"", b"prime-absent:" + ("%032x" % random.getrandbits(128)).encode(), b"ps1:" + os.urandom(80)]
    for i, value in enumerate(values):
        key = f"present/{tag}/{i}"
        s.set(key, value)
        assert read_now(s, key) == value
        assert s.get(key) == value, "read_now changed the value"
    # the sentinel itself under the key (a stranger would have to guess 128 random bits): it reads as
    # missing, and the compare_set writes back the same bytes, i.e. changes nothing
    fixed = "%032x" % random.getrandbits(128)
    monkeypatch.setattr(signed_store.secrets, "token_hex", lambda n: fixed)
    sentinel = b"prime-absent:" + fixed.encode()
    s.set("holds-sentinel", sentinel)
    assert read_now(s, "holds-sentinel") is None
    assert s.check(["holds-sentinel"]) and s.get("holds-sentinel") == sentinel
    assert read_now(s, "still-missing") is None and not s.check(["still-missing"])


def test_signed_reads_return_at_once_while_a_stranger_deletes_and_rewrites_the_key():
    """A stranger deletes a heartbeat record and writes it back (a replay of the valid record) in a tight
    loop, and now and then leaves it deleted for 1.5 s. A reader's get() and get_many() (of 100 nodes'
    heartbeats, as the monitor reads them) each return within a second (the store client's timeout is
    30 s), with either nothing or the valid record, and a key that was never written stays missing. The
    old check-then-get blocked there until the key came back (or the client's timeout), and read an
    empty value when the key went away between the get's wait and its read."""
    from prime.comm.signed_store import SignedStore

    store = _tcp_store()
    prefix = "race%016x" % random.getrandbits(64)
    s = SignedStore(_client(store.port, prefix), SECRET, "job")
    key, never = "hb/0", "hb/%d" % random.randrange(100, 1000)
    values = [{"node": i, "seq": random.randrange(1 << 30), "left": False} for i in range(100)]
    ks = [f"hb/{i}" for i in range(len(values))]
    for k, v in zip(ks, values):
        s.put(k, v)
    raw = s.store.get(key)
    stranger = _client(store.port, prefix)
    stop, flips, holds, hold_s = threading.Event(), [0], [0], 1.5

    def flap():
        while not stop.is_set():
            t_end = time.monotonic() + 0.2
            while time.monotonic() < t_end:
                stranger.delete_key(key)
                stranger.set(key, raw)
                flips[0] += 1
            time.sleep(random.uniform(0, 0.03))
            stranger.delete_key(key)
            holds[0] += 1
            stop.wait(hold_s)
            stranger.set(key, raw)

    calls, min_holds = 300, 3
    durations: list = []
    results: list = []
    errors: list = []

    def read():
        try:
            i = 0
            while i < calls or holds[0] < min_holds:
                t0 = time.monotonic()
                got = [s.get(key)] if i % 2 else s.get_many(ks + [never])
                durations.append(time.monotonic() - t0)
                results.append(got)
                i += 1
        except BaseException as e:  # surfaced below
            errors.append(e)

    flapper = threading.Thread(target=flap, daemon=True)
    flapper.start()
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(40)
    stop.set()
    flapper.join(5)
    assert not reader.is_alive(), f"a read blocked: {len(durations)} calls returned in 40 s"
    assert not errors, errors
    assert max(durations) < 1.0, f"slowest read {max(durations):.2f} s (the stranger held the key deleted {hold_s} s)"
    assert len(durations) >= calls and flips[0] > calls and holds[0] >= min_holds, (len(durations), flips, holds)
    for i, got in enumerate(results):
        if i % 2:
            assert got[0] in (None, values[0]), got
        else:
            assert got[0] in (None, values[0]) and got[1:] == values[1:] + [None], got
    assert any(got[0] == values[0] for got in results), "the reader never saw the record"
    assert any(got[0] is None for got in results), "the reader never saw the key missing"
    assert not s.store.check([never]), "a read created a key"
    assert s.rejected == {}, s.rejected


class _DeletesAfterCheck:
    """A store client whose keys a stranger (on its own connection) deletes right after every check() that
    found them, and writes back (a replay) just before the next check(): the worst timing of the
    check-then-read race, every time."""

    def __init__(self, store, stranger):
        self._store, self._stranger, self._taken = store, stranger, {}
        self.deletes = 0

    def check(self, ks):
        for k, raw in self._taken.items():
            self._stranger.set(k, raw)
        found = self._store.check(ks)
        if found:
            for k in ks:
                self._taken[k] = self._stranger.get(k)
                self._stranger.delete_key(k)
                self.deletes += 1
        return found

    def __getattr__(self, name):
        return getattr(self._store, name)


@pytest.mark.parametrize("read", ["secret", "address", "barrier"])
def test_rendezvous_reads_do_not_block_when_a_stranger_deletes_the_key_after_each_check(read, monkeypatch):
    """The ring's rendezvous reads finish by their deadline (not the store's 30 s timeout) when a stranger
    deletes every key the rank checked right after the check: the drawn secret is read, and a record that
    is never there when read ends in the rendezvous timeout error."""
    from prime.comm import rendezvous
    from prime.comm.errors import CommError
    from prime.comm.signed_store import SignedStore

    monkeypatch.delenv("PRIME_RING_SECRET", raising=False)
    store = _tcp_store()
    prefix = "rdv%016x" % random.getrandbits(64)
    job = "job%08x" % random.getrandbits(32)
    ns = rendezvous.namespace(job)
    proxy = _DeletesAfterCheck(_client(store.port, prefix), _client(store.port, prefix))
    setup = _client(store.port, prefix)
    secret = "%064x" % random.getrandbits(256)
    deadline_s = 1.5
    out: list = []

    def run():
        deadline = time.monotonic() + deadline_s
        try:
            if read == "secret":
                setup.set(f"{ns}/secret", secret)  # what rank 0 writes
                out.append(rendezvous.shared_secret(proxy, ns, 1, None, deadline, 1500))
            elif read == "address":
                SignedStore(setup, SECRET, ns).put(f"{ns}/addr/1", "127.0.0.1:%d" % random.randrange(1024, 65535))
                out.append(rendezvous.publish_and_find_all(proxy, ns, 0, 2, "127.0.0.1:1", deadline, 1500, SECRET))
            else:
                SignedStore(setup, SECRET, ns).put(f"{ns}/ready/1", "1")
                out.append(rendezvous.barrier(proxy, ns, 0, 2, deadline, 1500, SECRET))
        except BaseException as e:  # the test looks at it
            out.append(e)

    t0 = time.monotonic()
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(deadline_s + 8)
    took = time.monotonic() - t0
    assert not t.is_alive(), f"the rendezvous read blocked ({took:.1f} s; the store's timeout is 30 s)"
    assert took < deadline_s + 5, took
    if read == "secret":
        assert out == [secret.encode()], out
    else:
        assert proxy.deletes > 0, "the stranger never deleted anything: the test tests nothing"
        assert len(out) == 1 and isinstance(out[0], CommError) and out[0].kind == "timeout", out


# -- reads of many keys: two round trips --------------------------------------------------------------
#
# SignedStore.get_many reads every key with a check and then, when all are there, one multi_get under a
# short timeout; a key missing, or deleted in between, falls back to read_now per key. Each store call is a
# round trip to the store, which may be a continent away: the heartbeat monitor reads every node's record
# each second.


class _Counting:
    """A store client that records each call that goes to the store (a round trip each)."""

    _CALLS = ("check", "multi_get", "compare_set", "get", "set", "add", "delete_key")

    def __init__(self, store, before_multi_get=None):
        self.underlying_store, self.calls, self._before = store, [], before_multi_get

    def __getattr__(self, name):
        attr = getattr(self.underlying_store, name)
        if name not in self._CALLS:
            return attr

        def call(*args):
            self.calls.append(name)
            if name == "multi_get" and self._before is not None:
                return self._before(attr, *args)
            return attr(*args)

        return call


def _heartbeats(s, n: int):
    values = [{"node": i, "seq": random.randrange(1 << 30), "left": random.random() < 0.5} for i in range(n)]
    ks = [f"hb/{i}" for i in range(n)]
    for k, v in zip(ks, values):
        s.put(k, v)
    return ks, values


def test_get_many_reads_present_keys_in_two_round_trips_and_a_missing_one_key_by_key():
    from prime.comm.signed_store import SignedStore, batched_reads

    store = _tcp_store()
    prefix = "many%016x" % random.getrandbits(64)
    counted = _Counting(_client(store.port, prefix))
    s = SignedStore(counted, SECRET, "job")
    assert batched_reads(counted)
    n = random.randrange(20, 60)
    ks, values = _heartbeats(s, n)
    counted.calls.clear()
    assert s.get_many(ks) == values
    assert counted.calls == ["check", "multi_get"], counted.calls
    assert counted.underlying_store.timeout == timedelta(seconds=30), "the client's timeout was not restored"

    gone = random.randrange(n)
    counted.underlying_store.delete_key(ks[gone])
    counted.calls.clear()
    assert s.get_many(ks) == values[:gone] + [None] + values[gone + 1:]
    assert counted.calls == ["check"] + ["compare_set"] * n, counted.calls
    other = (gone + 1) % n  # a key still there (the first one may be the deleted one)
    assert s.get_many([ks[other]]) == [values[other]] and not s.rejected


def test_get_many_reads_key_by_key_where_a_batch_could_break_the_connection():
    """The older TCPStore backend's server drops the connection when a multi_get finds a key deleted after
    its wait, and a HashStore is in-process: both are read a key at a time."""
    import torch.distributed as dist

    from prime.comm.signed_store import SignedStore, batched_reads

    old = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30),
                        use_libuv=False)
    client = dist.TCPStore("127.0.0.1", old.port, is_master=False, timeout=timedelta(seconds=30), use_libuv=False)
    counted = _Counting(dist.PrefixStore("old", client))
    assert not batched_reads(counted) and not batched_reads(dist.HashStore())
    s = SignedStore(counted, SECRET, "job")
    ks, values = _heartbeats(s, 5)
    counted.calls.clear()
    assert s.get_many(ks) == values
    assert counted.calls == ["compare_set"] * 5, counted.calls


def test_get_many_with_a_key_deleted_between_its_check_and_its_multi_get_returns_soon_and_reads_it_missing():
    """The worst timing: a stranger deletes a key after the check saw it. The multi_get waits for it only for
    its short timeout (the client's is 30 s), then each key is read by itself; the client's timeout is
    restored and its connection still serves a batched read."""
    from prime.comm.signed_store import SignedStore

    store = _tcp_store()
    prefix = "gone%016x" % random.getrandbits(64)
    stranger = _client(store.port, prefix)
    n = random.randrange(10, 40)
    gone = random.randrange(n)

    def delete_first(multi_get, ks):
        stranger.delete_key(ks[gone])
        return multi_get(ks)

    counted = _Counting(_client(store.port, prefix), before_multi_get=delete_first)
    s = SignedStore(counted, SECRET, "job")
    ks, values = _heartbeats(s, n)
    raw = stranger.get(ks[gone])
    counted.calls.clear()
    t0 = time.monotonic()
    got = s.get_many(ks)
    took = time.monotonic() - t0
    assert got == values[:gone] + [None] + values[gone + 1:]
    assert counted.calls == ["check", "multi_get"] + ["compare_set"] * n, counted.calls
    assert took < 10, f"the read waited {took:.1f} s for the deleted key"
    assert counted.underlying_store.timeout == timedelta(seconds=30), "the client's timeout was not restored"
    landed_set(stranger, ks[gone], raw)
    counted._before = None
    counted.calls.clear()
    assert s.get_many(ks) == values and counted.calls == ["check", "multi_get"]
    assert not s.rejected, s.rejected


def test_get_many_reads_an_empty_value_from_its_multi_get_as_missing_not_forged():
    """The libuv server answers a key deleted between the multi_get's wait and its read with an empty value:
    that key is missing (no record is empty), not a forgery to warn about."""
    from prime.comm.signed_store import SignedStore

    store = _tcp_store()
    n = random.randrange(5, 20)
    gone = random.randrange(n)

    def empty_one(multi_get, ks):
        got = multi_get(ks)
        got[gone] = b""
        return got

    counted = _Counting(_client(store.port, "empty%016x" % random.getrandbits(64)), before_multi_get=empty_one)
    warnings: list = []
    s = SignedStore(counted, SECRET, "job", warn=warnings.append)
    ks, values = _heartbeats(s, n)
    assert s.get_many(ks) == values[:gone] + [None] + values[gone + 1:]
    assert not s.rejected and not warnings, (s.rejected, warnings)


def test_an_outer_step_agreement_polls_only_the_records_still_missing():
    """A wait for every member's arrival (or result) polls the store; each round reads only the records not
    yet seen, so waiting for the last of N nodes costs a round trip a poll, not N. A record seen once counts
    though a stranger deletes or overwrites it afterwards (a node writes each of these records once)."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from prime.comm import store_keys as keys
    from prime.comm.signed_store import SignedStore
    from prime.elastic.agreement import OuterStepAgreement

    counted = _Counting(dist.HashStore())
    records = SignedStore(counted, SECRET, "job")
    agreement = OuterStepAgreement(SimpleNamespace(records=records))
    n, k = random.randrange(5, 12), random.randrange(1, 100)
    ids = random.sample(range(3 * n), n)
    arrivals = {i: {"step": random.randrange(1000), "time": random.random()} for i in ids}
    early = ids[:-2]
    for i in early:
        records.put(keys.arrival(k, i), arrivals[i])
    seen: dict = {}

    def poll():
        counted.calls.clear()
        return agreement._read_new(seen, lambda i: keys.arrival(k, i), ids)

    assert poll() == {i: arrivals[i] for i in early} and len(counted.calls) == n
    assert poll() == {i: arrivals[i] for i in early} and len(counted.calls) == 2
    counted.underlying_store.delete_key(keys.arrival(k, early[0]))
    counted.underlying_store.set(keys.arrival(k, early[1]), "forged")
    records.put(keys.arrival(k, ids[-2]), arrivals[ids[-2]])
    assert poll() == {i: arrivals[i] for i in ids[:-1]} and len(counted.calls) == 2
    records.put(keys.arrival(k, ids[-1]), arrivals[ids[-1]])
    assert poll() == arrivals and len(counted.calls) == 1
    assert poll() == arrivals and counted.calls == []


def test_the_coordinator_reads_no_join_offer_of_a_node_that_beat_and_is_gone():
    """Over a long run with many joins, the ids of nodes that came and went pile up (and a stranger can inflate
    the joiner counter): the coordinator reads the offers of the live nodes and of nodes that wrote a heartbeat
    record but never a valid one (one signing with another secret is reported), not the others', and admits
    only live nodes whose offer is signed and names the outer step."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from prime.comm import store_keys as keys
    from prime.comm.signed_store import SignedStore
    from prime.elastic.admission import Admission
    from prime.elastic.membership import NEW_IDS_PER_SWEEP

    counted = _Counting(dist.HashStore())
    records = SignedStore(counted, SECRET, "job")
    initial, joined = 2, random.randrange(20, 60)
    counted.underlying_store.add(keys.JOINERS, joined)
    ids = list(range(initial + joined))
    came_and_went = set(random.sample(ids[initial:], joined // 2))
    never_seen = set(random.sample(sorted(set(ids[initial:]) - came_and_went), 3))
    k = random.randrange(1, 100)
    for i in ids[initial:]:
        records.put(keys.join_offer(i), {"node": i, "outer_step": k})
    forger = sorted(never_seen)[0]
    SignedStore(counted.underlying_store, b"another-secret", "job").put(keys.join_offer(forger),
                                                                     {"node": forger, "outer_step": k})
    # ids with no heartbeat record (the newest few, which are read as a joiner may just have registered there)
    junk = set(random.sample(range(initial + joined, initial + joined + 100 - NEW_IDS_PER_SWEEP), 10))
    counted.underlying_store.add(keys.JOINERS, 100)
    for i in junk:
        records.put(keys.join_offer(i), {"node": i, "outer_step": k})
    monitor = SimpleNamespace(was_seen=lambda i: i not in never_seen,
                              gone=lambda i: i in came_and_went or i in never_seen or i in junk,
                              known_ids=lambda: ids)
    logged: list = []
    m = SimpleNamespace(store=counted, records=records, monitor=monitor, node_id=0, local_rank=0,
                        initial_nodes=initial, log=lambda msg, **_: logged.append(msg))
    counted.calls.clear()
    got = Admission(m).ready_joiners(k, exclude={0, 1})
    live = [i for i in ids[initial:] if i not in came_and_went and i not in never_seen]
    assert got == live
    reads = [c for c in counted.calls if c != "add"]
    # one more for the joiner counter, read without an add (prime.comm.signed_store.read_counter)
    assert len(reads) == 1 + len(live) + len(never_seen) + NEW_IDS_PER_SWEEP // 2, (len(reads), len(live))
    assert any(f"ignoring node {forger}: its join request is not signed" in line for line in logged), logged


class _SlowAdds:
    """A store client whose add() (the joiner counter the monitor reads each sweep) takes `delay_s`."""

    def __init__(self, store, delay_s: float):
        self._store, self._delay_s = store, delay_s

    def add(self, key, amount):
        time.sleep(self._delay_s)
        return self._store.add(key, amount)

    def __getattr__(self, name):
        return getattr(self._store, name)


def test_a_slow_read_of_the_other_heartbeats_does_not_delay_this_nodes_beat():
    """A node beats on its own thread and connection: a sweep of the others' records that takes ten intervals
    (a distant store, many ids to check) leaves its beat at its interval, where a beat after each sweep
    would let the others time the node out."""
    import torch.distributed as dist

    from prime.comm import store_keys as keys
    from prime.comm.signed_store import SignedStore
    from prime.elastic.membership import Monitor

    store, interval, slow_s, watch_s = dist.HashStore(), 0.05, 0.5, 1.5
    node = random.randrange(4)
    monitor = Monitor(SignedStore(_SlowAdds(store, slow_s), SECRET, "job"), node, 4, interval, 30.0,
                      beat_records=SignedStore(store, SECRET, "job"))
    reader = SignedStore(store, SECRET, "job")
    monitor.start()
    try:
        first = reader.get(keys.heartbeat(node))["seq"]
        time.sleep(watch_s)
        last = reader.get(keys.heartbeat(node))["seq"]
    finally:
        assert monitor.stop(leave=True)
    assert last - first >= watch_s / interval / 3, (first, last)  # a beat after each sweep: at most 3 or 4
    assert reader.get(keys.heartbeat(node))["left"] is True


def test_a_sweep_checks_a_bounded_number_of_ids_without_a_heartbeat_record():
    """A stranger adds a thousand to the joiner counter: a sweep of the heartbeats checks every initial node,
    the newest joiner ids and a few older ones in turn for a record (a store round trip each), not a thousand
    ids, and still finds a joiner that registered last at once and one buried among the junk in turn."""
    import torch.distributed as dist

    from prime.comm import store_keys as keys
    from prime.comm.signed_store import SignedStore
    from prime.elastic.membership import NEW_IDS_PER_SWEEP, Monitor

    counted = _Counting(dist.HashStore())
    records = SignedStore(counted, SECRET, "job")
    initial = random.randrange(2, 5)
    for i in range(initial):
        records.put(keys.heartbeat(i), {"node": i, "seq": 1, "left": False})
    junk = random.randrange(500, 1000)
    buried = initial + random.randrange(junk // 2)  # a joiner id among the junk ids, written late
    counted.underlying_store.add(keys.JOINERS, junk + 1)
    newest = initial + junk
    records.put(keys.heartbeat(newest), {"node": newest, "seq": 1, "left": False})
    monitor = Monitor(records, 0, initial, 1.0, 30.0)
    counted.calls.clear()
    monitor.watch()
    assert counted.calls.count("check") <= initial + NEW_IDS_PER_SWEEP, counted.calls.count("check")
    assert set(monitor.known_ids()) == set(range(initial)) | {newest}
    records.put(keys.heartbeat(buried), {"node": buried, "seq": 1, "left": False})
    sweeps = 0
    while buried not in monitor.known_ids():
        counted.calls.clear()
        monitor.watch()
        sweeps += 1
        assert counted.calls.count("check") <= NEW_IDS_PER_SWEEP
        assert sweeps <= 2 * junk // NEW_IDS_PER_SWEEP + 1, "the buried joiner was never looked for"
    assert monitor.was_seen(buried) and monitor.was_seen(newest)


def test_a_ring_rendezvous_costs_a_few_store_round_trips_whatever_the_ring_size():
    """Forming a ring of N ranks: finding every rank's address and the ready barrier read all ranks' records
    in one batch each (a check, then a multi_get), not a round trip or two per rank: an elastic job forms its
    rings at every outer step, and its store may be a continent away."""
    from prime.comm import rendezvous
    from prime.comm.signed_store import SignedStore

    store = _tcp_store()
    prefix = "rdvn%016x" % random.getrandbits(64)
    ns = rendezvous.namespace("job%08x" % random.getrandbits(32))
    n = random.randrange(6, 13)
    setup = SignedStore(_client(store.port, prefix), SECRET, ns)
    addresses = {r: "127.0.0.%d:%d" % (1 + r, random.randrange(1024, 65535)) for r in range(n)}
    for r in range(1, n):
        setup.put(f"{ns}/addr/{r}", addresses[r])
        setup.put(f"{ns}/ready/{r}", "1", landed=True)  # and every record before it on this connection
    counted = _Counting(_client(store.port, prefix))
    deadline = time.monotonic() + 20
    got = rendezvous.publish_and_find_all(counted, ns, 0, n, addresses[0], deadline, 20000, SECRET)
    assert got == [rendezvous.parse_address(addresses[r]) for r in range(n)]
    assert len(counted.calls) <= 4, counted.calls  # the own address, a check, then a check and a multi_get
    counted.calls.clear()
    rendezvous.barrier(counted, ns, 0, n, deadline, 20000, SECRET)
    assert len(counted.calls) <= 4, counted.calls


def test_a_rank_that_reports_a_failure_stops_the_others_barrier_at_once():
    """A rank that cannot form its links says why (signed): every rank waiting in the barrier raises at once,
    naming it and its reason. A stranger who bumps the failure counter without a signed record stops nobody."""
    from prime.comm import rendezvous
    from prime.comm.errors import CommError

    store = _tcp_store()
    prefix = "rdvf%016x" % random.getrandbits(64)
    ns = rendezvous.namespace("job%08x" % random.getrandbits(32))
    n, bad = 4, random.randrange(1, 4)
    client = _client(store.port, prefix)
    client.add(f"{ns}/failures", 1)  # a stranger's bump, and an unsigned failure record of its own
    client.set(f"{ns}/failed/{bad}", "a stranger says so")
    with pytest.raises(CommError) as timed_out:
        rendezvous.barrier(client, ns, 0, n, time.monotonic() + 1.0, 1000, SECRET)
    assert timed_out.value.kind == "timeout", timed_out.value
    why = "connection refused by %016x" % random.getrandbits(64)
    rendezvous.report_failure(_client(store.port, prefix), ns, bad, why, secret=SECRET)
    t0 = time.monotonic()
    with pytest.raises(CommError) as failed:
        rendezvous.barrier(client, ns, 0, n, time.monotonic() + 20, 20000, SECRET)
    assert time.monotonic() - t0 < 10
    assert failed.value.kind == "peer_failed" and failed.value.peer == bad and why in str(failed.value), failed.value
