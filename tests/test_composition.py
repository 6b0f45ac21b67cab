"""Every feature of the outer step with every other: the composition matrix.

Each combination of {overlap scheme (or none), fragments 1 / 4, elastic on / off,
codec none / int8 / fp4 / topk (with and without a dense start), error feedback, outer state in CPU
memory / streamed through staging} either is refused by config validation with the reason named,
or runs: nodes as threads of this process on real rings over 127.0.0.1, each
node moving its weights by its own random steps; after every outer step every
node that has applied the same outer steps holds the same outer weights, bit for
bit, and at the end every node holds the same model. Elastic combinations lose a
node (it leaves while an average may be in flight) and take in a joiner mid-run.

The refusals are the ones docs/training.md lists ("What composes with what").
Two processes per node are covered by the process tests (tests/test_elastic_procs.py,
the trainer tests of tests/test_overlap.py and tests/test_fragments.py).
"""

import functools
import hashlib
import itertools
import random
import threading
import time
from datetime import timedelta

import pytest
import torch
from torch import nn

import prime.diloco
from prime.config import Config
from prime.diloco import DiLoCo
from prime.outer import OuterState
from conftest import needs_ring
from hand_launch import launch_client
from test_elastic import _run_threads as _threads  # nodes as threads; a hang or an error fails the test

SCHEMES = ("sync", "eager", "eager-merge", "eager-adaptive", "delayed")
H = 4  # inner steps per outer step
STEPS = 28  # inner steps of a run
SECRET = "composition-secret"


def refusal(scheme: str, fragments: int, codec: str, feedback: bool, elastic: bool = False) -> str:
    """The fields config validation may name for a combination (a regex: any one of them), or "" when it must
    run."""
    why = []
    if feedback and codec == "none":
        why.append("error_feedback")  # exact fp32 loses nothing to feed back
    if scheme == "delayed" and fragments > 1:
        why.append("overlap_steps")  # delayed starts from the outer weights: its average lands at a boundary only
    if codec == "topk" and not feedback:
        why.append("error_feedback")  # a round sends a few percent of the values: feedback sends the rest
    return "|".join(why)


def _config(scheme, fragments, elastic, codec, feedback) -> Config:
    cfg = Config()
    cfg.model.name = "tiny"
    cfg.train.device = "cpu"
    cfg.diloco.inner_steps, cfg.diloco.fragments, cfg.diloco.codec = H, fragments, codec
    cfg.diloco.error_feedback = feedback
    cfg.diloco.overlap = scheme != "sync"
    if scheme != "sync":
        cfg.diloco.overlap_scheme = scheme
    cfg.elastic.enabled = elastic
    if elastic:
        cfg.nodes.num_nodes, cfg.nodes.node_rank = 2, 0
    return cfg


MATRIX = list(itertools.product(SCHEMES, (1, 4), (False, True), ("none", "int8", "fp4", "topk"), (False, True),
                                ("cpu", "streamed")))


@pytest.mark.parametrize("scheme,fragments,elastic,codec,feedback,state", MATRIX)
def test_config_accepts_or_names_the_reason(scheme, fragments, elastic, codec, feedback, state):
    """Config validation over the whole matrix: what must run is accepted, a refusal names the field."""
    cfg = _config(scheme, fragments, elastic, codec, feedback)
    why = refusal(scheme, fragments, codec, feedback, elastic)
    if why:
        with pytest.raises(ValueError, match=why):
            cfg.validate()
    else:
        cfg.validate()


class Layers(nn.Module):
    """Four layers of two parameters each: four fragments of whole layers."""

    def __init__(self, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.layers = nn.ModuleList(nn.Linear(24, 24) for _ in range(4))
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)


def _hash(t: torch.Tensor) -> str:
    return hashlib.blake2b(t.contiguous().numpy().tobytes(), digest_size=8).hexdigest()


def _model_hash(model: nn.Module) -> str:
    return _hash(torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu())


class _Node:
    """One node of a composition run: its model, DiLoCo, and what it saw after each outer step."""

    def __init__(self, name, model, diloco, sync=None):
        self.name, self.model, self.diloco, self.sync = name, model, diloco, sync
        self.seen: dict = {}  # inner step -> hash of the outer weights right after that step's step() call
        self.error = None

    def run_until(self, last: int, seed: int, hold=None) -> None:
        """Inner steps to `last`. With token weights (time phases) each step of the schedule is one of the
        node's own patterns: one inner step, two (the first within the nominal step), three, or none."""
        d = self.diloco
        while d.inner_step < last:
            if hold is not None:
                hold(d.inner_step)
            g = torch.Generator().manual_seed(seed * 1000 + d.inner_step * 7 + hash(self.name) % 97)
            events = ("s", "ts", "a", "tts")[(hash(self.name) + d.inner_step) % 4] if d.weights == "tokens" else "s"
            for e in events:
                if e == "a":
                    r = d.advance()
                else:
                    with torch.no_grad():
                        for p in self.model.parameters():
                            p.sub_(0.02 * torch.randn(p.shape, generator=g).to(p.device))
                    r = d.step(1 if e == "s" else 0)
                if r.did_sync:
                    self.seen[d.inner_step] = _hash(d.outer_weights())


