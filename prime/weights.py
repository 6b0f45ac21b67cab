"""Token-weighted averages: each node's pseudo-gradient counts by the inner steps it trained.

With time phases (diloco.phase = "time", docs/heterogeneous.md) a fast node runs
more inner steps in a phase than a slow one. The outer step then averages

    avg = sum_i n_i d_i / sum_i n_i

over the nodes i of the average, where d_i is node i's pseudo-gradient of a
fragment and n_i the inner steps it trained since that fragment's last outer
step (every node trains the same tokens per inner step, so steps weigh as
tokens do). The ring averages with equal weights, so each node sends its
pseudo-gradient scaled by s_i = n_i / H (H: inner_steps, the same on every
node; about 1 for a node of nominal speed), before error feedback adds its
residual, and every node multiplies the ring's average by

    f = N H / sum_i n_i        (N: the nodes whose pseudo-gradient is in it)

(a node that joins at this outer step receives the average and applies the
same f). Error feedback carries its residual in these scaled units from one
outer step to the next.

The counts n_i travel over the ring itself (RingSync.exchange: authenticated,
exact), so every node computes the same f from the same integers, and applies
the same bits. A node with n_i = 0 (it trained nothing in the window) sends
zeros; when no node trained, f = 0 and the average is zero. With equal counts
s_i = f = 1: multiplying by one changes no bit.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["WEIGHTINGS", "StepWeights", "Weighing", "contribution_scale", "average_factor"]

WEIGHTINGS = ("equal", "tokens")
"""DiLoCo(weights=): equal (every node's pseudo-gradient counts alike) or tokens (by the inner steps it trained)."""

_LIMB = 1 << 16
LIMBS = 3
"""16-bit pieces a count travels in (counts below 2^48 inner steps)."""


def contribution_scale(trained: int, inner_steps: int) -> float:
    """s_i: what this node's pseudo-gradient is multiplied by before error feedback and the ring."""
    return trained / inner_steps


def average_factor(counts: list, inner_steps: int) -> float:
    """f: what every node multiplies the ring's average by (the same float from the same integers everywhere)."""
    total = sum(counts)
    return len(counts) * inner_steps / total if total > 0 else 0.0


def to_limbs(n: int) -> list:
    """n (0 <= n < 2^48) as 16-bit pieces, for RingSync.exchange (each below 2^24)."""
    if not 0 <= n < _LIMB ** LIMBS:
        raise ValueError(f"an inner-step count of {n} is out of range")
    return [(n >> (16 * i)) & 0xFFFF for i in range(LIMBS)]


def from_limbs(pieces: list) -> int:
    return sum(int(p) << (16 * i) for i, p in enumerate(pieces))


@dataclass
class StepWeights:
    """The counts of one weighted average, in member order, and what they made."""

    counts: list
    """Inner steps each node whose pseudo-gradient is in the average trained in the window (member order)."""
    inner_steps: int
    """H, the unit of the scale."""

    @property
    def factor(self) -> float:
        return average_factor(self.counts, self.inner_steps)

    @property
    def weights(self) -> list:
        """Each node's share of the average (sums to 1; equal shares when nobody trained)."""
        total = sum(self.counts)
        n = len(self.counts)
        return [c / total if total > 0 else 1.0 / n for c in self.counts]


class Weighing:
    """One fragment's weighted average in the making (DiLoCo(weights="tokens")): this node's count and the
    scale of its contribution, known locally; the counts of every contributor come back with the average
    (Sync.average(trained=), SyncResult.counts) or, for a pipelined step, before it (Sync.weigh)."""

    def __init__(self, trained: int, inner_steps: int):
        self.trained, self.inner_steps = trained, inner_steps
        self.scale = contribution_scale(trained, inner_steps)

    def of(self, counts: list) -> StepWeights:
        return StepWeights(list(counts), self.inner_steps)
