"""Joining a running elastic job: the download of the job's state and the admission (ElasticSync's part).

A joiner (or a node that was evicted) downloads the newest committed state from
a live member into its outer states while the others train, says it is ready,
and is admitted at the next outer step, which it takes part in without
contributing; when the download outlasts a round it joins as a listener (it
takes part with zeros while it downloads again, then applies the averages it
received meanwhile). docs/elastic-protocol.md, "Joining (live recovery)".

Joining is a mixin of ElasticSync (prime/elastic/node.py): its methods use the
sync's membership, state server, rings (ElasticRings), local ranks (LocalRanks),
attempts (OuterStepAttempts) and outer states.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from prime.elastic.membership import Evicted, JobFinished, JoinError, MembershipError, Plan
from prime.elastic.transfer import FetchResult, TransferError, fetch_state
from prime.sync import SyncResult, all_local
from prime.weights import StepWeights

__all__ = ["Joining", "JoinInfo", "store_errors"]


@dataclass
class JoinInfo:
    """What a node got when it was admitted (first join or a rejoin after an eviction)."""

    outer_step: int
    """The outer step at which it was admitted (its state is the committed state after it)."""
    step: int
    """Inner step count of the job at that outer step: continue from here."""
    slot: int
    """Data slot assigned to this node."""
    slot_state: Optional[dict]
    """Data position the slot's previous owner published (None: a new slot)."""
    download_s: float
    """Time of the state download (all attempts)."""
    download_bytes: int
    join_s: float
    """From the start of the join to the commit of the admitting outer step."""
    sources: list = field(default_factory=list)
    """[node id, first byte, end byte] of every stretch downloaded."""
    downloads: int = 1
    """Downloads needed (more than 1 when the job moved on before this node was admitted)."""
    reason: str = ""
    """Why the node (re)joined: "new node" or the eviction reason."""