def _diloco_kwargs(scheme, fragments, codec, feedback):
    kw = dict(inner_steps=H, codec=codec, fragments=fragments, error_feedback=feedback or None,
              measure_compression_error=False, outer_state_device="cpu")
    if not feedback and codec == "fp4":
        kw["error_feedback"] = False
    if codec == "topk":  # chunks of 64 (several per parameter), 8 values kept of each
        kw.update(block_size=64, density=8 / 64)
        if SCHEMES.index(scheme) % 2 == 0:  # a dense start over the first 4 outer steps of each fragment: past
            kw.update(dense_outer_steps=4)  # the elastic runs' leave and into their join (HOLD_AT)
    if scheme != "sync":
        kw.update(overlap=True, overlap_scheme=scheme)
    return kw


def _check_identical(nodes) -> int:
    """Every inner step at which two nodes recorded their outer weights: the same hash. Returns the count of
    comparisons made."""
    checks = 0
    steps = set().union(*(n.seen for n in nodes))
    for s in sorted(steps):
        got = {n.name: n.seen[s] for n in nodes if s in n.seen}
        assert len(set(got.values())) == 1, f"outer weights differ after inner step {s}: {got}"
        checks += len(got) - 1
    return checks


@pytest.fixture
def streamed(request, monkeypatch):
    """Outer state streamed through staging pieces (the path a GPU model with a CPU home takes)."""
    if request.param == "streamed":
        monkeypatch.setattr(prime.diloco, "OuterState", functools.partial(OuterState, stream=True))
    return request.param


RUNS = [c for c in itertools.product(SCHEMES, (1, 4), (False, True)) if not refusal(c[0], c[1], "int8", False)]


