"""Time phases and token-weighted averages: the clock of nominal steps (prime.phases) and the average weighted
by the inner steps each node trained (prime.weights), against float64 references, nodes as threads."""

import pytest
import torch
from torch import nn

from prime import DiLoCo
from prime.phases import PhaseClock
from prime.weights import StepWeights, average_factor, contribution_scale, from_limbs, to_limbs
from test_diloco import FakeThreadGroup, FakeThreadRing, TwoParams, one_thread, run_nodes  # noqa: F401
# (one_thread: test_diloco's autouse fixture, one torch thread per test)


class FakeClock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_the_clock_counts_nominal_steps_of_phase_time():
    t = FakeClock()
    c = PhaseClock(inner_steps=10, phase_seconds=5.0, clock=t)  # 0.5 s a nominal step
    c.start(0)
    assert c.reached() == 0
    t.t += 1.24
    assert c.reached() == 2
    c.start(7)  # after a synchronous outer step the clock reads the step it reached
    assert c.reached() == 7
    t.t += 0.5
    assert c.reached() == 8
    # a step is started only when its predicted time ends by the deadline
    assert c.predicted() == 0.0 and c.fits_before(8)
    c.stepped(12.0)  # the run's first step compiles: it predicts nothing
    assert c.predicted() == 0.0
    for s in (0.3, 0.2, 0.9):
        c.stepped(s)
    assert c.predicted() == 0.3  # the median: one slow step does not move it
    assert c.fits_before(9)  # 0 + 0.3 <= 0.5 to the end of nominal step 9
    t.t += 0.25
    assert not c.fits_before(9)  # 0.25 + 0.3 > 0.5
    c.outer()  # after an outer step one step always starts, late or not: a node slower than the window trains
    assert c.fits_before(9)
    c.stepped(0.3)
    assert not c.fits_before(9)
    # a node behind its schedule passes one outer step per inner step only while a step fits in the time between
    # two outer steps (0.3 s against 1 nominal step of 0.5 s); a slower one passes every outer step due
    assert c.keeps_up(1) and c.keeps_up(4)
    for s in (0.9, 0.9, 0.9, 0.9):
        c.stepped(s)
    assert c.predicted() == 0.9 and not c.keeps_up(1) and c.keeps_up(2)
    v = PhaseClock(10, 5.0, clock=t, warmup=False)  # a virtual clock: its first step takes its own time too
    v.stepped(0.4)
    assert v.predicted() == 0.4
    with pytest.raises(ValueError):
        PhaseClock(0, 1.0)
    with pytest.raises(ValueError):
        PhaseClock(10, 0.0)


def test_the_processes_of_a_node_take_their_first_process_decisions():
    """Two processes of one node (FSDP2) read their own clocks, which drift apart; with `agree` both pass the
    same nominal steps and start the same inner steps as the first (a second that stepped while the first passed
    the step would wait for it in FSDP2's collectives forever)."""
    t0, t1 = FakeClock(), FakeClock()
    first = PhaseClock(inner_steps=10, phase_seconds=5.0, clock=t0)
    calls = []

    def agree(values):  # what Environment.from_first returns on the second process: the first's values
        calls.append(list(values))
        return {"reached": [first.reached()], "fits": [float(first.fits_before(3))],
                "keeps": [float(first.keeps_up(1))]}[kind]

    second = PhaseClock(inner_steps=10, phase_seconds=5.0, clock=t1, agree=agree)
    first.start(0), second.start(0)
    t0.t += 1.3  # the first is 0.7 s (more than a nominal step) ahead
    t1.t += 0.6
    kind = "reached"
    assert second.reached() == first.reached() == 2 and calls[-1] == [1]  # its own clock read 1
    for c in (first, second):
        c.stepped(12.0)
        c.stepped(0.3)
    second._steps[-1] = 0.6  # its own prediction: 0.6 s, which would not keep up with one nominal step
    kind = "keeps"
    assert second.keeps_up(1) and calls[-1] == [0.0]
    kind = "fits"  # its own: 0.6 + 0.6 <= 1.5 s, a step would fit; the first's: 1.3 + 0.3 > 1.5, it would not
    assert second.fits_before(3) is first.fits_before(3) is False and calls[-1] == [1.0]


