"""What the ranks of a ring know about their links, and the decisions taken from it.

    table = LinkTable.from_rows(rows)            # rows[i] = rank i's measurements
    order = plan_order(table)                    # the ring order: its slowest link as fast as possible
    choose_schedule(table, order, nbytes, seg)   # "ring" or "direct" for one collective

Every rank measures its links while the ring forms (the round trip of each TCP connect
and handshake) and keeps what running collectives showed (rates, round trips; see
Ring.link_history). At formation each rank publishes its row, signed, in the store; rank
0 merges the rows into one table, plans the order and publishes both, signed; every rank
then uses rank 0's table, so decisions taken from it (the order, the schedule of each
collective) are the same on every rank without further messages.

The functions below are pure: tested in milliseconds (tests/test_links.py).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Optional, Sequence

__all__ = ["LinkTable", "plan_order", "ring_cost", "choose_schedule", "predict_times", "brute_force_order",
           "EXACT_ORDER_MAX"]

# Up to this many ranks plan_order is exact (a dynamic program over subsets, about 0.1 s
# at 10); beyond, a heuristic (see plan_order).
EXACT_ORDER_MAX = 10
# Rates within this factor count as equal when comparing rings' slowest links: a rate
# measured on a loaded host varies by a few percent, which must not outweigh the delays.
RATE_TOLERANCE = 0.8
# The link rate assumed where none is known (the ring's links assume it too, tcp/tuning.h).
ASSUMED_RATE = 1e9 / 8
# The direct schedule's uplinks carry N-1 TCP flows at once; they ran at this share of the
# ring's one flow per uplink on emulated 1 Gbit/s links (4 ranks, 64 and 256 MiB,
# benchmarks/RESULTS.md, "Schedules").
DIRECT_EFFICIENCY = 0.9
# The rank order is kept unless the planned ring's delays are shorter by more than this
# (seconds, or the share below): round trips of microseconds on one host are noise.
DELAY_TOLERANCE_S = 0.001
DELAY_TOLERANCE_SHARE = 0.05


@dataclass(frozen=True)
class LinkTable:
    """rtt_s[i][j]: round trip between ranks i and j in seconds (symmetric; -1 unknown).
    rate[i][j]: bytes/s measured from i to j (0: unknown)."""

    rtt_s: tuple
    rate: tuple

    @property
    def n(self) -> int:
        return len(self.rtt_s)

    @classmethod
    def from_rows(cls, rtt_rows: Sequence[Sequence[float]], rate_rows: Optional[Sequence[Sequence[float]]] = None
                  ) -> "LinkTable":
        """Merges what each rank measured: the round trip of a pair is the smaller of its two
        measurements (queueing only adds), a rate the one its sender measured."""
        n = len(rtt_rows)
        if any(len(row) != n for row in rtt_rows):
            raise ValueError(f"every rank's row must hold {n} round trips")
        rate_rows = rate_rows or [[0.0] * n for _ in range(n)]

        def rtt(i, j):
            seen = [x for x in (rtt_rows[i][j], rtt_rows[j][i]) if x is not None and x > 0]
            return min(seen) if seen else -1.0

        return cls(tuple(tuple(0.0 if i == j else rtt(i, j) for j in range(n)) for i in range(n)),
                   tuple(tuple(0.0 if i == j else max(0.0, float(rate_rows[i][j] or 0)) for j in range(n))
                         for i in range(n)))

    def to_json(self) -> dict:
        return {"rtt_s": [list(r) for r in self.rtt_s], "rate": [list(r) for r in self.rate]}

    @classmethod
    def from_json(cls, d: dict) -> "LinkTable":
        return cls(tuple(tuple(float(x) for x in r) for r in d["rtt_s"]),
                   tuple(tuple(float(x) for x in r) for r in d["rate"]))

    def known_rate(self, i: int, j: int) -> Optional[float]:
        r = self.rate[i][j]
        return r if r > 0 else None

    def delay(self, i: int, j: int) -> float:
        """One-way delay i -> j (half the round trip; 0 when unknown)."""
        return max(0.0, self.rtt_s[i][j]) / 2


def ring_cost(table: LinkTable, order: Sequence[int]) -> tuple:
    """(slowest link's rate, sum of the ring's one-way delays) of a ring order. Unknown
    rates count as infinitely fast: they cannot tell rings apart."""
    n = len(order)
    slowest = math.inf
    delay = 0.0
    for p in range(n):
        a, b = order[p], order[(p + 1) % n]
        r = table.known_rate(a, b)
        if r is not None:
            slowest = min(slowest, r)
        delay += table.delay(a, b)
    return slowest, delay


def _better(cost_a: tuple, cost_b: tuple) -> bool:
    """Is ring cost a better than b: a faster slowest link (beyond RATE_TOLERANCE), else less delay."""
    ra, da = cost_a
    rb, db = cost_b
    if ra != rb and not (math.isinf(ra) and math.isinf(rb)):
        lo, hi = min(ra, rb), max(ra, rb)
        if lo < RATE_TOLERANCE * hi:
            return ra > rb
    return da < db - 1e-12


def brute_force_order(table: LinkTable) -> list:
    """The best order by trying every ring (rank 0 first; (n-1)! orders): the reference the
    heuristics are measured against."""
    n = table.n
    best, best_cost = None, None
    for rest in itertools.permutations(range(1, n)):
        order = [0, *rest]
        cost = ring_cost(table, order)
        if best is None or _better(cost, best_cost):
            best, best_cost = order, cost
    return best


def _min_delay_cycle(table: LinkTable, allowed) -> Optional[list]:
    """The ring of least total delay using only allowed(a, b) links (exact, O(2^n n^2)), or None."""
    n = table.n
    full = (1 << n) - 1
    inf = math.inf
    # dp[mask][v]: least delay of a path 0 -> ... -> v visiting exactly the ranks in mask
    dp = [[inf] * n for _ in range(1 << n)]
    parent = [[-1] * n for _ in range(1 << n)]
    dp[1][0] = 0.0
    for mask in range(1, 1 << n):
        if not mask & 1:
            continue
        row = dp[mask]
        for v in range(n):
            cur = row[v]
            if cur == inf:
                continue
            for w in range(1, n):
                if mask >> w & 1 or not allowed(v, w):
                    continue
                nm = mask | (1 << w)
                val = cur + table.delay(v, w)
                if val < dp[nm][w]:
                    dp[nm][w] = val
                    parent[nm][w] = v
    best, last = inf, -1
    for v in range(1, n):
        if dp[full][v] < inf and allowed(v, 0):
            val = dp[full][v] + table.delay(v, 0)
            if val < best:
                best, last = val, v
    if last < 0:
        return None
    order, mask, v = [], full, last
    while v != -1:
        order.append(v)
        pv = parent[mask][v]
        mask &= ~(1 << v)
        v = pv
    return order[::-1]


def _heuristic_order(table: LinkTable) -> list:
    """Greedy nearest neighbour from every start, then 2-opt moves while they improve."""
    n = table.n

    def key(a, b):  # prefer fast, then close
        r = table.known_rate(a, b)
        return (-(r if r is not None else math.inf), table.delay(a, b))

    best, best_cost = None, None
    for start in range(n):
        order, left = [start], set(range(n)) - {start}
        while left:
            nxt = min(left, key=lambda b: key(order[-1], b))
            order.append(nxt)
            left.remove(nxt)
        improved = True
        cost = ring_cost(table, order)
        while improved:
            improved = False
            for i in range(1, n - 1):
                for j in range(i + 1, n):
                    cand = order[:i] + order[i:j + 1][::-1] + order[j + 1:]
                    c = ring_cost(table, cand)
                    if _better(c, cost):
                        order, cost, improved = cand, c, True
        if best is None or _better(cost, best_cost):
            best, best_cost = order, cost
    k = best.index(0)
    return best[k:] + best[:k]


def plan_order(table: LinkTable) -> list:
    """The ring order whose slowest link is the fastest (rates within RATE_TOLERANCE count as
    equal), and among those the one with the least total delay; the rank order when it is
    as good (within RATE_TOLERANCE and DELAY_TOLERANCE_*). Exact up to EXACT_ORDER_MAX ranks
    (for every candidate bottleneck, the least-delay ring over links at least that fast),
    a heuristic beyond (tests/test_links.py measures it against brute force). Rank 0
    comes first."""
    n = table.n
    if n <= 3:
        return list(range(n))  # every ring of 3 or fewer is the same ring (or its mirror)
    best = _heuristic_order(table) if n > EXACT_ORDER_MAX else _exact_order(table)
    rate_b, delay_b = ring_cost(table, best)
    rate_r, delay_r = ring_cost(table, list(range(n)))
    as_fast = rate_r == rate_b or (not math.isinf(rate_b) and rate_r >= RATE_TOLERANCE * rate_b)
    if as_fast and delay_r <= delay_b + max(DELAY_TOLERANCE_S, DELAY_TOLERANCE_SHARE * delay_b):
        return list(range(n))
    return best


def _exact_order(table: LinkTable) -> list:
    rates = sorted({r for row in table.rate for r in row if r > 0}, reverse=True)
    # Try bottlenecks from the fastest down; the first that admits a ring wins, and links
    # within RATE_TOLERANCE of it count as just as fast.
    for floor in rates:
        order = _min_delay_cycle(table, lambda a, b: (table.rate[a][b] <= 0) or table.rate[a][b] >= RATE_TOLERANCE * floor)
        if order is not None:
            return order
    return _min_delay_cycle(table, lambda a, b: True)


def predict_times(table: LinkTable, order: Sequence[int], encoded_bytes: float, segment_bytes: float) -> dict:
    """Predicted seconds of one all-reduce in each schedule, for a tensor of `encoded_bytes`
    on the wire (the codec's bytes of the whole tensor) cut into segments of `segment_bytes`.

    ring    2(N-1) steps; in each, every link sends a chunk (1/N of the tensor), and a
            segment can go on only once it arrived: a step lasts the longer of sending a
            chunk and one hop of a segment (delay + its sending time), so the delays hide
            behind chunks that take longer to send than they take to cross; plus the last
            segment's delay.
    direct  every rank sends 2/N of the tensor to each peer (its contribution, then the
            owner's result), all pairs at once, through its uplink (taken to be no faster
            than its fastest link: parallel paths are not counted on), at DIRECT_EFFICIENCY
            of the ring's rate (several flows share the uplink; measured); the owner can
            send its result only once the contributions arrived (half the bytes, plus the
            longest delay); plus the longest delay.
    Rates: the table's; unknown ones as slow as the slowest known one, or ASSUMED_RATE."""
    n = table.n
    rates = [r for row in table.rate for r in row if r > 0]
    fill = min(rates) if rates else ASSUMED_RATE
    rate = [[(table.rate[i][j] if table.rate[i][j] > 0 else fill) for j in range(n)] for i in range(n)]
    chunk = encoded_bytes / n
    links = [(order[p], order[(p + 1) % n]) for p in range(n)]
    ring_rate = min(rate[a][b] for a, b in links)
    ring_delay = max(table.delay(a, b) for a, b in links)
    step = max(chunk / ring_rate, ring_delay + segment_bytes / ring_rate)
    ring = 2 * (n - 1) * step + ring_delay
    longest = max(table.delay(i, j) for i in range(n) for j in range(n) if i != j)
    uplink = max(max(max(2 * chunk / rate[i][j] for j in range(n) if j != i),
                     2 * chunk * (n - 1) / max(rate[i][j] for j in range(n) if j != i))
                 for i in range(n)) / DIRECT_EFFICIENCY
    direct = max(uplink, uplink / 2 + longest + segment_bytes / fill) + longest
    return {"ring": ring, "direct": direct}


def choose_schedule(table: LinkTable, order: Sequence[int], encoded_bytes: float, segment_bytes: float) -> str:
    """"ring" or "direct" for one all-reduce: the one predict_times finds faster (the ring on
    a tie: it is what every rank ran before there was a choice). Two ranks run the same two
    hops either way: "direct", whose owner keeps its own values exact."""
    if table.n <= 2:
        return "direct"
    t = predict_times(table, order, encoded_bytes, segment_bytes)
    return "direct" if t["direct"] < t["ring"] else "ring"