def _variant(i: int) -> tuple:
    """Codec, error feedback and state placement, cycled across the runs so that every value meets every
    scheme, fragment count and elastic setting."""
    codec, feedback = [("int8", False), ("fp4", True), ("none", False), ("int8", True), ("fp4", False)][i % 5]
    return codec, feedback, ("cpu", "streamed")[(i // 2) % 2]


RUN_PARAMS = [(*c, *_variant(i)) for i, c in enumerate(RUNS)]
# topk: every scheme, with 4 fragments where the scheme allows, on fixed nodes and (a node leaving, one joining)
# elastic ones, placements alternating
RUN_PARAMS += [(scheme, 1 if scheme == "delayed" else 4, elastic, "topk", True, ("cpu", "streamed")[(i + elastic) % 2])
               for i, scheme in enumerate(SCHEMES) for elastic in (False, True)]


@needs_ring
@pytest.mark.parametrize("scheme,fragments,elastic,codec,feedback,streamed", RUN_PARAMS, indirect=["streamed"])
def test_every_combination_runs_with_identical_nodes(scheme, fragments, elastic, codec, feedback, streamed,
                                                    monkeypatch):
    seed = random.randrange(1 << 20)
    print(f"seed {seed}")
    monkeypatch.setenv("PRIME_RING_SECRET", SECRET)  # (this test only: later tests draw their own)
    kw = _diloco_kwargs(scheme, fragments, codec, feedback)
    if elastic:
        nodes = _elastic_run(seed, kw)
    else:
        nodes = _ring_run(seed, kw)
    assert _check_identical(nodes) >= 2
    finals = {n.name: _model_hash(n.model) for n in nodes}
    assert len(set(finals.values())) == 1, f"final weights differ: {finals}"


@needs_ring
def test_elastic_topk_hands_each_owners_dropped_part_to_its_residual(monkeypatch):
    """Elastic rings carry the sparse codec: each committed attempt hands back what this node's owner selections
    dropped (not zero: the average's selection leaves values out), which goes into its residual."""
    from prime.elastic.node import ElasticSync

    seed = random.randrange(1 << 20)
    print(f"seed {seed}")
    monkeypatch.setenv("PRIME_RING_SECRET", SECRET)
    taken = []
    take = ElasticSync.take_dropped

    def spy(self, buf):
        d = take(self, buf)
        if d is not None:
            taken.append(float(d.abs().sum()))
        return d

    monkeypatch.setattr(ElasticSync, "take_dropped", spy)
    nodes = _elastic_run(seed, _diloco_kwargs("sync", 1, "topk", True))
    assert _check_identical(nodes) >= 2
    assert len(taken) >= 4 and all(t > 0 for t in taken), taken


@needs_ring
@pytest.mark.parametrize("scheme,fragments", [("sync", 1), ("eager-merge", 2)])
def test_fixed_ring_topk_hands_each_dropped_part_on_once_the_collective_succeeded(scheme, fragments, monkeypatch):
    """The fixed ring's sparse all-reduce: once a piece's collective succeeded, its dropped part (not zero) goes
    where the outer state takes it from (dropped_on_device: up to the buffer's GPU for a CUDA buffer), once per
    outer step, synchronous or in the background; the nodes stay identical."""
    import prime.sync

    seed = random.randrange(1 << 20)
    print(f"seed {seed}")
    monkeypatch.setenv("PRIME_RING_SECRET", SECRET)
    moved = []
    move = prime.sync.dropped_on_device

    def spy(dropped, buf):
        moved.append(float(dropped.abs().sum()))
        return move(dropped, buf)

    monkeypatch.setattr(prime.sync, "dropped_on_device", spy)
    kw = _diloco_kwargs(scheme, fragments, "topk", True)
    kw.pop("dense_outer_steps", None)  # every outer step sparse
    nodes = _ring_run(seed, kw)
    assert _check_identical(nodes) >= 2
    steps = sum(f.outer_step for n in nodes for f in n.diloco.fragments)
    assert len(moved) == steps and all(m > 0 for m in moved), (steps, moved)


# Time phases' token weights with every scheme, fragments, both memberships and the codecs (nothing refused)
WEIGHTED = [("sync", 1, False, "int8", False), ("eager-merge", 4, True, "fp4", True), ("eager", 4, False, "topk", True),
            ("delayed", 1, True, "int8", True), ("sync", 4, True, "none", False), ("eager-adaptive", 1, True, "fp4", True)]


@needs_ring
@pytest.mark.parametrize("scheme,fragments,elastic,codec,feedback", WEIGHTED)
def test_token_weights_compose_with_identical_nodes(scheme, fragments, elastic, codec, feedback, monkeypatch):
    """Nodes training different numbers of inner steps per step of the schedule, averaged by their counts
    (DiLoCo(weights="tokens"), what diloco.phase = "time" runs): every node that applied the same outer steps
    holds the same outer weights, an elastic joiner included, and the same model at the end."""
    seed = random.randrange(1 << 20)
    print(f"seed {seed}")
    monkeypatch.setenv("PRIME_RING_SECRET", SECRET)
    kw = dict(_diloco_kwargs(scheme, fragments, codec, feedback), weights="tokens")
    nodes = _elastic_run(seed, kw) if elastic else _ring_run(seed, kw)
    assert _check_identical(nodes) >= 2
    finals = {n.name: _model_hash(n.model) for n in nodes}
    assert len(set(finals.values())) == 1, f"final weights differ: {finals}"


def _ring_run(seed: int, kw: dict, device: str = "cpu") -> list:
    import torch.distributed as dist

    from prime.comm import Ring

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)

    def build(r):
        client = dist.TCPStore("127.0.0.1", store.port, is_master=False)  # a connection of its own per node
        ring = Ring(dist.PrefixStore(f"c{seed}", client), r, 2, timeout=timedelta(seconds=30), secret=SECRET)
        model = Layers(seed).to(device)
        return _Node(f"n{r}", model, DiLoCo(model, None, ring, **kw)), ring

    built = _threads([lambda r=r: build(r) for r in range(2)])
    nodes = [n for n, _ in built]
    try:
        _threads([lambda n=n: (n.run_until(STEPS, seed), n.diloco.finish()) for n in nodes])
    finally:
        for n, ring in built:
            n.diloco.close()
            ring.close()
    return nodes


def _elastic_node(port: int, rank: int, seed: int, kw: dict, device: str = "cpu") -> _Node:
    import torch.distributed as dist

    from prime.elastic import ElasticSync, Membership

    def factory():
        return dist.PrefixStore(f"c{seed}/elastic", dist.TCPStore("127.0.0.1", port, is_master=False))

    m = Membership(factory, node_rank=rank, initial_nodes=3, run_id=f"c{seed}", secret=SECRET.encode(),
                   heartbeat_interval_s=0.2, heartbeat_timeout_s=3.0, barrier_timeout_s=60, report_timeout_s=30)
    sync = ElasticSync(m, ring_timeout_s=10, start_timeout_s=30, total_steps=STEPS)
    model = Layers(seed if rank < 3 else seed + 1).to(device)  # a joiner starts elsewhere: it must download
    return _Node(f"n{rank}", model, DiLoCo(model, None, sync, **kw), sync)


LEAVE_AT, HOLD_AT = 6, 14


def _elastic_run(seed: int, kw: dict, device: str = "cpu") -> list:
    """3 nodes; node 2 leaves after LEAVE_AT inner steps (an average may be in flight); a joiner arrives and
    the others wait at HOLD_AT until it is ready, then everyone runs to STEPS and finishes."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    nodes = _threads([lambda r=r: _elastic_node(store.port, r, seed, kw, device) for r in range(3)])
    for n in nodes:
        n.sync.start(n.diloco.outer_step, n.diloco.inner_step)
    joiner_ready = threading.Event()

    def hold(step):
        if step == HOLD_AT:
            assert joiner_ready.wait(120), "the joiner never became ready"

    def member(n):
        n.run_until(STEPS, seed, hold)
        n.diloco.finish()

    def leaver(n):
        n.run_until(LEAVE_AT, seed)
        n.diloco.close()
        n.sync.close()

    joiner = []

    def join():
        j = _elastic_node(store.port, 5, seed, kw, device)
        joiner.append(j)
        ready = launch_client(store.port, j.sync.membership)

        def watch():
            deadline = time.monotonic() + 120
            while not ready.check([f"ready/{j.sync.node_id}"]) and time.monotonic() < deadline:
                time.sleep(0.05)
            joiner_ready.set()

        threading.Thread(target=watch, daemon=True).start()
        r = j.diloco.sync()  # downloads the job's state; admitted at an outer step
        assert r.details.rejoined is not None and r.contributors >= 2
        # (with overlap the members apply this outer step's average later: compared from the next one on)
        j.run_until(STEPS, seed)
        j.diloco.finish()

    try:
        _threads([lambda: member(nodes[0]), lambda: member(nodes[1]), lambda: leaver(nodes[2]), join])
    finally:
        for n in nodes[:2] + joiner:
            n.diloco.close()
            n.sync.close()
    survivors = nodes[:2] + joiner
    assert len(joiner) == 1 and joiner[0].seen, "the joiner never joined"
    return survivors


@needs_ring
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("scheme,fragments", [("eager-merge", 4), ("sync", 1), ("eager", 1)])
def test_topk_with_the_outer_state_on_the_gpu(scheme, fragments, monkeypatch):
    """The sparse codec stages CUDA buffers through the host on a stream of the collective's own, and hands the
    owners' dropped part back on the device: both nodes agree bit for bit after every outer step, and the
    residual the dropped parts go into is on the GPU and not zero."""
    seed = random.randrange(1 << 20)
    print(f"seed {seed}")
    monkeypatch.setenv("PRIME_RING_SECRET", SECRET)
    kw = dict(_diloco_kwargs(scheme, fragments, "topk", True), outer_state_device="gpu")
    nodes = _ring_run(seed, kw, device="cuda")
    assert _check_identical(nodes) >= 2
    finals = {n.name: _model_hash(n.model) for n in nodes}
    assert len(set(finals.values())) == 1, f"final weights differ: {finals}"
    for n in nodes:
        for st in n.diloco.states:
            assert st.residual.is_cuda and st.residual.abs().sum().item() > 0


@needs_ring
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("placement", ["gpu", "cpu"])
@pytest.mark.parametrize("scheme,fragments,codec", [("eager-merge", 4, "fp4"), ("sync", 1, "int8"),
                                                    ("eager", 1, "int8")])
def test_elastic_with_the_outer_state_on_the_gpu(scheme, fragments, codec, placement, monkeypatch):
    """Models on the GPU, the outer state resident there (joiners are served from a host mirror) or streamed
    from pinned CPU memory: a node leaves, one joins, every node agrees bit for bit."""
    seed = random.randrange(1 << 20)
    print(f"seed {seed}")
    monkeypatch.setenv("PRIME_RING_SECRET", SECRET)  # (this test only: later tests draw their own)
    kw = _diloco_kwargs(scheme, fragments, codec, codec == "fp4")
    kw["outer_state_device"] = placement
    nodes = _elastic_run(seed, kw, device="cuda")
    assert all(st.device.type == ("cuda" if placement == "gpu" else "cpu")
               for n in nodes for st in n.diloco.states)
    assert _check_identical(nodes) >= 2
    finals = {n.name: _model_hash(n.model) for n in nodes}
    assert len(set(finals.values())) == 1, f"final weights differ: {finals}"
