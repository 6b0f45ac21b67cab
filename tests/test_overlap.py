"""DiLoCo with overlap (the all-reduce of outer step k runs during the inner steps of k+1), bit for bit
against a plain-torch reference of the same algorithm written here, with nodes as threads (the fake ring of
tests/test_diloco.py). The algorithm is the one docs/training.md writes out ("Overlapping the all-reduce")."""


import copy

import pytest
import torch
from torch import nn

from prime.config import Config
import prime.diloco
import prime.fragments
import prime.overlap
from prime.diloco import MERGE_ALPHA, DiLoCo, OuterSyncError, stand_in_share
from test_diloco import (FakeThreadGroup, FakeThreadRing, TwoParams, int8_round_trip_f64,  # noqa: F401
                         one_thread, run_nodes)  # one_thread: autouse, one torch thread here too


def nesterov_f32(w, m, g, lr, mu, nesterov):
    """The outer update in fp32, one rounding per operation: returns (new weights, new momentum)."""
    m = torch.mul(m, mu) + g
    u = g + torch.mul(m, mu) if nesterov else m
    return w - torch.mul(u, lr), m


def reference(w0, deltas, scheme, *, lr, mu, nesterov, codec, block_size):
    """Plain-torch overlap, all nodes in one loop. deltas[k][r]: how far node r's inner steps of outer step k+1
    move its weights. Returns per outer step the model weights of every node and the shared outer weights,
    and at the end (after the last average is applied) the final weights."""
    n = len(deltas[0])
    w, m = w0.clone(), torch.zeros_like(w0)
    starts = [w0.clone() for _ in range(n)]
    pending = None  # the average in flight
    alphas = [1.0] * n  # eager-adaptive: each node's weight of its own pseudo-gradient
    last_sq = [None] * n
    numel = -(-w0.numel() // block_size) * block_size  # DiLoCo's flat buffer: padded to whole blocks
    steps = []
    for k in range(len(deltas)):
        local = [starts[r] - deltas[k][r] for r in range(n)]
        d = [starts[r] - local[r] for r in range(n)]  # the pseudo-gradient, as each node computes it
        if pending is not None:
            w, m = nesterov_f32(w, m, pending, lr, mu, nesterov)
            padded = torch.cat([pending, torch.zeros(numel - pending.numel())])
            a_sq = float(torch.dot(padded, padded).double())  # over the flat buffer, as DiLoCo's update pass
            if scheme == "eager-adaptive":
                alphas = [min(1.0, max(1.0 / n, a_sq / last_sq[r])) for r in range(n)]
        for r in range(n):
            if scheme == "eager":
                starts[r] = nesterov_f32(w, m, d[r], lr, mu, nesterov)[0]
            elif scheme == "eager-merge":  # the local pseudo-gradient less alpha x the previous start's offset
                stand_in = d[r] if k == 0 else d[r] - torch.mul(starts[r] - w, MERGE_ALPHA)
                starts[r] = nesterov_f32(w, m, stand_in, lr, mu, nesterov)[0]
            elif scheme == "eager-adaptive":  # the local pseudo-gradient shrunk by alpha, rounded to fp32
                stand_in = d[r] if alphas[r] == 1.0 else torch.mul(d[r], alphas[r])
                starts[r] = nesterov_f32(w, m, stand_in, lr, mu, nesterov)[0]
                last_sq[r] = float(torch.dot(d[r], d[r]).double())  # per parameter, as DiLoCo's pseudo-gradient pass
            else:
                starts[r] = w.clone()
        parts = [int8_round_trip_f64(x, block_size) for x in d] if codec == "int8" else d
        acc = parts[0].clone()
        for x in parts[1:]:
            acc = acc + x
        pending = acc / n
        steps.append(([s.clone() for s in starts], w.clone()))
    w, m = nesterov_f32(w, m, pending, lr, mu, nesterov)
    return steps, w


def run_overlap(w0, deltas, scheme, *, codec, block_size=32, lr=0.7, mu=0.9, nesterov=True, group=None):
    n = len(deltas[0])
    group = group or FakeThreadGroup(n)

    def node(r):
        model = TwoParams(w0, torch.zeros(0))
        d = DiLoCo(model, None, FakeThreadRing(group, r), inner_steps=1, outer_lr=lr, outer_momentum=mu,
                   nesterov=nesterov, codec=codec, block_size=block_size, overlap=True, overlap_scheme=scheme,
                   check_replicas=False)
        out = []
        try:
            for k in range(len(deltas)):
                with torch.no_grad():  # a delta given as a tuple: its pieces subtracted one after another
                    for piece in deltas[k][r] if isinstance(deltas[k][r], tuple) else (deltas[k][r],):
                        model.a -= piece
                res = d.step()
                assert res.did_sync and res.overlapped and res.outer_step == k + 1
                assert res.applied_outer_step == (k if k else None)
                out.append((model.a.detach().clone(), d.state.outer[: w0.numel()].clone()))
            d.finish()
            return out, model.a.detach().clone()
        finally:
            d.close()

    return run_nodes(n, node)


@pytest.mark.parametrize("scheme,codec,nesterov", [("eager", "none", True), ("eager", "int8", True),
                                                   ("delayed", "int8", True), ("eager", "none", False),
                                                   ("eager-adaptive", "int8", True), ("eager-adaptive", "none", True)])
def test_overlap_matches_plain_torch_reference_bit_for_bit(seed, scheme, codec, nesterov):
    """3 nodes, 5 outer steps: every node's model, the shared outer weights and the final weights equal the
    reference's bits, and the outer weights are identical on every node."""
    gen = torch.Generator().manual_seed(seed)
    n, steps, size = 3, 5, 200
    w0 = torch.randn(size, generator=gen)
    deltas = [[0.05 * torch.randn(size, generator=gen) for _ in range(n)] for _ in range(steps)]
    got = run_overlap(w0, deltas, scheme, codec=codec, nesterov=nesterov)
    ref_steps, ref_final = reference(w0, deltas, scheme, lr=0.7, mu=0.9, nesterov=nesterov, codec=codec,
                                     block_size=32)
    for k, (starts, w) in enumerate(ref_steps):
        for r in range(n):
            model_w, outer_w = got[r][0][k]
            assert torch.equal(model_w, starts[r]), f"seed {seed} step {k + 1} node {r}: model weights"
            assert torch.equal(outer_w, w), f"seed {seed} step {k + 1} node {r}: outer weights"
    for r in range(n):
        assert torch.equal(got[r][1], ref_final), f"seed {seed} node {r}: final weights"


def reference_midway(w0, deltas, tau, *, lr, mu, codec, block_size, scheme="eager"):
    """Plain-torch eager overlap with overlap_steps = tau < H: deltas[k][r][j] moves node r at inner step j of
    outer step k. After tau inner steps the average in flight is applied and the local weights are shifted by
    (outer weights - start point) (eager-merge: by (1 - alpha) of it). Returns the final weights."""
    n, H = len(deltas[0]), len(deltas[0][0])
    w, m = w0.clone(), torch.zeros_like(w0)
    starts, x = [w0.clone() for _ in range(n)], [w0.clone() for _ in range(n)]
    pending = None
    for k in range(len(deltas)):
        for j in range(H):
            x = [x[r] - deltas[k][r][j] for r in range(n)]
            if j + 1 == tau and k > 0:
                w, m = nesterov_f32(w, m, pending, lr, mu, True)
                pending = None
                if scheme == "eager-merge":
                    x = [x[r] + torch.mul(w - starts[r], 1.0 - MERGE_ALPHA) for r in range(n)]
                else:
                    x = [x[r] + (w - starts[r]) for r in range(n)]  # (w - start) rounded, then added
                starts = [w.clone() for _ in range(n)]
        d = [starts[r] - x[r] for r in range(n)]
        if pending is not None:
            w, m = nesterov_f32(w, m, pending, lr, mu, True)
        share = stand_in_share(n) if scheme == "eager-merge" else 1.0  # the stand-in, shrunk, rounded to fp32
        stand_in = d if share == 1.0 else [torch.mul(v, share) for v in d]
        starts = [nesterov_f32(w, m, stand_in[r], lr, mu, True)[0] for r in range(n)]
        x = [s.clone() for s in starts]
        parts = [int8_round_trip_f64(v, block_size) for v in d] if codec == "int8" else d
        acc = parts[0].clone()
        for v in parts[1:]:
            acc = acc + v
        pending = acc / n
    w, m = nesterov_f32(w, m, pending, lr, mu, True)
    return w


@pytest.mark.parametrize("tau", [1, 2])
def test_overlap_steps_match_plain_torch_reference_bit_for_bit(seed, tau):
    """overlap_steps < inner_steps (3): the average is applied after tau inner steps and the local weights are
    shifted; 2 nodes, int8, final weights equal the reference's bits on both nodes."""
    gen = torch.Generator().manual_seed(seed)
    n, H, steps, size = 2, 3, 4, 150
    w0 = torch.randn(size, generator=gen)
    deltas = [[[0.02 * torch.randn(size, generator=gen) for _ in range(H)] for _ in range(n)] for _ in range(steps)]
    group = FakeThreadGroup(n)

    def node(r):
        model = TwoParams(w0, torch.zeros(0))
        d = DiLoCo(model, None, FakeThreadRing(group, r), inner_steps=H, overlap_steps=tau, codec="int8",
                   block_size=32, overlap=True, overlap_scheme="eager", check_replicas=False)
        for k in range(steps):
            for j in range(H):
                with torch.no_grad():
                    model.a -= deltas[k][r][j]
                res = d.step()
                assert res.did_sync == (j == H - 1)
                if res.did_sync and k > 0:
                    assert res.applied_outer_step == k  # applied mid-phase, reported at the outer step
        d.finish()
        d.close()
        return model.a.detach().clone()

    got = run_nodes(n, node)
    ref = reference_midway(w0, deltas, tau, lr=0.7, mu=0.9, codec="int8", block_size=32)
    for r in range(n):
        assert torch.equal(got[r], ref), f"seed {seed} tau {tau} node {r}"


def test_one_node_eager_overlap_is_the_synchronous_outer_step(seed):
    """With one node the local pseudo-gradient is the average: eager overlap gives the synchronous bits."""
    gen = torch.Generator().manual_seed(seed)
    w0 = torch.randn(300, generator=gen)
    deltas = [[0.05 * torch.randn(300, generator=gen)] for _ in range(4)]
    got = run_overlap(w0, deltas, "eager", codec="none")[0]
    model = TwoParams(w0, torch.zeros(0))
    d = DiLoCo(model, None, FakeThreadRing(FakeThreadGroup(1), 0), inner_steps=1, codec="none",
               check_replicas=False)
    for k in range(4):
        with torch.no_grad():
            model.a -= deltas[k][0]
        d.step()
        assert torch.equal(model.a.detach(), got[0][k][0]), f"seed {seed} step {k + 1}"
    assert torch.equal(model.a.detach(), got[1]), f"seed {seed} final"


def test_checkpoint_mid_run_resumes_bit_for_bit(seed):
    """state_dict() between two outer steps waits for the average in flight and applies it; two nodes restored
    from it continue exactly like the uninterrupted run."""
    gen = torch.Generator().manual_seed(seed)
    n, size = 2, 100
    w0 = torch.randn(size, generator=gen)
    deltas = [[0.05 * torch.randn(size, generator=gen) for _ in range(n)] for _ in range(4)]
    # the uninterrupted run subtracts deltas[2] in the same two halves as the checkpointed one
    plain = run_overlap(w0, [row if k != 2 else [(0.5 * x, 0.5 * x) for x in row] for k, row in enumerate(deltas)],
                        "eager", codec="int8")
    group = FakeThreadGroup(n)

    def node(r):
        model = TwoParams(w0, torch.zeros(0))
        kw = dict(inner_steps=1, codec="int8", block_size=32, overlap=True, overlap_scheme="eager",
                  check_replicas=False)
        d = DiLoCo(model, None, FakeThreadRing(group, r), **kw)
        for k in range(2):
            with torch.no_grad():
                model.a -= deltas[k][r]
            d.step()
        with torch.no_grad():
            model.a -= 0.5 * deltas[2][r]  # half of the next inner steps, then the checkpoint
        sd = copy.deepcopy(d.state_dict())
        weights = model.a.detach().clone()
        d.close()
        model2 = TwoParams(weights, torch.zeros(0))
        d2 = DiLoCo(model2, None, FakeThreadRing(group, r), **kw)
        d2.load_state_dict(sd)
        with torch.no_grad():
            model2.a -= 0.5 * deltas[2][r]
        d2.step()
        with torch.no_grad():
            model2.a -= deltas[3][r]
        d2.step()
        d2.finish()
        d2.close()
        return model2.a.detach().clone()

    resumed = run_nodes(n, node)
    for r in range(n):
        assert torch.equal(resumed[r], plain[r][1]), f"seed {seed} node {r}"
    assert torch.equal(resumed[0], resumed[1]), f"seed {seed}"


@pytest.mark.parametrize("scheme", ["eager", "eager-adaptive", "delayed"])
def test_checkpoint_round_trip_is_exact(seed, scheme):
    """A DiLoCo restored from an overlapped state_dict() continues bit for bit like the original."""
    gen = torch.Generator().manual_seed(seed)
    w0 = torch.randn(64, generator=gen)
    deltas = [0.05 * torch.randn(64, generator=gen) for _ in range(4)]

    def make(w):
        model = TwoParams(w, torch.zeros(0))
        return model, DiLoCo(model, None, FakeThreadRing(FakeThreadGroup(1), 0), inner_steps=1, codec="none",
                             overlap=True, overlap_scheme=scheme, check_replicas=False)

    m1, d1 = make(w0)
    for k in range(2):
        with torch.no_grad():
            m1.a -= deltas[k]
        d1.step()
    sd = copy.deepcopy(d1.state_dict())
    part = sd["fragments"][0]
    assert ("start" in part) == scheme.startswith("eager") and d1._inflight is None
    assert ("alpha" in part) == (scheme == "eager-adaptive")
    m2, d2 = make(m1.a.detach())
    d2.load_state_dict(sd)
    for m, d in ((m1, d1), (m2, d2)):
        for k in (2, 3):
            with torch.no_grad():
                m.a -= deltas[k]
            d.step()
        d.finish()
        d.close()
    assert torch.equal(m1.a, m2.a), f"seed {seed}"


def test_a_failed_background_average_raises_at_the_next_outer_step(seed):
    """The all-reduce of outer step 1 fails on every node: the error comes out of outer step 2, the outer
    weights are unchanged, and close() does not hang."""
    gen = torch.Generator().manual_seed(seed)
    w0 = torch.randn(40, generator=gen)
    group = FakeThreadGroup(2, fail_calls={0})

    def node(r):
        model = TwoParams(w0, torch.zeros(0))
        d = DiLoCo(model, None, FakeThreadRing(group, r), inner_steps=1, codec="none", overlap=True,
                   check_replicas=False)
        with torch.no_grad():
            model.a -= 0.1
        d.step()
        with torch.no_grad():
            model.a -= 0.1
        with pytest.raises(OuterSyncError, match="outer step 1 is dropped"):
            d.step()
        assert torch.equal(d.state.outer[:40], w0), f"seed {seed}"
        d.close()
        return True

    assert run_nodes(2, node) == [True, True]


def test_close_with_a_failing_average_in_flight_raises(seed):
    """close() while an average is in flight waits for it; its failure is raised, not lost."""
    w0 = torch.randn(40, generator=torch.Generator().manual_seed(seed))
    group = FakeThreadGroup(2, fail_calls={0})

    def node(r):
        model = TwoParams(w0, torch.zeros(0))
        d = DiLoCo(model, None, FakeThreadRing(group, r), inner_steps=1, codec="none", overlap=True,
                   check_replicas=False)
        with torch.no_grad():
            model.a -= 0.1
        d.step()
        with pytest.raises(OuterSyncError, match="in flight at close"):
            d.close()
        return True

    assert run_nodes(2, node) == [True, True]


def test_overlap_is_refused_where_it_cannot_work():
    with pytest.raises(ValueError, match="outer_optimizer=None"):
        DiLoCo(nn.Linear(2, 2), None, FakeThreadRing(FakeThreadGroup(1), 0), overlap=True,
               outer_optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))

    class NotARing:  # any other Sync (e.g. ElasticSync)
        def bind(self, state, settings): ...
        def agree(self, ok): return ok
        def verify(self, fingerprint, *, outer_step): ...
        def average(self, grad, *, outer_step, inner_step, recompute): ...
        def committed(self, result): ...
        def close(self): ...

    with pytest.raises(ValueError, match="overlap=True needs a ring"):
        DiLoCo(nn.Linear(2, 2), None, NotARing(), overlap=True)
    with pytest.raises(ValueError, match="overlap_scheme"):
        DiLoCo(nn.Linear(2, 2), None, None, overlap=True, overlap_scheme="lazy")
    with pytest.raises(ValueError, match="overlap_steps"):
        DiLoCo(nn.Linear(2, 2), None, None, inner_steps=4, overlap=True, overlap_steps=5)
    with pytest.raises(ValueError, match="eager"):
        DiLoCo(nn.Linear(2, 2), None, FakeThreadRing(FakeThreadGroup(1), 0), inner_steps=4, overlap=True,
               overlap_steps=2, overlap_scheme="delayed")
    cfg = Config()
    cfg.diloco.inner_steps, cfg.diloco.overlap_steps = 10, 11
    with pytest.raises(ValueError, match="diloco.overlap_steps"):
        cfg.validate()
    cfg = Config()
    cfg.elastic.enabled, cfg.diloco.overlap = True, True
    cfg.validate()  # elastic nodes take overlap (tests/test_composition.py runs them)
    cfg = Config()
    cfg.diloco.overlap_scheme = "late"
    with pytest.raises(ValueError, match="diloco.overlap_scheme"):
        cfg.validate()
    cfg = Config()
    cfg.diloco.outer_state_device = "tpu"
    with pytest.raises(ValueError, match="diloco.outer_state_device"):
        cfg.validate()


