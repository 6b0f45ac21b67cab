"""Streaming fragments (prime/fragments.py): the split into fragments, the schedule, and DiLoCo with fragments
bit for bit against a plain-torch reference of the same algorithm written here (docs/training.md, "Streaming
fragments"), with nodes as threads on the fake ring of tests/test_diloco.py; checkpoints at every step; the
pipelined synchronous outer step (pieces) against the unpipelined one, with failures part way; and the
streamed outer state (home buffers staged piece by piece) against the resident one."""

import itertools
import random

import pytest
import torch
from torch import nn

import prime.fragments
from prime.config import Config
from prime.diloco import DiLoCo, OuterSyncError
from prime.fragments import MERGE_ALPHA, FragmentSchedule, layer_units, split_fragments, stand_in_share
from prime.outer import OuterState
from test_diloco import FakeThreadGroup, FakeThreadRing, int8_round_trip_f64, one_thread, run_nodes  # noqa: F401
from test_overlap import nesterov_f32

BLOCK = 32
LR, MU = 0.7, 0.9


# -- the split and the schedule ------------------------------------------------------------


def test_layer_units_group_by_the_first_numeric_part():
    names = ["tok.weight", "layers.0.a.weight", "layers.0.b", "layers.1.a.weight", "layers.10.x", "norm.weight",
             "out.weight"]
    assert layer_units(names) == [("tok", [0]), ("layers.0", [1, 2]), ("layers.1", [3]), ("layers.10", [4]),
                                  ("norm", [5]), ("out", [6])]


def test_split_is_contiguous_whole_layers_and_optimal(seed):
    """Against brute force over every way to cut the layers: the largest fragment is the smallest possible,
    every fragment is a non-empty run of whole layers, in order."""
    rng = random.Random(seed)
    for _ in range(30):
        layers = rng.randint(1, 8)
        names, sizes = [], []
        for i in range(layers):
            for j in range(rng.randint(1, 3)):
                names.append(f"layers.{i}.p{j}")
                sizes.append(rng.randint(0, 1000))
        units = layer_units(names)
        weights = [sum(sizes[k] for k in idx) for _, idx in units]
        for P in range(1, len(units) + 1):
            groups = split_fragments(names, sizes, P)
            assert len(groups) == P and [k for g in groups for k in g] == list(range(len(names)))
            assert all(groups), f"seed {seed}: an empty fragment"
            unit_of = {k: u for u, (_, idx) in enumerate(units) for k in idx}
            for g in groups:  # whole layers: no layer is split between two fragments
                us = sorted({unit_of[k] for k in g})
                assert all(k in g for u in us for k in units[u][1])
            best = min(max(sum(weights[a:b]) for a, b in zip((0,) + cuts, cuts + (len(units),)))
                       for cuts in itertools.combinations(range(1, len(units)), P - 1))
            assert max(sum(sizes[k] for k in g) for g in groups) == best, f"seed {seed} P {P}"
    with pytest.raises(ValueError, match=r"diloco.fragments \(3\) is more than the model's 2 layers"):
        split_fragments(["a.w", "b.w"], [1, 1], 3)


def test_schedule_offsets_and_spacing():
    s = FragmentSchedule(100, 4)
    assert [s.offset(p) for p in range(4)] == [25, 50, 75, 100] and s.spacing() == 25 and s.default_delay() == 25
    s = FragmentSchedule(10, 4)
    assert [s.offset(p) for p in range(4)] == [3, 5, 8, 10] and s.spacing() == 2
    assert FragmentSchedule(7, 1).offset(0) == 7 and FragmentSchedule(7, 1).default_delay() == 7
    for H in range(1, 40):
        for P in range(1, H + 1):
            offs = [FragmentSchedule(H, P).offset(p) for p in range(P)]
            assert offs == sorted(set(offs)) and offs[-1] == H and offs[0] >= 1, (H, P)
    with pytest.raises(ValueError, match="diloco.fragments"):
        FragmentSchedule(3, 4)


