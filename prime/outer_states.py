"""OuterStates: every fragment's outer state, as a sync sees it.

DiLoCo cuts the model into P fragments (P = 1: the whole model), each with its
own OuterState and its own outer steps; the job numbers every fragment's outer
step in one sequence k = 1, 2, ... (prime.fragments.FragmentSchedule: outer step
k is fragment (k - 1) mod P's, at inner step offset(p) + (k - 1) // P * H). A
sync that must hand the state to a joining node (prime.elastic) sees them as
one object:

    states.tensors()          outer weights and momentum of every fragment, CPU tensors: what is
                              served to joiners and downloaded into (mirrors of a GPU home)
    states.published()        refreshes the mirrors after an outer update, before serving them
    states.buffer_for(k)      a zeroed work buffer for outer step k's average (its fragment's size)
    states.step_of(k)         the job's inner step at outer step k
    states.apply(k, avg)      the outer update of outer step k (a listener's missed averages)
    states.admit(k, avg)      a joiner: the downloaded state in place, outer step k applied, the model
                              loaded with every fragment's outer weights, error feedback from zero

The joiner receives each fragment's outer weights and momentum after outer
step k - 1, and takes part in outer step k without contributing; it holds no
error-feedback residual (it made no contribution yet) and no average in flight
(docs/elastic.md, "What a joiner receives").
"""

from __future__ import annotations

from typing import Optional

import torch

from prime.fragments import FragmentSchedule
from prime.hashing import tensors_hash
from prime.layout import pinned_zeros
from prime.outer import OuterState

__all__ = ["OuterStates"]