def test_the_weights_arithmetic():
    assert contribution_scale(6, 4) == 1.5 and contribution_scale(0, 4) == 0.0
    assert average_factor([6, 2, 4], 4) == 3 * 4 / 12
    assert average_factor([0, 0], 4) == 0.0  # nobody trained: the average of zeros stays zero
    w = StepWeights([6, 2], 4)
    assert w.weights == [0.75, 0.25] and w.factor == 1.0
    assert StepWeights([0, 0], 4).weights == [0.5, 0.5]
    for n in (0, 1, 65535, 65536, 123456789012, (1 << 48) - 1):
        assert from_limbs(to_limbs(n)) == n and all(p < 1 << 24 for p in to_limbs(n))
    with pytest.raises(ValueError):
        to_limbs(1 << 48)


# Each node's inner steps per phase, as a list of events: "s" a step that passes a nominal step (step(1)), "t" a
# step within one (step(0)), "a" a nominal step without a step (advance()). Every phase passes H = 4 nominal steps.
PHASES = {
    0: ["tstststs", "tttsttstss", "ssss"],  # fast: 8, 10, then 4 steps
    1: ["ssss", "ssss", "ssss"],  # nominal: 4 each
    2: ["sasa", "aaaa", "sasa"],  # slow: 2, none at all, 2
}
H = 4


def _trained(events: str) -> int:
    return sum(1 for e in events if e in "st")


def _run(group_n, make_diloco, deltas, phases=PHASES):
    """Each node runs its events; every inner step moves the model by its own random delta. Returns, per node,
    the weights at the end of each phase, those after finish() last, and the results that synced."""

    def node(r):
        model = TwoParams(torch.zeros(7), torch.zeros(3, 5))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        d = make_diloco(model, opt, r)
        out, synced, i = [], [], 0
        for events in phases[r]:
            for e in events:
                if e == "a":
                    res = d.advance()
                else:
                    opt.step()  # no gradients: changes nothing, but the first one takes the outer weights
                    with torch.no_grad():
                        model.a -= deltas[r][i][0]
                        model.b -= deltas[r][i][1]
                    i += 1
                    res = d.step(1 if e == "s" else 0)
                if res.did_sync:
                    synced.append(res)
            out.append([p.detach().clone() for p in (model.a, model.b)])
        d.finish()
        out.append([p.detach().clone() for p in (model.a, model.b)])
        return out, synced

    return run_nodes(group_n, node)


def _deltas(seed, n=3, steps=40):
    gen = torch.Generator().manual_seed(seed)
    return [[(0.05 * torch.randn(7, generator=gen), 0.05 * torch.randn(3, 5, generator=gen)) for _ in range(steps)]
            for _ in range(n)]


def test_token_weighted_average_matches_a_float64_reference(seed):
    """3 nodes training 8 / 4 / 2 inner steps in one phase, 10 / 4 / 0 in the next and 4 / 4 / 2 in the last:
    each outer step applies sum_i n_i d_i / sum_i n_i with Nesterov, as float64 computes it, and every node
    holds the same bits."""
    lr, mu = 0.7, 0.9
    deltas = _deltas(seed)
    group = FakeThreadGroup(3)

    def make(model, opt, r):
        return DiLoCo(model, opt, FakeThreadRing(group, r), inner_steps=H, outer_lr=lr, outer_momentum=mu,
                      codec="none", block_size=32, weights="tokens")

    results = _run(3, make, deltas)
    w = [torch.zeros(7, dtype=torch.float64), torch.zeros(3, 5, dtype=torch.float64)]
    m = [torch.zeros_like(w[0]), torch.zeros_like(w[1])]
    used = [0, 0, 0]
    for k in range(3):
        counts = [_trained(PHASES[r][k]) for r in range(3)]
        for i in range(2):
            pg = [sum((deltas[r][j][i].double() for j in range(used[r], used[r] + counts[r])),
                      torch.zeros_like(w[i])) for r in range(3)]
            g = sum(c * d for c, d in zip(counts, pg)) / sum(counts)
            m[i] = mu * m[i] + g
            w[i] = w[i] - lr * (g + mu * m[i])
        used = [u + c for u, c in zip(used, counts)]
        for r in range(3):
            res = results[r][1][k]
            assert res.weights.counts == counts, (k, r, res.weights)
            for i in range(2):
                torch.testing.assert_close(results[r][0][k][i].double(), w[i], rtol=1e-5, atol=1e-6,
                                           msg=f"seed {seed} outer step {k + 1} node {r} param {i}")
    for k in range(3):
        for i in range(2):
            assert torch.equal(results[0][0][k][i], results[1][0][k][i])
            assert torch.equal(results[0][0][k][i], results[2][0][k][i])