def test_overlap_changes_the_replica_fingerprint():
    """Nodes with and without overlap do not train together (the settings hash differs)."""
    fps = []
    for overlap in (False, True):
        d = DiLoCo(TwoParams(torch.ones(4), torch.zeros(0)), None, FakeThreadRing(FakeThreadGroup(1), 0),
                   inner_steps=1, overlap=overlap)
        fps.append(d._fingerprint())
        d.close()
    assert fps[0][0] == fps[1][0] and fps[0][1] != fps[1][1]


# -- through the trainer (prime-simulate, real rings) ------------------------------------------

from test_train import QUICK, final_digests, losses, needs_ring, records, run_simulate  # noqa: E402


@needs_ring
def test_trainer_two_nodes_two_procs_with_overlap_agree(tmp_path, seed):
    """2 nodes x 2 FSDP processes with overlap: the node's background all-reduce agrees through a group of its
    own, the loss goes down, and finish() leaves bit-identical final weights on both nodes."""
    out_dir = str(tmp_path / "run")
    args = QUICK + ["--train.steps", "30", "--diloco.inner_steps", "10", "--train.seed", str(seed % 1000),
                    "--diloco.overlap", "true", "--metrics.out_dir", out_dir, "--metrics.log_every", "1"]
    rc, out = run_simulate(2, 2, args)
    assert rc == 0, out
    for node in (0, 1):
        ls = losses(out_dir, node)
        assert sum(ls[s] for s in (28, 29, 30)) / 3 < sum(ls[s] for s in (1, 2, 3)) / 3 - 1.0, ls
        assert [r["outer_step"] for r in records(out_dir, node, "outer")] == [1, 2, 3]
    digests = final_digests(out)
    assert len(digests) == 2 and digests[0] == digests[1], out


