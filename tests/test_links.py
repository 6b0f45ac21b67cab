"""The decisions taken from the link table (prime.comm.links): the ring order against brute
force, the schedule against the predicted times, and the streams a link opens
(prime._C's plan, csrc/ring/tcp/tuning.h). Pure functions: milliseconds, no sockets."""

import itertools
import math
import random

import pytest

from prime.comm.links import (DELAY_TOLERANCE_S, DELAY_TOLERANCE_SHARE, EXACT_ORDER_MAX, LinkTable,
                              brute_force_order, choose_schedule, plan_order, predict_times, ring_cost)

SEED = random.SystemRandom().randrange(1 << 30)
GBIT = 1e9 / 8


@pytest.fixture(autouse=True)
def _print_seed():
    print(f"test_links SEED={SEED}")


def regions(region_of, intra=(10 * GBIT, 0.002), inter=(GBIT, 0.100)):
    n = len(region_of)
    pick = lambda i, j: intra if region_of[i] == region_of[j] else inter  # noqa: E731
    return LinkTable.from_rows([[0 if i == j else pick(i, j)[1] for j in range(n)] for i in range(n)],
                               [[0 if i == j else pick(i, j)[0] for j in range(n)] for i in range(n)])


def uniform(n, rtt, rate=0.0):
    return LinkTable.from_rows([[0 if i == j else rtt for j in range(n)] for i in range(n)],
                               [[0 if i == j else rate for j in range(n)] for i in range(n)])


def test_table_merges_what_both_ends_measured():
    t = LinkTable.from_rows([[0, 0.010, -1], [0.012, 0, 0.5], [0.3, 0.4, 0]], [[0, 5, 0], [0, 0, 0], [1, 0, 0]])
    assert t.rtt_s[0][1] == t.rtt_s[1][0] == 0.010  # the smaller of the two
    assert t.rtt_s[0][2] == 0.3  # one side did not measure it
    assert t.rate[0][1] == 5 and t.rate[1][0] == 0 and t.rate[2][0] == 1  # rates are directed
    assert LinkTable.from_json(t.to_json()) == t
    with pytest.raises(ValueError, match="2 round trips"):
        LinkTable.from_rows([[0, 1], [0, 1, 2]])


def test_two_regions_numbered_alternately_get_two_crossings():
    t = regions([i % 2 for i in range(6)])
    order = plan_order(t)
    crossings = sum(order[p] % 2 != order[(p + 1) % 6] % 2 for p in range(6))
    assert crossings == 2, order
    assert ring_cost(t, order) == ring_cost(t, brute_force_order(t))
    assert ring_cost(t, list(range(6)))[1] == pytest.approx(0.3)  # the rank order crosses six times
    assert order[0] == 0


def test_equal_links_keep_the_rank_order():
    """Round trips of microseconds on one host are noise: no reshuffle."""
    rng = random.Random(SEED)
    t = LinkTable.from_rows([[0 if i == j else 2e-5 + 1e-5 * rng.random() for j in range(8)] for i in range(8)])
    assert plan_order(t) == list(range(8))


@pytest.mark.parametrize("n", [4, 5, 6, 7, 8])
def test_planned_order_is_the_best_on_random_tables(n):
    """Exact up to EXACT_ORDER_MAX ranks: the same cost as trying every ring (the rank order
    may be kept when it is within the delay tolerance of the best)."""
    rng = random.Random(SEED + n)
    for _ in range(10):
        rtt = [[0.0] * n for _ in range(n)]
        rate = [[0.0] * n for _ in range(n)]
        for i, j in itertools.combinations(range(n), 2):
            rtt[i][j] = rtt[j][i] = rng.choice([0.001, 0.02, 0.05, 0.1, 0.2]) * (1 + 0.1 * rng.random())
            rate[i][j] = rate[j][i] = rng.choice([0.1, 1, 2.5, 10]) * GBIT
        t = LinkTable.from_rows(rtt, rate)
        best = ring_cost(t, brute_force_order(t))
        got = ring_cost(t, plan_order(t))
        slack = max(DELAY_TOLERANCE_S, DELAY_TOLERANCE_SHARE * best[1]) + 1e-9
        assert got[0] == best[0] and got[1] <= best[1] + slack, (got, best, f"SEED={SEED}")


def test_heuristic_beyond_the_exact_size_stays_close():
    """Above EXACT_ORDER_MAX the heuristic: measured here against the exact program on
    tables it can still solve (its slowest link never slower, its delay within 20%)."""
    import prime.comm.links as links

    rng = random.Random(SEED)
    worst = 0.0
    for _ in range(5):
        n = 9
        t = regions([rng.randrange(3) for _ in range(n)], inter=(rng.choice([0.5, 1]) * GBIT, 0.08))
        exact = ring_cost(t, links._exact_order(t))
        heur = ring_cost(t, links._heuristic_order(t))
        assert heur[0] >= 0.8 * exact[0]
        worst = max(worst, heur[1] / exact[1] - 1)
    assert worst <= 0.2, f"heuristic {100 * worst:.0f}% more delay than the exact order (SEED={SEED})"
    big = regions([i % 3 for i in range(EXACT_ORDER_MAX + 6)])
    order = plan_order(big)
    assert sorted(order) == list(range(EXACT_ORDER_MAX + 6))
    assert ring_cost(big, order)[1] == pytest.approx(3 * 0.05 + (EXACT_ORDER_MAX + 3) * 0.001)


def test_schedule_follows_delay_and_size():
    """The predictions behind the choice (4 ranks, int8 of 64 / 256 MiB fp32, 1 Gbit/s)."""
    seg = 262144 * 1.0156
    mib = lambda m: m * (1 << 20) / 4 * 1.0156  # noqa: E731
    for rtt, size, want in [(0.0001, 64, "ring"), (0.1, 64, "direct"), (0.2, 64, "direct"), (0.1, 4, "direct"),
                            (0.2, 256, "ring")]:
        t = uniform(4, rtt, GBIT)
        assert choose_schedule(t, list(range(4)), mib(size), seg) == want, (rtt, size, predict_times(
            t, list(range(4)), mib(size), seg))
    # The ring's delays hide behind chunks that take longer to send than to cross.
    p = predict_times(uniform(4, 0.1, GBIT), list(range(4)), mib(256), seg)
    assert p["ring"] == pytest.approx(6 * mib(256) / 4 / GBIT + 0.05)
    assert choose_schedule(uniform(2, 0.1), [0, 1], mib(64), seg) == "direct"  # two ranks: the same hops


def test_ring_avoids_a_slow_pair_the_direct_schedule_must_use():
    """One pair 20x slower than the rest: the ring goes round it, the direct schedule cannot."""
    t = uniform(4, 0.01, GBIT)
    rate = [list(r) for r in t.rate]
    rate[0][2] = rate[2][0] = GBIT / 20
    t = LinkTable(t.rtt_s, tuple(tuple(r) for r in rate))
    order = plan_order(t)
    assert {frozenset((order[p], order[(p + 1) % 4])) for p in range(4)}.isdisjoint({frozenset((0, 2))})
    assert choose_schedule(t, order, 64 << 20, 262144) == "ring"
    assert math.isinf(ring_cost(uniform(3, 0.01), [0, 1, 2])[0])  # no rates known: no bottleneck