class OuterStates:
    """The outer states of one DiLoCo's fragments, in fragment order, and its schedule."""

    def __init__(self, states: list, schedule: FragmentSchedule):
        if len(states) != schedule.fragments:
            raise ValueError(f"internal: {len(states)} outer states for {schedule.fragments} fragments")
        self.states: list[OuterState] = list(states)
        self.schedule = schedule
        self._mirrors: Optional[list] = None  # CPU copies of GPU homes, made on first use
        self._stale = set(range(len(states)))  # fragments whose mirror is behind its home

    def __len__(self) -> int:
        return len(self.states)

    def __iter__(self):
        return iter(self.states)

    def __getitem__(self, p: int) -> OuterState:
        return self.states[p]

    def __getattr__(self, name):
        """With one fragment, the OuterStates also answers as its OuterState (a Sync written for one state)."""
        states = self.__dict__.get("states")
        if states is not None and len(states) == 1:
            return getattr(states[0], name)
        raise AttributeError(f"OuterStates has no {name!r}" + (f" (with {len(states)} fragments, ask "
                                                              "states[p] of one)" if states else ""))

    # -- the job's sequence of outer steps ------------------------------------------------

    def fragment_of(self, k: int) -> int:
        """The fragment whose outer step is the job's outer step k (k >= 1)."""
        return self.schedule.fragment_of(k)

    def step_of(self, k: int) -> int:
        """The job's inner step at its outer step k."""
        return self.schedule.step_of(k)

    def buffer_for(self, k: int) -> torch.Tensor:
        """A zeroed flat work buffer for the average of outer step k (its fragment's layout)."""
        return self.states[self.fragment_of(k)].new_buffer()

    # -- what a joiner downloads ------------------------------------------------------------

    def _on_cpu(self) -> bool:
        return all(st.device.type == "cpu" for st in self.states)

    def tensors(self) -> list:
        """Every fragment's outer weights and momentum, in order, as CPU tensors (a GPU home is mirrored:
        published() and admit() copy between the mirror and the home). Raises ValueError for a custom outer
        optimizer, whose state a joiner cannot download."""
        homes = [t for st in self.states for t in st.tensors()]
        if self._on_cpu():
            return homes
        if self._mirrors is None:
            # exactly the bytes, page-locked (not pin_memory=True, which rounds up to a power of two)
            self._mirrors = [pinned_zeros(t.numel()).view(t.shape) if t.device.type != "cpu" else t for t in homes]
        return self._mirrors

    def mirror_bytes(self) -> int:
        """Host memory the mirrors of GPU homes take (0 when every home is in CPU memory)."""
        return sum(2 * 4 * st.numel for st in self.states if st.device.type != "cpu")

    def changed(self, k: int) -> None:
        """The job's outer step k is about to be applied: its fragment's mirror falls behind."""
        self._stale.add(self.fragment_of(k))

    @torch.no_grad()
    def published(self) -> list:
        """tensors(), refreshed from the homes (after an outer update, before they are served): only the
        fragments that changed since the last refresh are copied (one fragment per outer step: 1/P of the
        state crosses PCIe, not all of it)."""
        parts = self.tensors()
        if not self._on_cpu():
            for p in sorted(self._stale):
                homes = self.states[p].tensors()
                first = 2 * p
                for m, h in zip(parts[first : first + len(homes)], homes):
                    if m is not h:
                        m.copy_(h)
        self._stale.clear()
        return parts

    @torch.no_grad()
    def downloaded(self) -> None:
        """The mirrors hold a downloaded state: into the homes. Every fragment's outer weights are now the
        job's, not the model's."""
        if not self._on_cpu():
            homes = [t for st in self.states for t in st.tensors()]
            for m, h in zip(self.tensors(), homes):
                if m is not h:
                    h.copy_(m)
        for st in self.states:
            st.taken = True
        self._stale.clear()  # mirrors and homes hold the same bytes

    def ensure_taken(self) -> None:
        for st in self.states:
            st.ensure_taken()

    def take(self) -> None:
        """Outer weights := the model's current weights, in every fragment (momentum kept)."""
        for st in self.states:
            st.take()

    # -- what every node must agree on ---------------------------------------------------------

    def settings(self) -> dict:
        """The outer update's settings (the same in every fragment) over every fragment's shapes, in order."""
        per = [st.settings() for st in self.states]
        s = {k: v for k, v in per[0].items() if k not in ("shapes", "numel")}
        s["shapes"] = [x for st in per for x in st["shapes"]]
        s["numel"] = sum(st["numel"] for st in per)
        return s

    def weights_hash(self) -> int:
        """64-bit hash of every fragment's outer weights' bytes, in fragment order (prime.hashing: a tree of
        blake2b, on several threads)."""
        for st in self.states:
            st.ensure_taken()
        return int.from_bytes(tensors_hash([st.outer for st in self.states], 8), "little")

    def outer_weights(self) -> torch.Tensor:
        """Every fragment's outer weights, flat, in order (a CPU tensor)."""
        return torch.cat([st.outer.cpu() for st in self.states])

    # -- applying outer steps ------------------------------------------------------------------

    @torch.no_grad()
    def apply(self, k: int, avg: torch.Tensor, load: bool = False) -> None:
        """The outer update of the job's outer step k from its average (the same bits as on the members)."""
        self.changed(k)
        self.states[self.fragment_of(k)].update(avg, load=load, dense=self.schedule.dense(k))

    @torch.no_grad()
    def admit(self, k: int, avg: torch.Tensor, dropped: Optional[torch.Tensor] = None) -> None:
        """A (re)joining node after its admitting outer step k: the downloaded state is in the homes (downloaded()
        was called); applies outer step k's average, loads every fragment's outer weights into the model, and
        starts error feedback from zero, or (topk) from what this node's selections as an owner of outer step k
        dropped (Sync.take_dropped)."""
        p = self.fragment_of(k)
        self.changed(k)
        for q, st in enumerate(self.states):
            if q == p:
                st.update(avg, load=True, dense=self.schedule.dense(k))
            else:
                st.load_into_model()
            st.reset_residual()
            if q == p:
                st.add_to_residual(dropped)