@needs_ring
def test_trainer_overlap_resume_matches_uninterrupted_run(tmp_path, seed):
    """With overlap, kill both nodes after step 8 and resume from the step-6 checkpoint (an average was in flight
    when it was taken): the same losses as the uninterrupted run, bit for bit."""
    common = QUICK + ["--train.steps", "12", "--diloco.inner_steps", "4", "--train.seed", str(seed % 1000),
                      "--diloco.overlap", "true", "--metrics.log_every", "1"]
    full, part = str(tmp_path / "full"), str(tmp_path / "part")
    rc, out = run_simulate(2, 1, common + ["--metrics.out_dir", full])
    assert rc == 0, out
    ck = ["--checkpoint.dir", str(tmp_path / "ck"), "--checkpoint.every", "6", "--checkpoint.async_save", "false",
          "--metrics.out_dir", part]
    rc, out = run_simulate(2, 1, common + ck, env_extra={"PRIME_FAULT_EXIT_AFTER_STEP": "8"})
    assert rc != 0 and "exiting as if killed" in out, out
    rc, out = run_simulate(2, 1, common + ck)
    assert rc == 0 and "resumed from the checkpoint of step 6" in out, out
    for node in (0, 1):
        a, b = losses(full, node), losses(part, node)
        assert all(a[s] == b[s] for s in range(7, 13)), (node, a, b)