def test_config_names_the_fields():
    cfg = Config()
    cfg.diloco.inner_steps, cfg.diloco.fragments, cfg.diloco.overlap, cfg.diloco.overlap_steps = 20, 4, True, 5
    cfg.validate()
    cfg.diloco.overlap_steps = 6
    with pytest.raises(ValueError, match=r"diloco.overlap_steps must be <= 5 with diloco.fragments = 4"):
        cfg.validate()
    cfg.diloco.overlap_steps, cfg.diloco.fragments = 0, 21
    with pytest.raises(ValueError, match=r"diloco.fragments must be in \[1, diloco.inner_steps = 20\]"):
        cfg.validate()
    cfg.diloco.fragments, cfg.diloco.overlap, cfg.elastic.enabled = 2, False, True
    cfg.validate()  # elastic nodes take fragments (tests/test_composition.py runs them)


# -- DiLoCo with fragments against a plain-torch reference -------------------------------------


class Layers(nn.Module):
    """One parameter per layer ("layers.i.w"), so that fragments cut between parameters."""

    def __init__(self, ws):
        super().__init__()
        self.layers = nn.ModuleList()
        for w in ws:
            m = nn.Module()
            m.w = nn.Parameter(w.clone())
            self.layers.append(m)

    def weights(self):
        return [m.w.detach().clone() for m in self.layers]

    def inner_step(self, deltas):
        """What an inner step does here: each layer moves by its delta."""
        with torch.no_grad():
            for m, delta in zip(self.layers, deltas):
                m.w -= delta