def test_equal_counts_give_the_equal_weights_bits(seed):
    """Every node training H steps a phase: the token-weighted run's bits are the equal-weights run's (the
    scale and the factor are exactly 1), with int8 on the wire."""
    deltas = _deltas(seed, n=2)
    phases = {0: ["ssss"] * 3, 1: ["ssss"] * 3}
    outs = {}
    for weights in ("equal", "tokens"):
        group = FakeThreadGroup(2)
        outs[weights] = _run(2, lambda model, opt, r: DiLoCo(model, opt, FakeThreadRing(group, r), inner_steps=H,
                                                             codec="int8", block_size=32, weights=weights),
                             deltas, phases)
    for r in range(2):
        for k in range(3):
            for a, b in zip(outs["equal"][r][0][k], outs["tokens"][r][0][k]):
                assert torch.equal(a, b), f"seed {seed} node {r} outer step {k + 1}"
        assert all(res.weights is None for res in outs["equal"][r][1])
        assert all(res.weights.counts == [4, 4] for res in outs["tokens"][r][1])


@pytest.mark.parametrize("overlap,fragments", [(True, 1), (True, 2), (False, 2)])
def test_weights_with_overlap_and_fragments_keep_the_nodes_identical(seed, overlap, fragments):
    """Weighted averages behind overlap (the counts go with the average in flight) and per fragment (each
    fragment weighs the inner steps since its own last outer step): every node ends with the same bits."""
    deltas = _deltas(seed)
    group = FakeThreadGroup(3)

    def make(model, opt, r):
        return DiLoCo(model, opt, FakeThreadRing(group, r), inner_steps=H, codec="int8", block_size=32,
                      weights="tokens", overlap=overlap, fragments=fragments,
                      overlap_scheme="eager" if fragments > 1 else "eager-merge")

    results = _run(3, make, deltas)
    for i in range(2):  # after finish() (before it, each node's local weights hold its own inner steps)
        assert torch.equal(results[0][0][-1][i], results[1][0][-1][i]), (seed, i)
        assert torch.equal(results[0][0][-1][i], results[2][0][-1][i]), (seed, i)
    counted = [res.weights.counts for res in results[0][1] if res.weights is not None]
    assert counted, "no weighted average was applied"
    if fragments == 1:  # overlap: the results report the average applied, one phase later
        assert counted[0] == [8, 4, 2]


def test_the_count_is_state():
    """A checkpoint mid-phase keeps each fragment's count of inner steps trained since its last outer step."""
    group = FakeThreadGroup(1)
    model = nn.Linear(4, 3)
    d = DiLoCo(model, None, FakeThreadRing(group, 0), inner_steps=4, codec="none", weights="tokens",
               fragments=2, check_replicas=False)
    for n in (1, 0, 0, 1):
        d.step(n)
    sd = d.state_dict()
    assert [f["trained"] for f in sd["fragments"]] == [0, 4]  # fragment 0 synced at nominal step 2
    d2 = DiLoCo(nn.Linear(4, 3), None, FakeThreadRing(FakeThreadGroup(1), 0), inner_steps=4, codec="none",
                weights="tokens", fragments=2, check_replicas=False)
    d2.load_state_dict(sd)
    assert [f.trained for f in d2.fragments] == [0, 4]
    assert d2.steps_to_sync == 2


def test_bad_weights_are_refused():
    model = nn.Linear(4, 3)
    with pytest.raises(ValueError, match="weights must be one of equal, tokens"):
        DiLoCo(model, None, FakeThreadRing(FakeThreadGroup(1), 0), weights="speed")
    d = DiLoCo(model, None, FakeThreadRing(FakeThreadGroup(1), 0), codec="none", check_replicas=False)
    with pytest.raises(ValueError, match="nominal_steps must be 0 or 1"):
        d.step(2)