class Joining:
    """ElasticSync's joins: rejoin() (through _join) and what completes an admission at commit (_joined)."""

    def _join(self, reason: str, k: int) -> SyncResult:
        """Downloads the newest committed state from a live member into the outer states and takes part in
        the next outer step without contributing; applies it (OuterStates.admit).

        Blocks until admitted (the others keep training meanwhile). Raises
        JobFinished when the job ended first, JoinError when it cannot join (no
        peer, wrong secret, another configuration), MembershipError when the
        store is unreachable."""
        with store_errors(k):
            r, avg = self._download_and_admit(reason)
        self._state.admit(r.outer_step, avg, self.take_dropped(avg))
        r.joined = True
        return r

    def _download_and_admit(self, reason: str) -> tuple:
        """(the admitting outer step's SyncResult, its average), the downloaded state in the outer states."""
        m = self.membership
        progress = _JoinProgress(t0=time.monotonic(), reason=reason)
        while True:
            self.rings.drop()
            self.server.retract()  # our buffers are about to be overwritten
            res = self._download_one_step(progress)
            s = res.step
            inner_step = int(res.meta["inner_step"])
            g = self._hold_download(res)
            plan = self.attempts.lead(lambda: self._await_admission(s), s + 1, g)
            if plan is None and self.listen_when_stale:
                # The download took longer than a round: take part in the rounds with zeros while the
                # state downloads again, then apply the averages missed meanwhile (see _listen).
                m.log(f"the job committed outer step {s + 1} before this node was admitted; joining as a "
                      "listener: it takes part with zeros while it downloads the state again",
                      event="stale", outer_step=s)
                self._joining = progress
                return self._listen()
            if plan is None:
                self._check_catching_up(progress, res)
                m.log(f"the job committed outer step {s + 1} before this node was admitted; downloading again",
                      event="stale", outer_step=s)
                continue
            g.zero_()
            try:
                r = self._boundary(s + 1, g, inner_step, since=time.monotonic(), first_plan=plan)
            except Evicted as e:
                m.log(f"not admitted at outer step {s + 1}: {e.reason}; trying again", event="stale")
                continue
            self._weigh_received(r, g)
            self._joining = progress
            return r, g

    def _download_one_step(self, progress: _JoinProgress):
        """The newest committed state, downloaded by every local rank (its shard g) at the same outer step:
        a shard downloaded before the job moved on is downloaded again at the step of the others."""
        res, want = None, None
        while True:
            err = None
            if res is None or res.step != want:
                try:
                    got = self._fetch(want)
                except (JoinError, JobFinished, MembershipError) as e:
                    err = e
                else:
                    progress.add(got)
                    res = got
            every = self.local.gather(("raise", err) if err is not None else ("ok", res.step))
            errors = [v for kind, v in every if kind == "raise"]
            if errors:
                raise errors[0]
            steps = {v for _, v in every}
            if len(steps) == 1:
                return res
            want = max(steps)  # a shard downloaded before the job moved on: fetch that step's

    def _fetch(self, want: Optional[int]):
        """One download of the state after outer step `want` (None: the newest) from the live members."""
        m = self.membership
        try:
            return fetch_state(self._state.tensors(), lambda: m.live_sources(self._last_outer_at()),
                               secret=m.secret, job=m.job, my_id=self.node_id, check_meta=self._check_settings,
                               timeout_s=self.transfer_timeout_s, give_up_s=self.join_timeout_s,
                               log=lambda msg: m.log(msg, event="download"), step=want,
                               min_rate=self.transfer_min_rate)
        except TransferError as e:
            raise JoinError(f"node {self.node_id} could not download the job's state"
                            + (f" (local rank {self.local_rank})" if self.group is not None else "")
                            + f": {e}") from None

    def _check_settings(self, meta: dict) -> Optional[str]:
        """Why the job a source serves is not this node's (its settings differ), or None."""
        settings = self._settings
        theirs = meta.get("settings", {})
        diff = sorted(k for k in set(settings) | set(theirs) if settings.get(k) != theirs.get(k))
        if diff:
            return ("the running job's settings differ from this node's in " + ", ".join(
                f"{k} (job {theirs.get(k)!r}, here {settings.get(k)!r})" for k in diff)
                + ": start this node with the job's config")
        return None

    def _hold_download(self, res) -> torch.Tensor:
        """Takes the downloaded state as the outer weights; the buffer for the admitting outer step's average."""
        s = res.step
        self._state.downloaded()  # the outer weights are the job's now, not the model's
        g = self._state.buffer_for(s + 1)
        self.membership.log(
            f"downloaded the state after outer step {s} ({res.total_bytes / 2**20:.1f} MiB, digest "
            f"{res.digest[:16]}) in {res.seconds:.2f} s from " + ", ".join(
                f"node {i} [{a}, {b})" for i, a, b in res.segments), event="downloaded", outer_step=s,
            seconds=res.seconds, bytes=res.total_bytes, segments=res.segments, failures=res.failures)
        return g

    def _await_admission(self, s: int) -> Optional[Plan]:
        """Local rank 0: says this node holds the state after outer step s and waits to be admitted at s + 1
        (None: the job moved on first)."""
        self.membership.set_ready(s)
        return self.membership.await_admission(s, self._last_outer_at(), self.join_timeout_s)

    def _check_catching_up(self, progress: _JoinProgress, res) -> None:
        """Raises JoinError once the downloads kept falling behind the job for longer than join_timeout_s."""
        if time.monotonic() - progress.t0 > self.join_timeout_s:
            raise JoinError(
                f"node {self.node_id} could not catch up with the job within {self.join_timeout_s:g} s "
                f"(elastic.join_timeout_s): {progress.downloads} downloads of {res.total_bytes / 2**20:.0f} MiB "
                f"took {progress.download_s / progress.downloads:.1f} s each, and every time the job had moved "
                "past the state by then. A join needs a download shorter than one outer step (H inner steps): use "
                "a faster link, a larger diloco.inner_steps, or an unthrottled source "
                "(elastic.transfer_max_rate_mbit)")

    def _listen(self) -> tuple:
        """Joins as a listener: admitted at the next outer step before holding the state, this node takes part
        in every round with zeros (a member, not a contributor) and keeps the averages it receives, while
        each local rank downloads the newest state (shard g) on a thread. Once every local rank holds its
        state after outer step s, it applies the averages of the outer steps after s that it kept (the same
        fp32 updates as the members, so the same bits), and the outer step in progress completes as
        any other. Converges whatever the download time, at the cost of one buffer of the outer weights'
        size per outer step of download."""
        m = self.membership
        last = self._last_outer_at()
        self.attempts.lead(lambda: m.set_ready(-1, listen=True), 0)
        while True:
            latest = self.attempts.lead(lambda: m.latest_committed(), 0)
            k_done = int(latest["k"]) if latest is not None else 0
            plan = self.attempts.lead(lambda: m.await_admission(k_done, last, self.join_timeout_s), k_done + 1)
            if plan is not None:
                break
        self._sources = self._node_sources(last)
        notes: list = []
        download = _Download(lambda: fetch_state(
            self._state.tensors(), lambda: list(self._sources), secret=m.secret, job=m.job, my_id=self.node_id,
            check_meta=lambda meta: None, timeout_s=self.transfer_timeout_s, give_up_s=self.join_timeout_s,
            log=notes.append, min_rate=self.transfer_min_rate))
        download.start()
        kept: dict = {}
        res = None
        k, step, first = plan.k, plan.step, plan
        while True:
            g = self._state.buffer_for(k)  # each outer step's average has its fragment's size
            try:
                r = self._boundary(k, g, step, since=time.monotonic(), first_plan=first, listen=True)
            except Evicted as e:
                raise JoinError(f"node {self.node_id} was evicted while it downloaded the state: {e.reason}") from None
            self._weigh_received(r, g)
            first = None
            for msg in notes[:]:
                m.log(msg, event="download")
                notes.remove(msg)
            if res is None and all_local(self.group, download.finished.is_set()):
                res = download.take()
                self._joining.add(res)
            if res is not None:
                if res.step < k:  # the outer step in progress (k) is applied by admit(), as on the members
                    self._state.downloaded()
                    missed = [j for j in sorted(kept) if j > res.step]
                    for j in missed:
                        self._state.apply(j, kept.pop(j))
                    m.log(f"downloaded the state after outer step {res.step} in {res.seconds:.2f} s while listening; "
                          f"applied the averages of outer steps {missed} received meanwhile", event="downloaded",
                          outer_step=res.step, seconds=res.seconds, missed=missed)
                    if self.is_leader:
                        m.clear_ready()
                    return r, g
                # the state already holds outer step k: listen to one more round, then apply none
            if res is None:
                kept[k] = g
            self._commit_listening(r)
            self._sources = self._node_sources(last) or self._sources  # JobFinished after the last outer step
            k = k + 1
            step = self._state.step_of(k)

    def _weigh_received(self, r: SyncResult, g: torch.Tensor) -> None:
        """A token-weighted average received while joining: the members' factor, as the members apply it
        (prime.weights; the outer step does it for a member's own averages)."""
        if r.counts is not None:
            r.weights = StepWeights(r.counts, self.inner_steps)
            g.mul_(r.weights.factor)

    def _node_sources(self, last: Optional[int]) -> list:
        """This local rank's download sources; raises (on every process of the node alike) JobFinished after
        the job's last outer step, JoinError when every member is gone."""
        err, out = None, []
        try:
            out = self.membership.live_sources(last)
        except (JobFinished, JoinError) as e:
            err = e
        errors = [e for e in self.local.gather(err) if e is not None]
        if errors:
            raise errors[0]
        return out

    def _commit_listening(self, r: SyncResult) -> None:
        """A listener's commit: records the outer step (for joiners) without serving a state it does not hold."""
        plan, outcome, _ = self._take_commit(r.outer_step)
        self._record_commit(r.outer_step, plan, outcome, None)

    def _joined(self, r: SyncResult) -> JoinInfo:
        """Completes an admission once its outer step committed: the data slot, its position, a log line."""
        m = self.membership
        j, self._joining = self._joining, None
        if self.is_leader:
            m.clear_ready()
        slot_state = m.read_slot(self.slot)
        if isinstance(slot_state, dict) and "local" in slot_state:  # a node of several processes published it
            every = slot_state["local"]
            slot_state = every[self.local_rank] if self.local_rank < len(every) else None
        info = JoinInfo(outer_step=r.outer_step, step=r.inner_step, slot=self.slot,
                        slot_state=slot_state, download_s=j.download_s,
                        download_bytes=j.download_bytes, join_s=time.monotonic() - j.t0, sources=j.sources,
                        downloads=j.downloads, reason=j.reason)
        digest = r.details.digest
        m.log(f"joined at outer step {r.outer_step} (inner step {r.inner_step}, data slot {self.slot}) with "
              f"nodes {r.members}: join took {info.join_s:.2f} s, download {info.download_s:.2f} s"
              + (f", digest {digest[:16]}" if digest else ""),
              event="joined", outer_step=r.outer_step, inner_step=r.inner_step, slot=self.slot, join_s=info.join_s,
              download_s=info.download_s, download_bytes=info.download_bytes, members=r.members, digest=digest)
        return info