def test_checkpoint_before_overlap_steps_resumes_bit_for_bit(seed):
    """overlap_steps = 2 of 3: a checkpoint after the first inner step of an outer step (the average still in
    flight) applies it early; the restored DiLoCo shifts at step 2 as the original does."""
    gen = torch.Generator().manual_seed(seed)
    w0 = torch.randn(64, generator=gen)
    deltas = [0.05 * torch.randn(64, generator=gen) for _ in range(9)]

    def make(w):
        model = TwoParams(w, torch.zeros(0))
        return model, DiLoCo(model, None, FakeThreadRing(FakeThreadGroup(1), 0), inner_steps=3, overlap_steps=2,
                             codec="none", overlap=True, overlap_scheme="eager", check_replicas=False)

    m1, d1 = make(w0)
    for k in range(4):  # one outer step and one inner step: an average in flight
        with torch.no_grad():
            m1.a -= deltas[k]
        d1.step()
    assert d1._inflight is not None
    sd = copy.deepcopy(d1.state_dict())
    m2, d2 = make(m1.a.detach())
    d2.load_state_dict(sd)
    m3, d3 = make(w0)  # never checkpointed: the average is applied at step 2, not early
    for k in range(4):
        with torch.no_grad():
            m3.a -= deltas[k]
        d3.step()
    for m, d in ((m1, d1), (m2, d2), (m3, d3)):
        for k in range(4, 9):
            with torch.no_grad():
                m.a -= deltas[k]
            d.step()
        d.finish()
        d.close()
    assert torch.equal(m1.a, m2.a) and torch.equal(m1.a, m3.a), f"seed {seed}"


