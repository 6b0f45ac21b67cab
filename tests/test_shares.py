"""Nodes that run different numbers of processes (prime.shares): the rows each ring carries, and a one-process
node on every ring beside a node of two, against a float64 reference of the token-weighted average, nodes and
processes as threads."""

import pytest
import torch

from prime import DiLoCo
from prime.shares import DiLoCoRings, MemberGroup, Shares, chunk_rows, combine_results, parse_procs
from prime.fragments import OuterStepResult
from test_diloco import FakeThreadGroup, FakeThreadRing, TwoParams, one_thread, run_nodes  # noqa: F401


def test_rows_are_cut_as_torch_chunk_cuts_them(seed):
    """chunk_rows is FSDP2's cut of dim 0 (torch.chunk, empty chunks last) for random sizes and counts."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(200):
        d, n = int(torch.randint(0, 40, (1,), generator=gen)), int(torch.randint(1, 9, (1,), generator=gen))
        rows = torch.arange(d)
        chunks = list(torch.chunk(rows, n)) if d else []
        chunks += [rows[:0]] * (n - len(chunks))
        for i, c in enumerate(chunks):
            a, b = chunk_rows(d, n, i)
            assert torch.equal(rows[a:b], c), (d, n, i)


def test_process_counts_are_checked_with_the_field_named():
    assert parse_procs("2,1", 2) == [2, 1]
    assert parse_procs("3", 3) == [3, 3, 3]
    assert parse_procs("4,1,4", 3) == [4, 1, 4]
    with pytest.raises(ValueError, match="nodes.procs gives 3 process counts for 2 nodes"):
        parse_procs("2,1,1", 2)
    with pytest.raises(ValueError, match="either the most processes of any node"):
        parse_procs("4,2", 2)
    with pytest.raises(ValueError, match="at least one process"):
        parse_procs("2,0", 2)
    with pytest.raises(ValueError, match="comma-separated"):
        parse_procs("2;1", 2)
    with pytest.raises(ValueError, match="launched with 2"):
        Shares.of("2,1", 2, 1, 0, 2)


def test_which_rings_a_process_takes_part_in():
    two, one = Shares([2, 1], 0, 1), Shares([2, 1], 1, 0)
    assert (two.rings, two.mine, two.step_weight, two.uneven) == (2, [1], 2, True)
    assert (one.rings, one.mine, one.step_weight) == (2, [0, 1], 1)
    equal = Shares([3, 3], 1, 2)
    assert (equal.mine, equal.step_weight, equal.uneven) == ([2], 1, False)
    w = torch.arange(21.0).view(7, 3)
    assert torch.equal(one.view(0)(w), w[:4]) and torch.equal(one.view(1)(w), w[4:])
    one.view(1)(w)[0, 0] = -1.0  # a view: the outer step writes through it into the parameter
    assert w[4, 0] == -1.0


H = 4
# Inner steps of each node in each of three phases (steps phases: every node H; the weights are its tokens)
PHASES = 3


def _deltas(seed, steps=H * PHASES):
    gen = torch.Generator().manual_seed(seed)
    return [[(0.05 * torch.randn(7, generator=gen), 0.05 * torch.randn(3, 5, generator=gen)) for _ in range(steps)]
            for _ in range(2)]  # [node][step]: node 0's delta of the whole model, split by rows among its processes


@pytest.mark.parametrize("codec", ["none", "int8"])
def test_a_one_process_node_on_every_ring_matches_a_float64_reference(seed, codec):
    """Node 0 runs 2 processes (rows chunk 0 and 1 of 2 of each parameter: FSDP2's shards), node 1 one process
    on both rings (DiLoCoRings, one DiLoCo per ring over its rows, their all-reduces side by side). Each outer
    step averages the nodes' pseudo-gradients weighted by their tokens (2 : 1); the rows of every process of
    node 0 are node 1's rows bit for bit after every outer step, and (exact codec) float64's average."""
    lr, mu = 0.7, 0.9
    deltas = _deltas(seed)
    rings = [FakeThreadGroup(2), FakeThreadGroup(2)]  # ring g: node 0's process g (rank 0), node 1 (rank 1)
    cut = Shares([2, 1], 1, 0)

    def make(model, opt, ring, **kw):
        return DiLoCo(model, opt, ring, inner_steps=H, outer_lr=lr, outer_momentum=mu, codec=codec, block_size=32,
                      weights="tokens", rings=2, **kw)

    def node0_process(g):
        rows = [chunk_rows(7, 2, g), chunk_rows(3, 2, g)]
        model = TwoParams(torch.zeros(rows[0][1] - rows[0][0]), torch.zeros(rows[1][1] - rows[1][0], 5))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        d = make(model, opt, FakeThreadRing(rings[g], 0), step_weight=2)
        out = []
        for k in range(H * PHASES):
            opt.step()
            with torch.no_grad():
                model.a -= deltas[0][k][0][rows[0][0]:rows[0][1]]
                model.b -= deltas[0][k][1][rows[1][0]:rows[1][1]]
            r = d.step()
            if r.did_sync:
                out.append((r, [model.a.detach().clone(), model.b.detach().clone()]))
        d.close()
        return out

    def node1():
        model = TwoParams(torch.zeros(7), torch.zeros(3, 5))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        d = DiLoCoRings([make(model, opt, FakeThreadRing(rings[g], 1), shard=cut.view(g)) for g in (0, 1)], [0, 1])
        out = []
        for k in range(H * PHASES):
            opt.step()
            with torch.no_grad():
                model.a -= deltas[1][k][0]
                model.b -= deltas[1][k][1]
            r = d.step()
            if r.did_sync:
                out.append((r, [model.a.detach().clone(), model.b.detach().clone()]))
        d.close()
        return out

    res = run_nodes(3, lambda i: node0_process(i) if i < 2 else node1())
    w = [torch.zeros(7, dtype=torch.float64), torch.zeros(3, 5, dtype=torch.float64)]
    m = [torch.zeros_like(w[0]), torch.zeros_like(w[1])]
    assert [len(r) for r in res] == [PHASES] * 3
    for k in range(PHASES):
        for i in range(2):
            pg = [sum((deltas[n][j][i].double() for j in range(k * H, (k + 1) * H)), torch.zeros_like(w[i]))
                  for n in (0, 1)]
            g = (2 * H * pg[0] + H * pg[1]) / (3 * H)  # tokens: node 0 trains twice node 1's per step
            m[i] = mu * m[i] + g
            w[i] = w[i] - lr * (g + mu * m[i])
        r1, whole = res[2][k]
        for g_ in (0, 1):
            r0, shard = res[g_][k]
            assert r0.weights.counts == [2 * H, H] and r1.weights.counts == [2 * H, H]
            for i, size in enumerate((7, 3)):
                a, b = chunk_rows(size, 2, g_)
                assert torch.equal(shard[i], whole[i][a:b]), (k, g_, i)  # every ring's rows: the same bits
        for i in range(2):
            if codec == "none":
                torch.testing.assert_close(whole[i].double(), w[i], rtol=1e-5, atol=1e-6,
                                           msg=f"seed {seed} outer step {k + 1} param {i}")
        assert r1.numel == sum(res[g_][k][0].numel for g_ in (0, 1))  # node 1 all-reduced both rings' values


def test_the_rings_state_is_saved_and_loaded_per_ring():
    model = TwoParams(torch.randn(7), torch.randn(3, 5))
    cut = Shares([2, 1], 1, 0)

    def rings(m):  # a group of its own per ring: the rings average at the same time, on threads
        return DiLoCoRings([DiLoCo(m, None, FakeThreadRing(FakeThreadGroup(1), 0), inner_steps=2, codec="none",
                                   weights="tokens", shard=cut.view(g), rings=2) for g in (0, 1)], [0, 1])

    d = rings(model)
    for _ in range(3):
        d.step()
    sd = d.state_dict()
    assert sorted(sd["rings"]) == [0, 1] and sd["rings"][1]["outer_step"] == 1
    other = TwoParams(torch.zeros(7), torch.zeros(3, 5))
    e = rings(other)
    e.load_state_dict(sd)
    assert torch.equal(e.outer_weights(), d.outer_weights()) and e.outer_step == d.outer_step == 1
    assert e.weights_hash() == d.weights_hash()
    with pytest.raises(ValueError, match="nodes.procs must be the same"):
        e.load_state_dict(sd["rings"][0])
    d.close()
    e.close()


def test_results_of_the_rings_combine():
    a = OuterStepResult(True, 4, 1, numel=10, allreduce_s=1.0, outer_s=2.0, bytes_sent=100, pseudo_grad_norm=3.0,
                        compression_error=0.01)
    b = OuterStepResult(True, 4, 1, numel=6, allreduce_s=1.5, outer_s=1.0, bytes_sent=50, pseudo_grad_norm=4.0,
                        compression_error=0.02)
    c = combine_results([a, b])
    assert (c.numel, c.allreduce_s, c.outer_s, c.bytes_sent, c.pseudo_grad_norm) == (16, 1.5, 2.0, 150, 5.0)
    assert c.compression_error == pytest.approx(((0.03) ** 2 + (0.08) ** 2) ** 0.5 / 5.0)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_ring_that_fails_is_retried_on_every_ring_of_both_nodes(seed, overlap):
    """Ring 1's first average fails (on both of its members); ring 0's works. Node 0's two processes agree on
    failures (their node's group), and so do node 1's two rings (MemberGroup): every ring is retried together,
    none applies an average another retries, and the rows stay identical on every ring, bit for bit."""
    deltas = _deltas(seed)
    fail_at = 1 if overlap else 0  # (with overlap the first call is the counts' exchange: fail the average)
    rings = [FakeThreadGroup(2), FakeThreadGroup(2, fail_calls={fail_at})]
    node0, node1 = MemberGroup(2, 60), MemberGroup(2, 60)
    cut = Shares([2, 1], 1, 0)

    def make(model, opt, g, rank, group, **kw):
        return DiLoCo(model, opt, FakeThreadRing(rings[g], rank), inner_steps=H, codec="int8", block_size=32,
                      weights="tokens", rings=2, overlap=overlap, local_group=group,
                      ring_factory=lambda tag: FakeThreadRing(rings[g], rank, tag), retries=2, **kw)

    def run(i):
        if i < 2:
            r_ = [chunk_rows(7, 2, i), chunk_rows(3, 2, i)]
            model = TwoParams(torch.zeros(r_[0][1] - r_[0][0]), torch.zeros(r_[1][1] - r_[1][0], 5))
            d = make(model, None, i, 0, node0, step_weight=2)
            out = _train_rows(model, d, deltas[0], r_)
        else:
            model = TwoParams(torch.zeros(7), torch.zeros(3, 5))
            d = DiLoCoRings([make(model, None, g, 1, node1, shard=cut.view(g)) for g in (0, 1)], [0, 1])
            out = _train_rows(model, d, deltas[1], None)
        d.close()
        return out

    res = run_nodes(3, run)
    whole = res[2][1]
    for g in (0, 1):
        for i, size in enumerate((7, 3)):
            a, b = chunk_rows(size, 2, g)
            assert torch.equal(res[g][1][i], whole[i][a:b]), (g, i)
    built = [sorted(t for _, t in r.rings_built) for r in rings]
    assert built[0] == built[1] and len(built[0]) == 4, built  # both rings rebuilt once, on both of their members


def _train_rows(model, d, deltas, rows):
    """Inner steps moving the model (its rows `rows` of the whole deltas, or the whole) then finish()."""
    attempts = []
    for k in range(H * PHASES):
        with torch.no_grad():
            da, db = deltas[k]
            if rows is not None:
                da, db = da[rows[0][0]:rows[0][1]], db[rows[1][0]:rows[1][1]]
            model.a -= da
            model.b -= db
        r = d.step()
        if r.did_sync:
            attempts.append(r.attempts)
    d.finish()
    return attempts, [model.a.detach().clone(), model.b.detach().clone()]


def test_the_rings_agreement_ands_the_flags_and_a_failed_ring_releases_the_others():
    """MemberGroup: every member gets the AND of all flags, round after round; when one member fails outside the
    agreement, `each` aborts it and the others leave at once (not after the agreement's timeout)."""
    import concurrent.futures
    import time

    from prime.shares import each

    group = MemberGroup(3, timeout_s=60)
    pool = concurrent.futures.ThreadPoolExecutor(3)
    flags = [[True, True, True], [True, False, True], [True, True, True]]
    got = each(pool, lambda i: [group.all_min(flags[k][i]) for k in range(3)], [0, 1, 2])
    assert got == [[True, False, True]] * 3
    # small integers (prime.sync.min_local: a decision learned or not, and which, in one agreement): their MIN
    codes = [[2, 2, 2], [2, 1, 2], [1, 0, 2]]
    got = each(pool, lambda i: [group.all_min(codes[i][k]) for k in range(3)], [0, 1, 2])
    assert got == [[1, 0, 2]] * 3

    def member(i):
        if i == 2:
            raise ValueError("a bug in ring 2")
        return group.all_min(True)

    t0 = time.monotonic()
    with pytest.raises(ValueError, match="a bug in ring 2"):
        each(pool, member, [0, 1, 2], group)
    assert time.monotonic() - t0 < 10
    with pytest.raises(RuntimeError, match="another ring of this node failed: ValueError: a bug in ring 2"):
        group.background.all_min(True)
    pool.shutdown()