def _pad(x):
    return torch.cat([x, torch.zeros(-(-x.numel() // BLOCK) * BLOCK - x.numel())])


def _avg(parts, codec):
    """The fake ring's average of the nodes' flat (padded) buffers."""
    if codec == "int8":
        parts = [int8_round_trip_f64(p, BLOCK) for p in parts]
    acc = parts[0].clone()
    for p in parts[1:]:
        acc += p
    return acc / len(parts)


def reference(w0, deltas, P, H, *, tau, overlap, codec, scheme="eager-merge"):
    """Plain-torch streaming fragments. deltas[t][r][i]: what inner step t + 1 of node r subtracts from layer i.
    Fragments as split_fragments cuts the layers, fragment p syncs when its phase (first: round((p+1) H / P),
    then H) is over; synchronous: d = w - x, average, Nesterov, x := w. With overlap (eager schemes, tau < H):
    at the sync the local weights restart from the lookahead of the (eager-merge: shrunk) local
    pseudo-gradient, and tau steps later the average is applied and x moves by (eager-merge: 1 - alpha of)
    (w - start). At the end every fragment with unaveraged steps syncs synchronously (after the shift it owed),
    the others take w. Returns every node's final layers."""
    n, L = len(deltas[0]), len(w0)
    groups = split_fragments([f"layers.{i}.w" for i in range(L)], [w.numel() for w in w0], P)
    sched = FragmentSchedule(H, P)
    x = [[w.clone() for w in w0] for _ in range(n)]  # x[r][i]: node r's layer i
    flat = lambda r, g: torch.cat([_pad(x[r][i]) for i in g])  # noqa: E731

    def put(r, g, v):  # node r's layers of fragment g := flat v
        off = 0
        for i in g:
            x[r][i] = v[off : off + x[r][i].numel()].clone()
            off += _pad(x[r][i]).numel()

    frag = []
    for p, g in enumerate(groups):
        w = torch.cat([_pad(w0[i]) for i in g])
        frag.append({"g": g, "w": w, "m": torch.zeros_like(w), "since": 0, "outer": 0, "first": sched.offset(p),
                     "start": [None] * n, "pending": None})
    share = stand_in_share(n) if scheme == "eager-merge" else 1.0
    keep = 1.0 - MERGE_ALPHA if scheme == "eager-merge" else None

    def shift(f):
        for r in range(n):
            s = torch.sub(f["w"], f["start"][r])
            if keep is not None:
                s = torch.mul(s, keep)
            put(r, f["g"], flat(r, f["g"]) + s)
        f["start"] = [None] * n

    def sync_now(f):
        d = [f["w"] - flat(r, f["g"]) for r in range(n)]
        f["w"], f["m"] = nesterov_f32(f["w"], f["m"], _avg(d, codec), LR, MU, True)
        for r in range(n):
            put(r, f["g"], f["w"])
        f["since"], f["outer"] = 0, f["outer"] + 1

    for step in deltas:
        for r in range(n):
            x[r] = [x[r][i] - step[r][i] for i in range(L)]
        for f in frag:
            f["since"] += 1
        for f in frag:  # the averages due, then the syncs
            if overlap and f["since"] == tau and f["pending"] is not None:
                f["w"], f["m"] = nesterov_f32(f["w"], f["m"], f["pending"], LR, MU, True)
                f["pending"] = None
                shift(f)
        for f in frag:
            if f["since"] < (f["first"] if f["outer"] == 0 else H):
                continue
            if not overlap:
                sync_now(f)
                continue
            anchor = [f["start"][r] if f["start"][r] is not None else f["w"] for r in range(n)]
            d = [anchor[r] - flat(r, f["g"]) for r in range(n)]
            for r in range(n):
                stand_in = d[r] if share == 1.0 else torch.mul(d[r], share)
                f["start"][r] = nesterov_f32(f["w"], f["m"], stand_in, LR, MU, True)[0]
                put(r, f["g"], f["start"][r])
            f["pending"] = _avg(d, codec)
            f["since"], f["outer"] = 0, f["outer"] + 1
    for f in frag:  # finish(): apply what is in flight, then sync what is not averaged yet
        if f["pending"] is not None:
            f["w"], f["m"] = nesterov_f32(f["w"], f["m"], f["pending"], LR, MU, True)
            f["pending"] = None
        if f["since"] > 0:
            if f["start"][0] is not None:
                shift(f)
            sync_now(f)
        else:
            f["start"] = [None] * n
            for r in range(n):
                put(r, f["g"], f["w"])
    return x


def run_fragments(w0, deltas, P, H, *, tau=None, overlap, codec, scheme="eager-merge", checkpoint_at=None,
                  group=None):
    """DiLoCo with fragments, nodes as threads. With checkpoint_at = t every node saves state_dict() after inner
    step t and continues on a fresh model and DiLoCo restored from it."""
    n = len(deltas[0])
    group = group or FakeThreadGroup(n)
    kw = dict(inner_steps=H, fragments=P, overlap=overlap, overlap_steps=tau, overlap_scheme=scheme, codec=codec,
              block_size=BLOCK, check_replicas=False)

    def node(r):
        model = Layers(w0)
        d = DiLoCo(model, None, FakeThreadRing(group, r), **kw)
        results = []
        for t, step in enumerate(deltas, 1):
            model.inner_step(step[r])
            res = d.step()
            if res.did_sync:
                results.append((t, res.fragment))
            if t == checkpoint_at:
                sd = _clone(d.state_dict())
                d.close()
                model = Layers(model.weights())
                d = DiLoCo(model, None, FakeThreadRing(group, r), **kw)
                d.load_state_dict(sd)
        results += [(None, res.fragment) for res in d.finish()]
        d.close()
        return model.weights(), results

    return run_nodes(n, node)


def _clone(obj):
    if torch.is_tensor(obj):
        return obj.clone()
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clone(v) for v in obj]
    return obj


def _problem(seed, n=2, L=5, H=8, phases=3):
    gen = torch.Generator().manual_seed(seed)
    sizes = [int(s) for s in torch.randint(20, 90, (L,), generator=gen)]
    w0 = [torch.randn(s, generator=gen) for s in sizes]
    deltas = [[[0.03 * torch.randn(s, generator=gen) for s in sizes] for _ in range(n)] for _ in range(H * phases)]
    return w0, deltas


@pytest.mark.parametrize("P,tau,overlap,codec,scheme,n", [
    (3, 2, True, "int8", "eager-merge", 2), (4, 2, True, "none", "eager-merge", 3), (3, 1, True, "int8", "eager", 2),
    (2, None, True, "int8", "eager-merge", 2), (3, None, False, "int8", "eager-merge", 2),
    (1, None, False, "none", "eager-merge", 2)])
def test_fragments_match_plain_torch_reference_bit_for_bit(seed, P, tau, overlap, codec, scheme, n):
    """Every node's final weights equal the reference's bits and are identical on every node; each fragment
    syncs at its own steps, one at a time."""
    H = 8
    w0, deltas = _problem(seed, n=n, H=H)
    got = run_fragments(w0, deltas, P, H, tau=tau, overlap=overlap, codec=codec, scheme=scheme)
    ref = reference(w0, deltas, P, H, tau=tau or FragmentSchedule(H, P).default_delay(), overlap=overlap,
                    codec=codec, scheme=scheme)
    for r in range(n):
        for i, (a, b) in enumerate(zip(got[r][0], ref[r])):
            assert torch.equal(a, b), f"seed {seed} node {r} layer {i}"
        assert all(torch.equal(a, b) for a, b in zip(got[r][0], got[0][0]))
    syncs = [t for t, _ in got[0][1] if t is not None]
    assert len(syncs) == len(set(syncs)), "two fragments synced at one step"
    offs = [FragmentSchedule(H, P).offset(p) for p in range(P)]
    assert [(t, f) for t, f in got[0][1] if t is not None][:P] == [(o, p) for p, o in enumerate(offs)]
    if P > 1:
        assert not all(torch.equal(a, b) for a, b in zip(got[0][0], reference(w0, deltas, 1, H, tau=H if overlap
                                                                               else 1, overlap=overlap, codec=codec,
                                                                               scheme=scheme)[0]))


@pytest.mark.parametrize("overlap,tau", [(True, 2), (True, 1), (False, None)])
def test_a_checkpoint_at_any_step_resumes_bit_for_bit(seed, overlap, tau):
    """3 fragments, H = 6: a checkpoint after every inner step in turn (between a sync and its average, at a
    sync, at an average) continues exactly like the uninterrupted run."""
    H = 6
    w0, deltas = _problem(seed, H=H, phases=2)
    plain = run_fragments(w0, deltas, 3, H, tau=tau, overlap=overlap, codec="int8")
    for t in range(1, len(deltas) + 1):
        resumed = run_fragments(w0, deltas, 3, H, tau=tau, overlap=overlap, codec="int8", checkpoint_at=t)
        for r in range(2):
            for i, (a, b) in enumerate(zip(resumed[r][0], plain[r][0])):
                assert torch.equal(a, b), f"seed {seed} checkpoint after step {t} node {r} layer {i}"


@pytest.mark.parametrize("overlap", [True, False])
def test_a_run_resumed_from_its_final_checkpoint_keeps_the_schedule(seed, overlap):
    """H = 4, 2 fragments (fragment p syncs at steps 2 (p + 1) + 4k). A run ending at step 7 syncs both in
    finish(); resumed from the state saved then, each still syncs at its own steps (10, 14 and 8, 12): never
    both at one step, where two averages would share one ring (two nodes with token weights broke there)."""
    w0, deltas = _problem(seed, n=1, H=4, phases=4)
    model = Layers(w0)

    def new_diloco():
        return DiLoCo(model, None, FakeThreadRing(FakeThreadGroup(1), 0), inner_steps=4, fragments=2,
                      overlap=overlap, codec="none", block_size=BLOCK, check_replicas=False, weights="tokens")

    def train(d, steps):
        """(step, fragment) of every outer step in `steps`."""
        synced = []
        for t in steps:
            model.inner_step(deltas[t - 1][0])
            r = d.step()
            if r.did_sync:
                synced.append((t, r.fragment))
        return synced

    d = new_diloco()
    assert [f for _, f in train(d, range(1, 8))] == [0, 1, 0] and [r.fragment for r in d.finish()] == [0, 1]
    sd = d.state_dict()
    d.close()
    resumed = new_diloco()
    resumed.load_state_dict(sd)
    after = train(resumed, range(8, 15))
    resumed.close()
    assert after == [(8, 1), (10, 0), (12, 1), (14, 0)], after


def test_a_checkpoint_of_another_fragment_count_is_refused(seed):
    w0, _ = _problem(seed)
    d3 = DiLoCo(Layers(w0), None, FakeThreadRing(FakeThreadGroup(1), 0), inner_steps=6, fragments=3,
                check_replicas=False)
    d2 = DiLoCo(Layers(w0), None, FakeThreadRing(FakeThreadGroup(1), 0), inner_steps=6, fragments=2,
                check_replicas=False)
    with pytest.raises(ValueError, match="written with diloco.fragments = 3, this run has 2"):
        d2.load_state_dict(d3.state_dict())
    with pytest.raises(ValueError, match=r"overlap_steps must be in \[1, 2 = inner_steps / fragments"):
        DiLoCo(Layers(w0), None, FakeThreadRing(FakeThreadGroup(1), 0), inner_steps=6, fragments=3, overlap=True,
               overlap_steps=3)


# -- the pipelined synchronous outer step ---------------------------------------------------


def _pipelined_run(w0, deltas, H, group, pieces_at):
    """Synchronous, one fragment, pieces of `pieces_at` values: final weights of every node."""
    n = len(deltas[0])

    def node(r):
        model = Layers(w0)
        d = DiLoCo(model, None, FakeThreadRing(group, r), inner_steps=H, codec="int8", block_size=BLOCK,
                   check_replicas=False, ring_factory=lambda tag: FakeThreadRing(group, r, tag))
        out = []
        for t, step in enumerate(deltas, 1):
            model.inner_step(step[r])
            res = d.step()
            if res.did_sync:
                out.append(res.pieces)
        d.close()
        return model.weights(), out

    return run_nodes(n, node)


def test_pipelined_pieces_give_the_bits_of_one_all_reduce(seed, monkeypatch):
    """A fragment all-reduced in pieces (each its own collective, its update applied as it arrives) ends with
    the same bits as in one all-reduce: blocks never span pieces; a piece that fails is retried on a new ring
    (tagged with its piece) and the result is still the same."""
    H = 4
    w0, deltas = _problem(seed, H=H, phases=2)
    one = _pipelined_run(w0, deltas, H, FakeThreadGroup(2), None)
    assert one[0][1] == [1, 1]
    monkeypatch.setattr(prime.fragments, "SYNC_PIECE_VALUES", 64)
    group = FakeThreadGroup(2, fail_calls={2})
    piped = _pipelined_run(w0, deltas, H, group, 64)
    pieces = piped[0][1][0]
    assert pieces == -(-sum(w.numel() for w in w0) // 64) and pieces > 1
    for r in range(2):
        assert all(torch.equal(a, b) for a, b in zip(piped[r][0], one[r][0])), f"seed {seed} node {r}"
    assert any("p2a1" in tag for _, tag in group.rings_built), group.rings_built


def test_a_persistent_failure_part_way_resumes_with_the_rest(seed, monkeypatch):
    """Pieces 1-2 applied, piece 3 fails on every attempt: OuterSyncError says so, the state records it, and
    a run restored from that state does pieces 3 on only, ending with the uninterrupted bits."""
    monkeypatch.setattr(prime.fragments, "SYNC_PIECE_VALUES", 64)
    H = 4
    w0, deltas = _problem(seed, H=H, phases=1)
    plain = _pipelined_run(w0, deltas, H, FakeThreadGroup(2), 64)
    group = FakeThreadGroup(2, fail_calls={2, 3, 4})  # piece 3 and both retries fail

    def node(r):
        model = Layers(w0)
        kw = dict(inner_steps=H, codec="int8", block_size=BLOCK, check_replicas=False, retries=2)
        d = DiLoCo(model, None, FakeThreadRing(group, r), ring_factory=lambda tag: FakeThreadRing(group, r, tag),
                   **kw)
        for t, step in enumerate(deltas, 1):
            model.inner_step(step[r])
            try:
                d.step()
            except OuterSyncError as e:
                assert "at piece 3 of" in str(e) and "Pieces 1 to 2 were applied" in str(e)
                sd = _clone(d.state_dict())
        assert sd["fragments"][0]["pieces_done"] == 2 and sd["since_sync"] == H
        d.close()
        model = Layers(model.weights())
        d = DiLoCo(model, None, FakeThreadRing(group, r), **kw)
        d.load_state_dict(sd)
        assert d.owes_outer_step()
        d.sync()
        d.close()
        return model.weights()

    got = run_nodes(2, node)
    for r in range(2):
        assert all(torch.equal(a, b) for a, b in zip(got[r], plain[r][0])), f"seed {seed} node {r}"


# -- the streamed outer state ------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [None, 100])
def test_streamed_state_matches_the_resident_one_bit_for_bit(seed, chunk, monkeypatch):
    """The home buffers staged piece by piece (stream=True on the CPU: the GPU path's steps with CPU staging):
    pseudo-gradient, update with load, lookahead (scaled), the overlap shift and the merge stand-in give the
    resident state's bits, also over sub-ranges."""
    if chunk:
        monkeypatch.setattr("prime.layout._CHUNK", chunk)
    gen = torch.Generator().manual_seed(seed)
    shapes = [(70,), (3, 50), (1,), (40, 9)]
    base = [torch.randn(*s, generator=gen) for s in shapes]
    models, states = [], []
    for stream in (False, True):
        m = nn.Module()
        for i, w in enumerate(base):
            m.register_parameter(f"p{i}", nn.Parameter(w.clone()))
        models.append(m)
        states.append(OuterState(m.parameters(), block_size=BLOCK, stream=stream))
    assert states[1].streamed and not states[0].streamed
    mom = torch.randn(states[0].numel, generator=gen)
    for st in states:
        st.take()
        st.momentum.copy_(mom)
    for step in range(3):
        move = [0.02 * torch.randn(*s, generator=gen) for s in shapes]
        avg = 0.01 * torch.randn(states[0].numel, generator=gen)
        scale = [None, 0.75][step % 2]
        outs = []
        for st, m in zip(states, models):
            with torch.no_grad():
                for p, dlt in zip(m.parameters(), move):
                    p.sub_(dlt)
            g = st.new_buffer()
            lo, hi = st.ranges(2)[1]
            sq = st.pseudo_gradient(g, lo=0, hi=lo) + st.pseudo_gradient(g, lo=lo, hi=hi)
            look = st.new_buffer()
            st.lookahead(avg, look, scale=scale)
            s = look.clone()
            st.merge_stand_in(s, g, MERGE_ALPHA)
            st.update(avg, load=step != 1)
            start = look.clone()
            st.shift_to_outer(start, 0.5)
            outs.append((g, sq, look, s, st.outer.clone(), st.momentum.clone(), start,
                         [p.detach().clone() for p in m.parameters()]))
        a, b = outs
        for name, x, y in zip(("g", "sq", "look", "stand-in", "outer", "momentum", "shift"), a[:7], b[:7]):
            assert (x == y) if name == "sq" else torch.equal(x, y), f"seed {seed} step {step}: {name}"
        assert all(torch.equal(x, y) for x, y in zip(a[7], b[7])), f"seed {seed} step {step}: model"


def test_ranges_cut_at_block_boundaries_and_count(seed):
    gen = torch.Generator().manual_seed(seed)
    m = nn.Module()
    for i in range(6):
        m.register_parameter(f"p{i}", nn.Parameter(torch.randn(int(torch.randint(1, 300, (1,), generator=gen)))))
    st = OuterState(m.parameters(), block_size=BLOCK)
    for count in (1, 2, 3, 7, 20):
        rs = st.ranges(count)
        assert len(rs) == count and rs[0][0] == 0 and rs[-1][1] == st.numel
        assert all(a[1] == b[0] for a, b in zip(rs, rs[1:])) and all(lo % BLOCK == 0 for lo, _ in rs)


def test_the_demo_with_fragments_and_overlap_ends_with_identical_weights(tmp_path):
    """The README's demo, two simulated nodes on the int8 ring, with 4 fragments and overlap, for 25 of its 100
    steps (two phases and a half of H = 10): every fragment syncs in turn, the ones with steps not yet averaged
    once more at the end, and both nodes print the same final weights."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [sys.executable, "-m", "prime.simulate", "--nodes", "2", "--", "--config", "configs/demo.toml",
           "--diloco.fragments", "4", "--diloco.overlap", "true", "--train.steps", "25",
           "--metrics.out_dir", str(tmp_path / "run"), "--metrics.plot", "false"]
    out = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=600)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-3000:]
    finals = [line for line in text.splitlines() if "final weights identical on all 2 nodes" in line]
    assert len(finals) == 2 and len({line.split("blake2b ")[1] for line in finals}) == 1, text[-2000:]
    assert "final sync of this fragment" in text