# -- eager-merge ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("codec,nesterov", [("int8", True), ("none", True), ("none", False)])
def test_eager_merge_matches_plain_torch_reference_bit_for_bit(seed, codec, nesterov):
    """eager-merge over the whole phase, 3 nodes, 5 outer steps: each next start is the lookahead of
    d - alpha (previous start - outer weights); every node's model, the shared outer weights and the final
    weights equal the reference's bits, and the outer weights are identical on every node."""
    gen = torch.Generator().manual_seed(seed)
    n, steps, size = 3, 5, 200
    w0 = torch.randn(size, generator=gen)
    deltas = [[0.05 * torch.randn(size, generator=gen) for _ in range(n)] for _ in range(steps)]
    got = run_overlap(w0, deltas, "eager-merge", codec=codec, nesterov=nesterov)
    ref_steps, ref_final = reference(w0, deltas, "eager-merge", lr=0.7, mu=0.9, nesterov=nesterov, codec=codec,
                                     block_size=32)
    eager_steps, _ = reference(w0, deltas, "eager", lr=0.7, mu=0.9, nesterov=nesterov, codec=codec, block_size=32)
    assert not torch.equal(ref_steps[2][0][0], eager_steps[2][0][0])  # the merge changes the starts
    for k, (starts, w) in enumerate(ref_steps):
        for r in range(n):
            model_w, outer_w = got[r][0][k]
            assert torch.equal(model_w, starts[r]), f"seed {seed} step {k + 1} node {r}: model weights"
            assert torch.equal(outer_w, w), f"seed {seed} step {k + 1} node {r}: outer weights"
    for r in range(n):
        assert torch.equal(got[r][1], ref_final), f"seed {seed} node {r}: final weights"