@dataclass
class _JoinProgress:
    """What a join did so far (every download), for its JoinInfo."""

    t0: float
    """When the join started (monotonic)."""
    reason: str
    downloads: int = 0
    download_s: float = 0.0
    download_bytes: int = 0
    sources: list = field(default_factory=list)

    def add(self, res: FetchResult) -> None:
        """Counts one completed download."""
        self.downloads += 1
        self.download_s += res.seconds
        self.download_bytes += sum(b - a for _, a, b in res.segments)
        self.sources += res.segments


class _Download(threading.Thread):
    """A state download on a thread of its own (a listener takes part in the rounds meanwhile)."""

    def __init__(self, fetch: Callable[[], object]):
        super().__init__(daemon=True, name="prime-elastic-download")
        self._fetch = fetch
        self.finished = threading.Event()
        self.result = None
        self.error: Optional[BaseException] = None

    def run(self) -> None:
        try:
            self.result = self._fetch()
        except BaseException as e:  # handed to the caller by take()
            self.error = e
        finally:
            self.finished.set()

    def take(self):
        """The FetchResult; raises JoinError when the download failed."""
        self.join()
        if self.error is not None:
            raise JoinError(f"the state download failed: {self.error}") from None
        return self.result


class store_errors:
    """Turns a failed store call into MembershipError: without the store no outer step can be agreed on."""

    def __init__(self, k: int):
        self.k = k

    def __enter__(self):
        return self

    def __exit__(self, tp, e, tb):
        import torch.distributed as dist

        if e is not None and isinstance(e, dist.DistError):
            raise MembershipError(
                f"outer step {self.k}: the job's store is unreachable ({e}); no outer step can be agreed on "
                "without it. Restart the store (python -m prime.elastic.store, or node 0), then every node: they "
                "resume from the newest checkpoint they all have."
            ) from e
        return False