def run_midway(w0, deltas, tau, scheme, *, checkpoint_at=None, codec="int8"):
    """Nodes as threads, inner_steps = len(deltas[0][0]), overlap_steps = tau; with checkpoint_at = (k, j) every
    node saves state_dict() after inner step j of outer step k and continues on a fresh DiLoCo restored from
    it. Returns every node's final weights."""
    n, H = len(deltas[0]), len(deltas[0][0])
    group = FakeThreadGroup(n)
    kw = dict(inner_steps=H, overlap_steps=tau, codec=codec, block_size=32, overlap=True, overlap_scheme=scheme,
              check_replicas=False)

    def node(r):
        model = TwoParams(w0, torch.zeros(0))
        d = DiLoCo(model, None, FakeThreadRing(group, r), **kw)
        for k in range(len(deltas)):
            for j in range(H):
                with torch.no_grad():
                    model.a -= deltas[k][r][j]
                d.step()
                if (k, j) == checkpoint_at:
                    sd = copy.deepcopy(d.state_dict())
                    d.close()
                    model = TwoParams(model.a.detach().clone(), torch.zeros(0))
                    d = DiLoCo(model, None, FakeThreadRing(group, r), **kw)
                    d.load_state_dict(sd)
        d.finish()
        d.close()
        return model.a.detach().clone()

    return run_nodes(n, node)


@pytest.mark.parametrize("tau,n", [(1, 2), (2, 2), (2, 3)])
def test_eager_merge_overlap_steps_match_plain_torch_reference_bit_for_bit(seed, tau, n, monkeypatch):
    """eager-merge with overlap_steps < inner_steps (3): each start is the lookahead of stand_in_share(n) times
    the local pseudo-gradient; after tau inner steps the average is applied and the local weights move by
    (1 - alpha)(outer weights - start); int8, final weights equal the reference's bits on every node (and
    differ from eager's, and from eager-merge's with the whole stand-in)."""
    gen = torch.Generator().manual_seed(seed)
    H, steps, size = 3, 4, 150
    w0 = torch.randn(size, generator=gen)
    deltas = [[[0.02 * torch.randn(size, generator=gen) for _ in range(H)] for _ in range(n)] for _ in range(steps)]
    got = run_midway(w0, deltas, tau, "eager-merge")
    ref = reference_midway(w0, deltas, tau, lr=0.7, mu=0.9, codec="int8", block_size=32, scheme="eager-merge")
    eager = reference_midway(w0, deltas, tau, lr=0.7, mu=0.9, codec="int8", block_size=32)
    monkeypatch.setattr(prime.overlap, "STAND_IN_OTHERS", 1.0)  # (where the constant lives)
    whole = reference_midway(w0, deltas, tau, lr=0.7, mu=0.9, codec="int8", block_size=32, scheme="eager-merge")
    assert not torch.equal(ref, eager) and not torch.equal(ref, whole)
    for r in range(n):
        assert torch.equal(got[r], ref), f"seed {seed} tau {tau} node {r}"


def test_stand_in_share():
    """A node's own part of the average in full, the others' part at STAND_IN_OTHERS: one node keeps the
    synchronous step, two weigh the local pseudo-gradient 3/4, many tend to STAND_IN_OTHERS."""
    assert stand_in_share(1) == 1.0 and stand_in_share(2) == 0.75
    assert stand_in_share(3) == pytest.approx(2 / 3) and stand_in_share(1000) == pytest.approx(0.5005)


@pytest.mark.parametrize("tau,checkpoint_at", [(3, (1, 2)), (3, (2, 0)), (2, (1, 0)), (1, (2, 1))])
def test_eager_merge_checkpoint_resumes_bit_for_bit(seed, tau, checkpoint_at):
    """2 nodes (so that the start offsets are not zero), inner_steps 3: a checkpoint at an outer step, inside a
    whole-phase overlap, before the average is applied (tau = 2) and after (tau = 1) continues bit for bit like
    the uninterrupted run: the merge needs no state beyond eager's."""
    gen = torch.Generator().manual_seed(seed)
    n, H, steps, size = 2, 3, 4, 80
    w0 = torch.randn(size, generator=gen)
    deltas = [[[0.02 * torch.randn(size, generator=gen) for _ in range(H)] for _ in range(n)] for _ in range(steps)]
    plain = run_midway(w0, deltas, tau, "eager-merge")
    resumed = run_midway(w0, deltas, tau, "eager-merge", checkpoint_at=checkpoint_at)
    for r in range(n):
        assert torch.equal(resumed[r], plain[r]), f"seed {seed} tau {tau} checkpoint {checkpoint_at} node {r}"
    assert torch.equal(plain[0], plain[1])


@pytest.mark.parametrize("tau", [1, 3])
def test_one_node_eager_merge_is_the_synchronous_outer_step(seed, tau):
    """With one node (exact average) every start offset is exactly 0, so eager-merge gives the synchronous
    bits."""
    gen = torch.Generator().manual_seed(seed)
    w0 = torch.randn(300, generator=gen)
    deltas = [[[0.05 * torch.randn(300, generator=gen) for _ in range(3)]] for _ in range(4)]
    got = run_midway(w0, deltas, tau, "eager-merge", codec="none")[0]
    model = TwoParams(w0, torch.zeros(0))
    d = DiLoCo(model, None, FakeThreadRing(FakeThreadGroup(1), 0), inner_steps=3, codec="none", block_size=32,
               check_replicas=False)
    for k in range(4):
        for j in range(3):
            with torch.no_grad():
                model.a -= deltas[k][0][j]
            d.step()
    assert torch.equal(model.a.detach(), got), f"seed {seed} tau {tau}"


def test_eager_merge_config_and_settings():
    """The config accepts eager-merge (with overlap_steps below inner_steps too), it needs the default outer
    update like eager, and it is part of the replica fingerprint's settings."""
    cfg = Config()
    cfg.diloco.overlap, cfg.diloco.overlap_scheme = True, "eager-merge"
    cfg.diloco.inner_steps, cfg.diloco.overlap_steps = 10, 9
    cfg.validate()
    with pytest.raises(ValueError, match="outer_optimizer=None"):
        DiLoCo(nn.Linear(2, 2), None, FakeThreadRing(FakeThreadGroup(1), 0), overlap=True,
               overlap_scheme="eager-merge", outer_optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    d = DiLoCo(nn.Linear(2, 2), None, FakeThreadRing(FakeThreadGroup(1), 0), inner_steps=4, overlap_steps=2,
               overlap=True, overlap_scheme="eager-merge", check_replicas=False)
    assert d.settings()["overlap"] == "eager-merge" and d.settings()["overlap_steps"] == 2
    d.close()


# -- checkpoints leave the training unchanged, every scheme ---------------------------------------------------


def run_checkpointed(w0, deltas, scheme, *, checkpoints=(), resume=False):
    """Nodes as threads, inner_steps = len(deltas[0][0]), the whole phase overlapped (overlap_steps =
    inner_steps, what delayed needs); after inner step j of outer step k, for every (k, j) in `checkpoints`,
    every node calls state_dict() (a copy, as a checkpoint writes it) and, with `resume`, continues on a fresh
    DiLoCo restored from it. Returns every node's final weights and outer weights, and the state dicts."""
    n, H = len(deltas[0]), len(deltas[0][0])
    group = FakeThreadGroup(n)
    kw = dict(inner_steps=H, codec="int8", block_size=32, overlap=True, overlap_scheme=scheme,
              check_replicas=False)

    def node(r):
        model = TwoParams(w0, torch.zeros(0))
        d = DiLoCo(model, None, FakeThreadRing(group, r), **kw)
        saved = []
        for k in range(len(deltas)):
            for j in range(H):
                with torch.no_grad():
                    model.a -= deltas[k][r][j]
                d.step()
                if (k, j) in checkpoints:
                    sd = copy.deepcopy(d.state_dict())
                    saved.append(sd)
                    if resume:
                        d.close()
                        model = TwoParams(model.a.detach().clone(), torch.zeros(0))
                        d = DiLoCo(model, None, FakeThreadRing(group, r), **kw)
                        d.load_state_dict(sd)
        frag = d.fragments[0]
        buffers = (frag.s.grads.made, frag.s.starts.made)
        d.finish()
        outer = d.outer_weights().clone()
        d.close()
        return model.a.detach().clone(), outer, saved, buffers

    return run_nodes(n, node)


@pytest.mark.parametrize("scheme", ["delayed", "eager", "eager-merge", "eager-adaptive"])
def test_checkpoints_mid_phase_leave_every_scheme_bit_for_bit(seed, scheme):
    """2 nodes, inner_steps 3, int8, 4 outer steps on fresh random data: a run that calls state_dict() after an
    outer step (its average in flight) and twice inside the next phase, and a run that resumes from each of
    those on a fresh DiLoCo, end with the bits of the run that never checkpoints. state_dict() applies the
    average in flight early; delayed then keeps the outer weights its inner steps started from as the anchor
    of its next pseudo-gradient ("anchor", in a pseudo-gradient buffer: no start buffer), the eager schemes
    their start point ("start")."""
    gen = torch.Generator().manual_seed(seed)
    n, H, steps, size = 2, 3, 4, 96
    w0 = torch.randn(size, generator=gen)
    deltas = [[[0.02 * torch.randn(size, generator=gen) for _ in range(H)] for _ in range(n)] for _ in range(steps)]
    at = ((1, 2), (2, 0), (2, 1))  # after outer step 2 (at the boundary), then twice in the phase of step 3
    plain = run_checkpointed(w0, deltas, scheme)
    saved = run_checkpointed(w0, deltas, scheme, checkpoints=at)
    resumed = run_checkpointed(w0, deltas, scheme, checkpoints=at, resume=True)
    key, other = ("anchor", "start") if scheme == "delayed" else ("start", "anchor")
    for r in range(n):
        for name, got in (("state_dict() calls", saved), ("resumed", resumed)):
            assert torch.equal(got[r][1], plain[r][1]), f"seed {seed} {scheme} node {r}: outer weights, {name}"
            assert torch.equal(got[r][0], plain[r][0]), f"seed {seed} {scheme} node {r}: final weights, {name}"
        for sd in saved[r][2] + resumed[r][2]:
            part = sd["fragments"][0]
            assert key in part and other not in part, (scheme, sorted(part))
        if scheme == "delayed":  # the anchor borrows the second pseudo-gradient buffer: no memory beyond it
            assert saved[r][3] == plain[r][3] == (2, 0), (saved[r][3], plain[r][3])
    assert torch.equal(plain[0][1], plain[1][1])
