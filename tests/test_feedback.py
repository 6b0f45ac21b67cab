"""Error feedback (prime/feedback.py): the codec's round trip is lossless under the ring's own quantization, and
DiLoCo with error feedback matches a plain-torch reference of the algorithm bit for bit.

The DiLoCo tests run nodes as threads of the test process on `DirectFakeRing`, a test double of prime.comm.Ring's
direct schedule written with the reference codecs of prime.ops (every contribution quantized once, summed in
rank order in fp32, averaged by one division, the average quantized once). The reference runs the same inner
steps in plain torch, then the algorithm of docs/training.md ("Error feedback") per node and the Nesterov update
as separate fp32 operations. Fresh random data every run; the seed is printed.
"""

import threading
from datetime import timedelta

import pytest
import torch
from torch import nn

from prime import _extension, ops, sparse
from prime.feedback import round_trip
from prime.config import load_config
from prime.diloco import DiLoCo, OuterSyncError
from prime.fragments import FragmentSchedule, split_fragments
from prime.sync import SyncResult
from test_builders import _AveragingAlone
from test_diloco import one_thread, run_nodes  # noqa: F401  (one_thread: an autouse fixture)

CODECS = ("int8", "fp4")
BS = 32
KEEP = 4  # topk: values kept per chunk of BS (density 1/8)
LR, MU = 0.7, 0.9


def rt_ref(x: torch.Tensor, codec: str, bs: int = BS, keep: int = KEEP) -> torch.Tensor:
    """dequantize(quantize(x)) with the reference codec of prime.ops, or topk's decode(encode(x)) with the
    reference of prime.sparse (flat fp32, `keep` values per chunk)."""
    x = x.reshape(-1)
    if codec == "topk":  # per parameter padded to whole chunks with zeros, as OuterState's layout holds it
        n = x.numel()
        padded = torch.cat([x, x.new_zeros(-n % bs)])
        return sparse.decode_reference(sparse.encode_reference(padded, bs, keep), padded.numel(), bs, keep)[:n]
    if codec == "int8":
        return ops.dequantize_int8_reference(*ops.quantize_int8_reference(x, bs), bs)
    q, s = ops.quantize_fp4_reference(x, bs)
    return ops.dequantize_fp4_reference(q, s, x.numel(), bs)


def fake_average(parts: list, codec: str, bs: int = BS, keep_average: int = KEEP) -> torch.Tensor:
    """The direct schedule in plain torch: each contribution quantized once, summed in fp32 in rank order,
    divided by N (one division), quantized once (topk: keep_average values per chunk). (Per parameter or over the
    flat buffer: the same values, as every parameter starts a codec block and its padding is zero.)"""
    acc = rt_ref(parts[0], codec, bs)
    for x in parts[1:]:
        acc = acc + rt_ref(x, codec, bs)
    avg = acc / torch.full_like(acc, len(parts))
    return rt_ref(avg, codec, bs, keep_average) if codec != "none" else avg


class FakeWork:
    def __init__(self, n: int):
        self.n = n

    def wait(self):
        return None

    def stats(self):
        from prime.comm import WorkStats

        return WorkStats(seq=0, numel=self.n, bytes_sent=self.n, bytes_received=self.n, frames_sent=1,
                         frames_received=1, quantize_s=0.0, reduce_s=0.0, wait_s=0.0, commit_s=0.0, queue_s=0.0,
                         total_s=0.0)


class FakeGroup:
    def __init__(self, n: int):
        self.n, self.barrier = n, threading.Barrier(n, timeout=60)
        self.inputs, self.result = [None] * n, None
        self.seen = []  # every call's inputs (rank order), for the tests that look at the contributions


class DirectFakeRing:
    """prime.comm.Ring's surface for in-process nodes; all_reduce is fake_average over the nodes' inputs."""

    def __init__(self, group: FakeGroup, rank: int):
        self.group, self.rank, self.world_size = group, rank, group.n

    def all_reduce(self, t, op="avg", codec="int8", block_size=256, keep=None, residual=None, keep_average=None):
        g = self.group
        g.inputs[self.rank] = t.detach().clone()
        g.barrier.wait()
        if self.rank == 0:
            g.seen.append([x.clone() for x in g.inputs])
            if codec == "topk":  # the wire's arithmetic (tests/test_sparse_ring.py holds the real ring to it)
                g.sparse = sparse.owner_average(g.inputs, block_size, keep, op=op, k_average=keep_average)
                g.result = g.sparse.average
            elif codec == "none":  # exact (the replica check's exchange: op="sum")
                acc = g.inputs[0].clone()
                for x in g.inputs[1:]:
                    acc += x
                g.result = acc / len(g.inputs) if op == "avg" else acc
            else:
                g.result = fake_average(g.inputs, codec, block_size)
        g.barrier.wait()
        t.copy_(g.result.view_as(t))
        if residual is not None:  # all this rank's contribution lost: its selections', its shard's owner's
            residual += g.sparse.residuals[self.rank]
        g.barrier.wait()
        return FakeWork(t.numel())

    def close(self):
        pass


# -- the codec: a round trip is a fixed point ----------------------------------------------------------------


def _round_trip(x, codec, bs, backend):
    if codec == "int8":
        q, s = ops.quantize_int8(x, bs, backend=backend, check_finite=False)
        return ops.dequantize_int8(q, s, bs, backend=backend)
    q, s = ops.quantize_fp4(x, bs, backend=backend, check_finite=False)
    return ops.dequantize_fp4(q, s, x.numel(), bs, backend=backend)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_topk_round_trip_of_a_gpu_tensor_gives_the_cpu_bits_on_the_gpu(seed):
    """A GPU outer state's residual pass stays on the GPU (the Triton kernels) with the CPU kernels' bits."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(3 * 4096 + 77, generator=gen) * torch.exp(torch.randn(3 * 4096 + 77, generator=gen))
    cpu = round_trip(x, "topk", 4096, 64)
    gpu = round_trip(x.cuda(), "topk", 4096, 64)
    assert gpu.is_cuda and torch.equal(gpu.cpu(), cpu)


@pytest.mark.parametrize("codec", CODECS + ("topk",))
def test_round_trip_keeps_the_shape_and_gives_the_flat_bits(seed, codec):
    """feedback.round_trip of a 2-D tensor: its shape back, every codec, with the bits of the flat tensor's round
    trip (the flat one: ops' quantize and dequantize, or prime.sparse's encode and decode, called here)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(96, 128, generator=gen) * torch.rand(96, 1, generator=gen)
    y = round_trip(x, codec, 4096 if codec == "topk" else 64, 64 if codec == "topk" else None)
    flat = x.reshape(-1)
    if codec == "topk":
        ref = sparse.decode(sparse.encode(flat, 4096, 64), flat.numel(), 4096, 64)
    else:
        ref = _round_trip(flat, codec, 64, None)
    assert y.shape == x.shape, f"seed {seed}: {codec}"
    assert torch.equal(y.reshape(-1), ref), f"seed {seed}: {codec}"


@pytest.mark.parametrize("codec", CODECS)
def test_a_round_trip_is_a_fixed_point_of_the_codec(seed, codec):
    """quantize(dequantize(quantize(x))) gives the same codes and scales, so the ring's quantization of a
    contribution already round-tripped loses nothing: every backend of this machine, several block sizes, Gaussian,
    heavy-tailed, tiny (subnormal scales), huge and per-block wildly scaled data; and, for every fp32 a of whole
    binades (normal and subnormal), fp4's scale s = a / 6 satisfies (6 * s) / 6 == s, and int8's decoded maximum
    c * s (c = 123..127) rounds up to s again."""
    gen = torch.Generator().manual_seed(seed)
    n = 50_000 + int(torch.randint(0, 1000, (), generator=gen))
    backends = [b for b in ops.available_backends("cpu") if b != "triton"]
    for bs in (32, 256, 4096):
        z = torch.randn(n, generator=gen)
        chi = torch.randn(3, n, generator=gen).pow(2).sum(0)
        spread = torch.pow(10.0, torch.empty(-(-n // bs)).uniform_(-35, 35, generator=gen)).repeat_interleave(bs)[:n]
        for kind, x in (("gauss", z), ("t3", z / (chi / 3).sqrt()), ("tiny", z * 1e-39), ("huge", z * 1e37),
                        ("spread", z * spread)):
            for backend in backends:
                y = _round_trip(x, codec, bs, backend)
                y2 = _round_trip(y, codec, bs, backend)
                bad = y.view(torch.int32) != y2.view(torch.int32)
                assert not bad.any(), (f"seed {seed}: {codec} {backend} B={bs} {kind}: the second round trip changed "
                                       f"{int(bad.sum())} values, first at {int(bad.nonzero()[0, 0])}")
    if codec == "int8":
        # every a of whole binades: its scale s (a / 127.5 up to the grid), the code c of a block's largest value,
        # 123..127 where a / 127.5 is normal, and the scale of the decoded maximum c * s, which must be s again
        for exponent in (1, 8, 127, 250):
            a = (torch.arange(1 << 23, dtype=torch.int32) | (exponent << 23)).view(torch.float32)
            s = ops.grid_scale_reference(a / torch.full_like(a, 127.5))
            code = torch.round(a * (torch.ones_like(s) / s)).clamp(max=127)
            if exponent > 8:
                assert int(code.min()) == 123 and int(code.max()) == 127, f"binade {exponent}: codes {code.min()}.."
            back = ops.grid_scale_reference((code * s) / torch.full_like(a, 127.5))
            assert torch.equal(back, s), f"int8: a scale of binade {exponent} moved"
    else:
        c = torch.tensor(6.0)
        for exponent in (1, 127, 0):
            a = (torch.arange(1 << 23, dtype=torch.int32) | (exponent << 23)).view(torch.float32)
            s = a / c
            assert torch.equal(((s * c) / c)[a > 0], s[a > 0]), f"{codec}: a scale of binade {exponent} moved"


def _ring_model(ys: list, codec: str, schedule: str, bs: int) -> torch.Tensor:
    """docs/ring.md's schedules, avg, with every contribution entering exactly (not quantized again)."""
    world, n = len(ys), ys[0].numel()
    out = torch.empty(n)
    units = -(-n // bs)
    for c in range(world):
        b, e = min(n, units * c // world * bs), min(n, units * (c + 1) // world * bs)
        if schedule == "direct":
            acc = ys[c][b:e].clone()
            for j in range(1, world):
                acc = acc + ys[(c + j) % world][b:e]
            out[b:e] = rt_ref(acc / torch.full_like(acc, world), codec, bs)
        else:
            decoded = ys[c][b:e]  # the first hop sends position c's own values
            for j in range(1, world):
                acc = ys[(c + j) % world][b:e] + decoded
                if j == world - 1:
                    acc = acc / torch.full_like(acc, world)
                decoded = rt_ref(acc, codec, bs)  # a partial sum (or the final value), quantized
            out[b:e] = decoded
    return out


@pytest.mark.skipif(not _extension.available(), reason="prime._C is not built")
@pytest.mark.parametrize("schedule", ("ring", "direct"))
def test_the_ring_sends_a_round_trip_without_loss(seed, schedule):
    """3 ranks of the real ring (threads, loopback) all-reduce contributions that went through one round trip: the
    result equals, bit for bit, the schedule with every contribution added exactly; only sums are quantized."""
    from prime.comm import Ring, host_store

    world, bs = 3, 256
    gen = torch.Generator().manual_seed(seed)
    n = 40_000 + int(torch.randint(0, 3000, (), generator=gen))
    xs = [torch.randn(n, generator=gen) * (1 + r) for r in range(world)]
    store = host_store("127.0.0.1", 0, timeout=timedelta(seconds=60))
    out = {}

    def node(r):
        from torch.distributed import TCPStore

        client = TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=60))
        kw = {"order": list(range(world))} if schedule == "ring" else {}
        with Ring(client, r, world, timeout=timedelta(seconds=60), job_id=f"feedback-{schedule}-{seed}",
                  schedule=schedule, **kw) as ring:
            for codec in CODECS:
                t = rt_ref(xs[r], codec, bs)
                w = ring.all_reduce(t, op="avg", codec=codec, block_size=bs)
                w.wait()
                assert w.stats().schedule == schedule
                out[(r, codec)] = t

    run_nodes(world, node)
    for codec in CODECS:
        want = _ring_model([rt_ref(x, codec, bs) for x in xs], codec, schedule, bs)
        for r in range(world):
            assert torch.equal(out[(r, codec)].view(torch.int32), want.view(torch.int32)), \
                f"seed {seed}: {codec} {schedule} rank {r} differs from the lossless model"


# -- DiLoCo against the plain-torch reference -----------------------------------------------------------------


_INIT = threading.Lock()


def tiny_model(seed: int) -> nn.Module:
    # The nodes are threads and torch's generator is global: two nodes drawing their initial weights at once
    # interleave the draws and start from different weights (seen on a 16-core machine).
    with _INIT:
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))  # biases of 16 and 4: padded blocks


def batch(seed: int, node: int, step: int):
    g = torch.Generator().manual_seed(seed * 7919 + node * 104729 + step)
    return torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)


def inner_step(model, opt, seed, node, step):
    x, y = batch(seed, node, step)
    loss = ((model(x) - y) ** 2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def nesterov_(w, m, a):
    """outer.py's update as separate fp32 operations: m = mu m + a; w -= lr (a + mu m)."""
    m.mul_(MU)
    m.add_(a)
    u = torch.mul(m, MU)
    u.add_(a)
    u.mul_(LR)
    w.sub_(u)


def lookahead(w, m, d):
    """The outer weights nesterov_ would give from d, leaving w and m alone (eager overlap's start)."""
    mm = torch.mul(m, MU)
    mm.add_(d)
    u = torch.mul(mm, MU)
    u.add_(d)
    u.mul_(LR)
    return torch.sub(w, u)


def _reference_start(seed, nodes, fragments):
    """The plain-torch references' start: each node's model and AdamW, its parameters, the fragments' parameter
    groups, the outer weights, zero momentum and zero residuals."""
    models = [tiny_model(seed) for _ in range(nodes)]
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    params = [list(m.parameters()) for m in models]
    names = [n for n, _ in models[0].named_parameters()]
    groups = split_fragments(names, [p.numel() for p in params[0]], fragments) if fragments > 1 else [
        list(range(len(names)))]
    outer = [p.detach().clone() for p in params[0]]
    mom = [torch.zeros_like(w) for w in outer]
    res = [[torch.zeros_like(w) for w in outer] for _ in range(nodes)]
    return models, opts, params, groups, outer, mom, res


def reference(seed, nodes, codec, H, outer_steps, fragments=1, feedback=True, overlap=None, decay=1.0,
              keep_average=KEEP, dense=0):
    """DiLoCo with error feedback in plain torch: returns (outer weights, residuals per node) per parameter.
    decay: the share of the residual added to the next contribution; keep_average: topk's values kept per chunk of
    each owner's average; dense: topk's dense start, each fragment's first `dense` outer steps averaged as int8
    (blocks of BS) and applied as they are (outer -= average, the momentum untouched)."""
    models, opts, params, groups, outer, mom, res = _reference_start(seed, nodes, fragments)
    sched = FragmentSchedule(H, fragments)
    since, done = [0] * fragments, [0] * fragments
    starts, pending = [None] * nodes, None

    def contribution(r, i, d):
        if not feedback:
            return d
        p = d + res[r][i] if decay == 1.0 else d + res[r][i] * decay
        if codec == "topk":  # dense: the wire selects, and hands back what every selection dropped (average())
            res[r][i] = torch.zeros_like(p)
            return p
        y = rt_ref(p, codec).view_as(p)
        res[r][i] = p - y
        return y

    owner = _owners(groups, [p.numel() for p in params[0]], nodes) if codec == "topk" else None

    def average(cs, i):
        """fake_average; topk: each node's selection of the values others own, its own values as they are, the
        average selected once, and every selection's loss into the residual of the node that made it."""
        if owner is None:
            return fake_average(cs, codec, keep_average=keep_average).view_as(outer[i])
        parts = []
        for r, c in enumerate(cs):
            mine = (owner[i] == r).view_as(c)
            sel = rt_ref(c, codec).view_as(c)
            res[r][i] += torch.where(mine, torch.zeros_like(c), c - sel)
            parts.append(torch.where(mine, c, sel))
        pre = _sum_in_order(parts) / torch.full_like(parts[0], nodes)
        a = rt_ref(pre, codec, BS, keep_average).view_as(outer[i])
        dropped = (pre.reshape(-1) - a.reshape(-1)) * nodes
        for r in range(nodes):
            res[r][i] += torch.where(owner[i] == r, dropped, torch.zeros_like(dropped)).view_as(res[r][i])
        return a

    def dense_average(cs, i):
        return fake_average(cs, "int8").view_as(outer[i])

    def update(i, a, plain):
        if plain:  # the dense start's update: the average as it is
            outer[i].sub_(a)
        else:
            nesterov_(outer[i], mom[i], a)

    pending_dense = False
    for t in range(1, H * outer_steps + 1):
        for r in range(nodes):
            inner_step(models[r], opts[r], seed, r, t)
        for f in range(fragments):
            since[f] += 1
            if since[f] < (sched.offset(f) if done[f] == 0 else H):
                continue
            is_dense = done[f] < dense
            since[f], done[f] = 0, done[f] + 1
            with torch.no_grad():
                if overlap is None:
                    for i in groups[f]:
                        cs = [contribution(r, i, torch.sub(outer[i], params[r][i])) for r in range(nodes)]
                        update(i, (dense_average if is_dense else average)(cs, i), is_dense)
                        for r in range(nodes):
                            params[r][i].copy_(outer[i])
                    continue
                ds = [[torch.sub(starts[r][i] if starts[r] is not None else outer[i], params[r][i])
                       for i in range(len(outer))] for r in range(nodes)]
                if pending is not None:
                    for i in range(len(outer)):
                        update(i, pending[i][0], pending_dense)
                        _add_dropped(res, pending[i], i)
                for r in range(nodes):
                    for i in range(len(outer)):
                        if overlap == "eager":
                            start = torch.sub(outer[i], ds[r][i]) if is_dense else lookahead(outer[i], mom[i], ds[r][i])
                        else:
                            start = outer[i].clone()
                        params[r][i].copy_(start)
                        if overlap == "eager":
                            starts[r] = starts[r] or [None] * len(outer)
                            starts[r][i] = start
                cs = [[contribution(r, i, ds[r][i]) for i in range(len(outer))] for r in range(nodes)]
                pending = [_pending_average([cs[r][i] for r in range(nodes)], i,
                                            dense_average if is_dense else average, res) for i in range(len(outer))]
                pending_dense = is_dense
    if pending is not None:  # finish(): the last average
        for i in range(len(outer)):
            update(i, pending[i][0], pending_dense)
            _add_dropped(res, pending[i], i)
    return outer, res, groups


def _sum_in_order(cs):
    acc = cs[0].clone()
    for x in cs[1:]:
        acc = acc + x
    return acc


def _pending_average(cs, i, average, res):
    """With overlap the average is applied at the next outer step, and the owners' dropped part is added to the
    residual then: (average, the residuals' increments per node) now, applied later by _add_dropped."""
    before = [r[i].clone() for r in res]
    a = average(cs, i)
    deltas = [res[r][i] - before[r] for r in range(len(res))]
    for r in range(len(res)):
        res[r][i].copy_(before[r])
    return a, deltas


def _add_dropped(res, pending, i):
    for r, d in enumerate(pending[1]):
        res[r][i] += d


def _owners(groups, sizes, nodes):
    """Per parameter, the node owning each of its values in the topk collective: each fragment's flat layout
    pads every parameter to whole chunks of BS, and node o owns shard o of it (prime.sparse.shards)."""
    owner = [None] * len(sizes)
    for idx in groups:
        padded = [-(-sizes[i] // BS) * BS for i in idx]
        bounds = sparse.shards(sum(padded), nodes, BS)
        flat = torch.zeros(sum(padded), dtype=torch.int64)
        for o, (lo, hi) in enumerate(bounds):
            flat[lo:hi] = o
        at = 0
        for i, n in zip(idx, padded):
            owner[i] = flat[at : at + sizes[i]]
            at += n
    return owner


def unflatten(flat: torch.Tensor, state) -> list:
    return [flat[o : o + n].view(s) for o, n, s in zip(state.offsets, state.sizes, state.shapes)]


def _outer_and_residuals(d) -> list:
    """Every fragment's (outer weights, residual or None) as parameter tensors; closes d."""
    out = []
    for f in d.fragments:
        st = f.state
        out.append((unflatten(st.outer.clone(), st),
                    unflatten(st.residual.clone(), st) if st.residual is not None else None))
    d.close()
    return out


def run_diloco(seed, nodes, codec, H, outer_steps, fragments=1, error_feedback=True, overlap=None, stop_at=None,
               resume=None, **settings):
    """DiLoCo on DirectFakeRing; returns per node (outer weights per parameter, residuals per parameter, the
    state_dicts at inner step stop_at when asked). `resume`: per node (model, optimizer, DiLoCo state) to start
    from."""
    group = FakeGroup(nodes)

    def node(r):
        model = tiny_model(seed)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        kw = dict(overlap=True, overlap_scheme=overlap) if overlap else {}
        kw.update(settings)
        if codec == "topk":
            kw["density"] = KEEP / BS
            kw.setdefault("feedback_decay", 1.0)  # the reference's (topk's default is 0.8)
        kw = dict(dict(outer_lr=LR, outer_momentum=MU), **kw)  # (a test may set its own outer update)
        d = DiLoCo(model, opt, DirectFakeRing(group, r), inner_steps=H, codec=codec, block_size=BS,
                   fragments=fragments, error_feedback=error_feedback, measure_compression_error=False, **kw)
        first = 1
        if resume is not None:
            msd, osd, dsd = resume[r]
            model.load_state_dict(msd)
            opt.load_state_dict(osd)
            d.load_state_dict(dsd)
            first = dsd["inner_step"] + 1
        saved = None
        for t in range(first, H * outer_steps + 1):
            inner_step(model, opt, seed, r, t)
            d.step()
            if t == stop_at:
                saved = (_copy(model.state_dict()), _copy(opt.state_dict()), _copy(d.state_dict()))
        if overlap:
            d.finish()
        return _outer_and_residuals(d), saved

    return run_nodes(nodes, node)


def _copy(obj):
    import copy

    return copy.deepcopy(obj)


def _assert_matches(got, ref, seed, what):
    outer, res, groups = ref
    for r, (frags, _) in enumerate(got):
        for f, (w, e) in enumerate(frags):
            for k, i in enumerate(groups[f]):
                assert torch.equal(w[k], outer[i]), f"seed {seed} {what}: node {r} outer weights of parameter {i}"
                assert torch.equal(e[k], res[r][i]), f"seed {seed} {what}: node {r} residual of parameter {i}"


@pytest.mark.parametrize("codec", CODECS + ("topk",))
@pytest.mark.parametrize("fragments,overlap", [(1, None), (2, None), (1, "eager"), (1, "delayed")])
def test_diloco_matches_the_reference_bit_for_bit(seed, codec, fragments, overlap):
    """2 nodes, a tiny model, 3 outer steps of H = 4 (with 2 fragments: each at its own offset; with overlap:
    the contribution leaves in the background): outer weights and every node's residual equal the reference's."""
    nodes, H, K = 2, 4, 3
    got = run_diloco(seed, nodes, codec, H, K, fragments=fragments, overlap=overlap)
    ref = reference(seed, nodes, codec, H, K, fragments=fragments, overlap=overlap)
    _assert_matches(got, ref, seed, f"{codec} fragments={fragments} overlap={overlap}")
    # the residuals differ between the nodes (each holds its own), the outer weights do not
    assert any(not torch.equal(a[1][0], b[1][0]) for a, b in zip(got[0][0], got[1][0])), f"seed {seed}"


@pytest.mark.parametrize("codec,fragments,overlap", [("topk", 1, None), ("topk", 2, None), ("topk", 1, "eager"),
                                                    ("fp4", 1, None)])
def test_a_decayed_residual_and_a_denser_average_match_the_reference_bit_for_bit(seed, codec, fragments, overlap):
    """feedback_decay 0.75 (each contribution adds 0.75 x the residual) and, for topk, owners that keep KEEP / 2
    values of every chunk of their average (average_density): outer weights and residuals equal the reference's;
    and the settings change the result (the reference without them differs). (Not more than KEEP here: the model's
    4-value bias fills a chunk of BS with padding, and an average keeping more values than the chunk has non-zero
    ones keeps padding zeros too, which decode as +-lo; tests/test_sparse_ring.py holds larger averages to the
    reference on the ring.)"""
    nodes, H, K = 2, 4, 3  # (the reference sums in rank order: the owners' order only for 2 nodes)
    settings = dict(feedback_decay=0.75)
    if codec == "topk":
        settings["average_density"] = KEEP // 2 / BS
    got = run_diloco(seed, nodes, codec, H, K, fragments=fragments, overlap=overlap, **settings)
    ref = reference(seed, nodes, codec, H, K, fragments=fragments, overlap=overlap, decay=0.75,
                    keep_average=KEEP // 2 if codec == "topk" else KEEP)
    _assert_matches(got, ref, seed, f"{codec} fragments={fragments} overlap={overlap} decayed")
    plain = reference(seed, nodes, codec, H, K, fragments=fragments, overlap=overlap)
    assert any(not torch.equal(a, b) for a, b in zip(plain[0], ref[0])), f"seed {seed}: the settings changed nothing"


@pytest.mark.parametrize("fragments,overlap", [(1, None), (2, None), (1, "eager"), (1, "delayed")])
def test_a_dense_start_matches_the_reference_bit_for_bit(seed, fragments, overlap):
    """topk with dense_outer_steps = 2: each fragment's first two outer steps average as int8 and apply the
    average as it is, the later ones go sparse with the Nesterov update; outer weights and residuals equal the
    plain-torch reference's over 4 outer steps (with overlap the eager lookahead of a dense step is the plain
    one). The dense start changes the result (the reference without it differs), and its outer steps equal an
    int8 run's with outer lr 1 and no momentum."""
    nodes, H, K = 2, 4, 4
    got = run_diloco(seed, nodes, "topk", H, K, fragments=fragments, overlap=overlap, dense_outer_steps=2)
    ref = reference(seed, nodes, "topk", H, K, fragments=fragments, overlap=overlap, dense=2)
    _assert_matches(got, ref, seed, f"dense start fragments={fragments} overlap={overlap}")
    sparse_only = reference(seed, nodes, "topk", H, K, fragments=fragments, overlap=overlap)
    assert any(not torch.equal(a, b) for a, b in zip(sparse_only[0], ref[0])), f"seed {seed}: the dense start changed nothing"
    if overlap is None and fragments == 1:  # two outer steps, all dense: int8 with plain averaging
        both = run_diloco(seed, nodes, "topk", H, 2, dense_outer_steps=2)
        plain = run_diloco(seed, nodes, "int8", H, 2, error_feedback=False, outer_lr=1.0, outer_momentum=0.0)
        for (a, _), (b, _) in zip(both[0][0], plain[0][0]):
            for x, y in zip(a, b):
                assert torch.equal(x, y), f"seed {seed}: a dense start is not int8 with plain averaging"


def test_a_dense_start_in_pipelined_pieces_matches_the_reference_bit_for_bit(seed, monkeypatch):
    """A synchronous outer step cut into pieces (each all-reduced and applied on its own) in a dense start: the
    plain update on every piece gives the reference's bits (two outer steps, both dense)."""
    import prime.fragments

    monkeypatch.setattr(prime.fragments, "SYNC_PIECE_VALUES", 64)
    got = run_diloco(seed, 2, "topk", 4, 2, dense_outer_steps=2)
    _assert_matches(got, reference(seed, 2, "topk", 4, 2, dense=2), seed, "dense start in pieces")


def test_dense_start_settings_are_refused_where_they_mean_nothing():
    """dense_outer_steps above 0 needs topk and the default outer update; a negative or non-int count is refused,
    each error naming the setting. The config's default is 0 (no dense start)."""
    model = tiny_model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    group = FakeGroup(1)
    for kw, words in ((dict(codec="int8", dense_outer_steps=2), "setting of codec 'topk'"),
                      (dict(codec="topk", dense_outer_steps=-1), "int >= 0"),
                      (dict(codec="topk", dense_outer_steps=1.5), "int >= 0"),
                      (dict(codec="topk", dense_outer_steps=2, outer_optimizer=lambda p: torch.optim.SGD(p, lr=1.0)),
                       "default outer update")):
        with pytest.raises(ValueError, match="dense_outer_steps") as e:
            DiLoCo(model, opt, DirectFakeRing(group, 0), inner_steps=4, block_size=BS, **kw)
        assert words in str(e.value), str(e.value)
    with pytest.raises(ValueError, match="diloco.dense_outer_steps"):
        load_config("configs/demo.toml", [("diloco.dense_outer_steps", 3)]).validate()  # int8
    with pytest.raises(ValueError, match="diloco.dense_outer_steps"):
        load_config("configs/demo.toml", [("diloco.codec", "topk"), ("diloco.dense_outer_steps", -1)]).validate()
    cfg = load_config("configs/demo.toml", [("diloco.codec", "topk"), ("diloco.dense_outer_steps", 4)]).validate()
    assert cfg.diloco.dense_outer_steps == 4
    assert load_config("configs/demo.toml").diloco.dense_outer_steps == 0  # off unless set


def test_the_schedule_names_each_fragments_first_outer_steps_dense():
    """The job's outer step k is fragment (k - 1) mod P's outer step (k - 1) // P: the first `dense_steps` of
    each fragment are dense, counted by hand for P = 3."""
    s = FragmentSchedule(12, 3, dense_steps=2)
    rounds = {p: 0 for p in range(3)}
    for k in range(1, 16):
        p = s.fragment_of(k)
        assert s.dense(k) == (rounds[p] < 2), k
        rounds[p] += 1
    assert not any(FragmentSchedule(12, 3).dense(k) for k in range(1, 10))


# Time phases: inner steps each node trains per nominal step (0: the clock passed it without one), per node
STEPS_PER_NOMINAL = {0: [2, 1, 3, 2, 1, 2, 2, 2, 1, 3, 1, 2], 1: [1, 0, 1, 0, 0, 1, 1, 0, 1, 0, 1, 1]}


def weighted_reference(seed, codec, H, outer_steps, fragments):
    """DiLoCo with token weights (prime/weights.py) in plain torch, 2 nodes training STEPS_PER_NOMINAL: each
    node's pseudo-gradient times n_r / H before error feedback, the average times N H / sum n. Returns what
    reference() returns."""
    from prime.weights import average_factor

    nodes = 2
    models, opts, params, groups, outer, mom, res = _reference_start(seed, nodes, fragments)
    sched = FragmentSchedule(H, fragments)
    since, done = [0] * fragments, [0] * fragments
    count, trained = [0] * nodes, [[0] * nodes for _ in range(fragments)]
    for t in range(1, H * outer_steps + 1):
        for r in range(nodes):
            for _ in range(STEPS_PER_NOMINAL[r][t - 1]):
                count[r] += 1
                inner_step(models[r], opts[r], seed, r, count[r])
                for f in range(fragments):
                    trained[f][r] += 1
        for f in range(fragments):
            since[f] += 1
            if since[f] < (sched.offset(f) if done[f] == 0 else H):
                continue
            since[f], done[f] = 0, done[f] + 1
            n, trained[f] = trained[f], [0] * nodes
            with torch.no_grad():
                for i in groups[f]:
                    cs = []
                    for r in range(nodes):
                        d = torch.sub(outer[i], params[r][i])
                        if n[r] != H:
                            d = torch.mul(d, n[r] / H)
                        p = d + res[r][i] if codec != "none" else d
                        y = rt_ref(p, codec).view_as(p) if codec != "none" else p
                        if codec != "none":
                            res[r][i] = p - y
                        cs.append(y)
                    if codec == "none":  # the exact ring: the sum in rank order, divided
                        avg = _sum_in_order(cs) / torch.full_like(cs[0], nodes)
                    else:
                        avg = fake_average(cs, codec).view_as(outer[i])
                    a = torch.mul(avg, average_factor(n, H))
                    nesterov_(outer[i], mom[i], a)
                    for r in range(nodes):
                        params[r][i].copy_(outer[i])
    return outer, res, groups


def run_weighted(seed, codec, H, outer_steps, fragments):
    """DiLoCo(weights="tokens") on DirectFakeRing, each node stepping as STEPS_PER_NOMINAL says (step(0) within
    a nominal step, step(1) at its last inner step, advance() for a nominal step without one)."""
    group = FakeGroup(2)

    def node(r):
        model = tiny_model(seed)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        d = DiLoCo(model, opt, DirectFakeRing(group, r), inner_steps=H, outer_lr=LR, outer_momentum=MU, codec=codec,
                   block_size=BS, fragments=fragments, error_feedback=codec != "none" or None,
                   measure_compression_error=False, weights="tokens")
        count = 0
        for t in range(1, H * outer_steps + 1):
            k = STEPS_PER_NOMINAL[r][t - 1]
            if k == 0:
                d.advance()
            for j in range(k):
                count += 1
                inner_step(model, opt, seed, r, count)
                d.step(1 if j == k - 1 else 0)
        return _outer_and_residuals(d), None

    return run_nodes(2, node)


@pytest.mark.parametrize("codec,fragments", [("none", 1), ("fp4", 1), ("int8", 2)])
def test_token_weighted_diloco_matches_the_reference_bit_for_bit(seed, codec, fragments):
    """Nodes training different numbers of inner steps per nominal step (node 1 none in some), 3 outer steps of
    H = 4: outer weights (and residuals, with a lossy codec) equal the plain-torch reference's, bit for bit."""
    H, K = 4, 3
    got = run_weighted(seed, codec, H, K, fragments)
    ref = weighted_reference(seed, codec, H, K, fragments)
    outer, res, groups = ref
    for r, (frags, _) in enumerate(got):
        for f, (w, e) in enumerate(frags):
            for k, i in enumerate(groups[f]):
                assert torch.equal(w[k], outer[i]), f"seed {seed} {codec}: node {r} outer weights of parameter {i}"
                if e is not None:
                    assert torch.equal(e[k], res[r][i]), f"seed {seed} {codec}: node {r} residual of parameter {i}"


def test_without_error_feedback_the_reference_differs(seed):
    """The reference is sensitive to the feature: fp4 without error feedback gives other weights (and DiLoCo with
    error_feedback=False matches the reference without it)."""
    got = run_diloco(seed, 2, "fp4", 4, 2, error_feedback=False)
    ref = reference(seed, 2, "fp4", 4, 2, feedback=False)
    outer = ref[0]
    assert all(torch.equal(w, outer[i]) for i, w in enumerate(got[0][0][0][0])), f"seed {seed}"
    assert got[0][0][0][1] is None  # no residual kept
    with_ef = reference(seed, 2, "fp4", 4, 2)[0]
    assert any(not torch.equal(a, b) for a, b in zip(outer, with_ef)), f"seed {seed}"


@pytest.mark.parametrize("codec,fragments,dense", [("fp4", 1, 0), ("fp4", 2, 0), ("topk", 1, 0), ("topk", 2, 0),
                                                  ("topk", 2, 1)])
def test_a_checkpoint_mid_run_resumes_bit_for_bit(seed, tmp_path, codec, fragments, dense):
    """fp4 and topk with error feedback: state_dicts written after 6 of 12 inner steps (through torch.save),
    loaded into fresh models, optimizers and DiLoCos, give the uninterrupted run's outer weights and residuals
    (topk's residual holds the owners' part too). With a dense start of one outer step per fragment, fragment 1's
    first sparse outer step comes after the resume."""
    H, K, stop = 4, 3, 6
    settings = dict(dense_outer_steps=dense) if dense else {}
    whole = run_diloco(seed, 2, codec, H, K, fragments=fragments, stop_at=stop, **settings)
    resume = []
    for r, (_, saved) in enumerate(whole):
        path = tmp_path / f"node{r}.pt"
        torch.save(saved, path)
        resume.append(torch.load(path, weights_only=False))
        dsd = saved[2]
        held = dsd["fragments"][0]["residual"]
        assert held.abs().sum() > 0, "the checkpoint holds the node's residual"
    resumed = run_diloco(seed, 2, codec, H, K, fragments=fragments, resume=resume, **settings)
    for r in range(2):
        for (w1, e1), (w2, e2) in zip(whole[r][0], resumed[r][0]):
            for a, b in zip(w1 + e1, w2 + e2):
                assert torch.equal(a, b), f"seed {seed}: node {r} differs after the resume"


def test_error_feedback_bounds_the_accumulated_error(seed):
    """lr 1 without momentum: the outer weights move by the sum of the averages. Over 30 outer steps of fixed
    random pseudo-gradients, fp4 with error feedback ends nearer the exact sum than fp4 without: the nodes'
    quantization errors no longer add up (only the owner's quantization of each average does)."""
    gen = torch.Generator().manual_seed(seed)
    nodes, K, n = 2, 30, 2048
    w0 = torch.randn(n, generator=gen)
    deltas = [[0.01 * torch.randn(n, generator=gen) for _ in range(nodes)] for _ in range(K)]

    def run(feedback):
        group = FakeGroup(nodes)

        def node(r):
            model = nn.Linear(n, 1, bias=False)
            with torch.no_grad():
                model.weight.copy_(w0.view(1, -1))
            d = DiLoCo(model, None, DirectFakeRing(group, r), inner_steps=1, outer_lr=1.0, outer_momentum=0.0,
                       nesterov=False, codec="fp4", block_size=256, error_feedback=feedback)
            for k in range(K):
                with torch.no_grad():
                    model.weight -= deltas[k][r].view(1, -1)
                d.step()
            return model.weight.detach().view(-1).double().clone()

        return run_nodes(nodes, node)

    exact = w0.double() - sum(sum(d.double() for d in ds) / nodes for ds in deltas)
    err = {}
    for feedback in (False, True):
        w = run(feedback)
        assert torch.equal(w[0], w[1]), f"seed {seed}: nodes differ"
        err[feedback] = float((w[0] - exact).norm() / (w0.double() - exact).norm())
    print(f"seed {seed}: relative error of the summed update, fp4 without / with error feedback: "
          f"{err[False]:.4f} / {err[True]:.4f}")
    assert err[True] < 0.8 * err[False], f"seed {seed}: {err}"


class _JoiningSync(_AveragingAlone):
    """A Sync whose first average reports that this node did not contribute (an elastic joiner's); the rest of the
    protocol (bind, agree, verify, committed) as a lone node's."""

    def __init__(self):
        self.world_size, self.calls = 2, 0

    def average(self, grad, *, outer_step, inner_step, recompute):
        self.calls += 1
        grad.mul_(0.5)
        return SyncResult(members=[0, 1], contributors=2 - (self.calls == 1), contributed=self.calls > 1)

    def close(self):
        pass


def test_a_node_that_joins_starts_from_a_zero_residual(seed):
    """Elastic: the residual is the node's own memory, not part of the state a joiner downloads; at the outer step
    where a node joins (its pseudo-gradient is not in the average) its residual is zeroed, at the next one it is
    what its own contribution lost."""
    gen = torch.Generator().manual_seed(seed)
    model = nn.Linear(64, 2, bias=False)
    d = DiLoCo(model, None, _JoiningSync(), inner_steps=1, codec="fp4", block_size=BS)
    st = d.state
    st.residual.copy_(torch.randn(st.numel, generator=gen))  # left over from before: must not leak into the join
    for k in range(2):
        before = st.outer.clone()
        with torch.no_grad():
            model.weight -= 0.01 * torch.randn(2, 64, generator=gen)
        p = torch.sub(before, st._locals()[0].reshape(-1)) + (st.residual.clone() if k else 0)
        d.step()
        if k == 0:
            assert not st.residual.any(), f"seed {seed}: the joiner kept a residual"
        else:
            assert torch.equal(st.residual, p - rt_ref(p, "fp4")), f"seed {seed}"


# -- settings -----------------------------------------------------------------------------------------------


def test_error_feedback_defaults_and_errors():
    model = nn.Linear(4, 4)
    ring = DirectFakeRing(FakeGroup(1), 0)
    assert DiLoCo(model, None, ring, codec="fp4").error_feedback is True
    assert DiLoCo(model, None, ring, codec="int8").error_feedback is False
    assert DiLoCo(model, None, ring, codec="int8", error_feedback=True).error_feedback is True
    assert DiLoCo(model, None, ring, codec="none").error_feedback is False
    assert DiLoCo(model, None, ring, codec="fp4", error_feedback=False).state.residual is None
    with pytest.raises(ValueError, match="error_feedback = true needs a lossy codec"):
        DiLoCo(model, None, ring, codec="none", error_feedback=True)
    with pytest.raises(ValueError, match="error_feedback must be True, False or None"):
        DiLoCo(model, None, ring, codec="fp4", error_feedback="yes")
    # the setting is part of what every node must share
    assert DiLoCo(model, None, ring, codec="fp4").settings()["error_feedback"] is True
    assert "error_feedback" not in DiLoCo(model, None, ring, codec="int8").settings()
    # the residual's decay: in (0, 1], and only where there is a residual
    assert DiLoCo(model, None, ring, codec="fp4", feedback_decay=0.9).state.feedback_decay == 0.9
    for bad in (0, 1.5, -0.1, True, "0.9"):
        with pytest.raises(ValueError, match=r"feedback_decay must be a number in \(0, 1\]"):
            DiLoCo(model, None, ring, codec="fp4", feedback_decay=bad)
    with pytest.raises(ValueError, match="feedback_decay = 0.9 needs error feedback"):
        DiLoCo(model, None, ring, codec="int8", feedback_decay=0.9)


def test_the_average_density_is_a_topk_setting_every_node_shares():
    model = nn.Linear(64, 64)
    ring = DirectFakeRing(FakeGroup(1), 0)
    d = DiLoCo(model, None, ring, codec="topk", block_size=256, density=4 / 256, average_density=8 / 256)
    assert (d.keep, d.keep_average) == (4, 8)
    assert d.settings()["keep"] == 4 and d.settings()["keep_average"] == 8
    same = DiLoCo(model, None, ring, codec="topk", block_size=256, density=4 / 256)
    assert same.keep_average == 4 and "keep_average" not in same.settings()  # one k: the settings of before
    with pytest.raises(ValueError, match="average_density is a setting of codec 'topk', not of 'int8'"):
        DiLoCo(model, None, ring, codec="int8", average_density=0.1)
    assert DiLoCo(model, None, ring, codec="topk", block_size=256, average_density=0.9).keep_average == 230
    with pytest.raises(ValueError, match=r"average_density: sparse density must be in \(0, 1\]"):
        DiLoCo(model, None, ring, codec="topk", block_size=256, average_density=1.5)
    # nodes that keep other counts, or decay their residuals otherwise, refuse each other at the replica check
    decayed = DiLoCo(model, None, ring, codec="topk", block_size=256, density=4 / 256, feedback_decay=0.9)
    assert decayed.settings()["feedback_decay"] == 0.9 and same.settings()["feedback_decay"] == 0.8  # topk's default
    prints = {x._fingerprint()[1] for x in (d, same, decayed)}
    assert len(prints) == 3 and d._fingerprint()[0] == same._fingerprint()[0]  # the same weights, other settings


def test_unset_settings_take_the_codecs_defaults():
    """topk's outer step when its settings are unset (prime.codecs.TOPK_DEFAULTS): 48 / 96 of 4096, decay 0.8,
    outer lr 3 without momentum; the block codecs keep Nesterov 0.7 / 0.9; what is set wins, in DiLoCo and in the
    config alike."""
    from prime.codecs import TOPK_DEFAULTS

    model = nn.Linear(64, 64)
    ring = DirectFakeRing(FakeGroup(1), 0)
    d = DiLoCo(model, None, ring, codec="topk")
    s = d.settings()
    assert (d.keep, d.keep_average, d.feedback_decay) == (48, 96, 0.8)
    assert (s["outer_lr"], s["outer_momentum"]) == (3.0, 0.0)
    i = DiLoCo(model, None, ring, codec="int8").settings()
    fp4 = DiLoCo(model, None, ring, codec="fp4")
    assert (i["outer_lr"], i["outer_momentum"], fp4.feedback_decay) == (0.7, 0.9, 1.0)
    mine = DiLoCo(model, None, ring, codec="topk", outer_lr=1.0, feedback_decay=0.95, density=64 / 4096)
    assert (mine.settings()["outer_lr"], mine.feedback_decay, mine.keep, mine.keep_average) == (1.0, 0.95, 64, 64)
    cfg = load_config(None, [("diloco.codec", "topk")], env={}).validate()
    assert cfg.diloco.outer_settings() == TOPK_DEFAULTS
    cfg = load_config(None, [("diloco.codec", "topk"), ("diloco.outer_lr", "1"), ("diloco.density", "0.015625")],
                      env={}).validate()
    assert cfg.diloco.outer_settings() == dict(TOPK_DEFAULTS, outer_lr=1.0, density=1 / 64, average_density=1 / 64)
    assert load_config(None, [], env={}).validate().diloco.outer_settings() == dict(
        outer_lr=0.7, outer_momentum=0.9, feedback_decay=1.0, density=None, average_density=None)
    with pytest.raises(ValueError, match=r"diloco\.outer_lr must be > 0"):
        load_config(None, [("diloco.codec", "topk"), ("diloco.outer_lr", "0")], env={}).validate()


def test_config_field():
    cfg = load_config(None, [("diloco.codec", "fp4")], env={}).validate()
    assert cfg.diloco.error_feedback is None
    cfg = load_config(None, [("diloco.error_feedback", "false"), ("diloco.codec", "fp4")], env={}).validate()
    assert cfg.diloco.error_feedback is False
    with pytest.raises(ValueError, match=r"diloco\.error_feedback = true needs a lossy codec"):
        load_config(None, [("diloco.error_feedback", "true"), ("diloco.codec", "none")], env={}).validate()
    with pytest.raises(ValueError, match=r"diloco\.error_feedback must be a bool"):
        load_config(None, [("diloco.error_feedback", "maybe")], env={})
    cfg = load_config(None, [("diloco.codec", "topk"), ("diloco.feedback_decay", "0.95"),
                             ("diloco.average_density", "0.03125")], env={}).validate()
    assert (cfg.diloco.feedback_decay, cfg.diloco.average_density) == (0.95, 0.03125)
    with pytest.raises(ValueError, match=r"diloco\.feedback_decay = 0.9 needs error feedback"):
        load_config(None, [("diloco.feedback_decay", "0.9")], env={}).validate()  # int8: no residual
    with pytest.raises(ValueError, match=r"diloco\.feedback_decay must be a number in \(0, 1\]"):
        load_config(None, [("diloco.codec", "fp4"), ("diloco.feedback_decay", "0")], env={}).validate()
    with pytest.raises(ValueError, match=r"diloco\.average_density.*unset unless diloco\.codec = 'topk'"):
        load_config(None, [("diloco.average_density", "0.1")], env={}).validate()
    with pytest.raises(ValueError, match=r"diloco\.average_density.*in \(0, 1\]"):
        load_config(None, [("diloco.codec", "topk"), ("diloco.average_density", "2")], env={}).validate()
    load_config(None, [("diloco.codec", "topk"), ("diloco.average_density", "0.9")], env={}).validate()  # under int8


def test_a_checkpoint_without_a_residual_starts_from_zero(seed):
    """Turning error feedback on at a resume: the checkpoint has no residual, the node starts from zero."""
    model = nn.Linear(8, 2)
    ring = DirectFakeRing(FakeGroup(1), 0)
    sd = DiLoCo(model, None, ring, codec="int8").state_dict()
    d = DiLoCo(model, None, ring, codec="int8", error_feedback=True)
    d.state.residual.fill_(1.0)
    d.load_state_dict(sd)
    assert not d.state.residual.any()


# -- where the residual lives -------------------------------------------------------------------------------


def residual_passes(states: list, params_list: list, gen, codec: str, steps: int = 3) -> None:
    """Runs the error-feedback passes of 3 synchronous outer steps on every OuterState (each over its own copy of
    the same parameters, params_list[i]) and asserts that contributions, residuals and outer weights agree bit for
    bit between them."""
    for st in states:
        st.take()
    for step in range(steps):
        deltas = [0.01 * torch.randn(p.shape, generator=gen) for p in params_list[0]]
        with torch.no_grad():
            for params in params_list:
                for p, d in zip(params, deltas):
                    p.sub_(d.to(p.device))
        gs = []
        for st in states:
            g = st.new_buffer()
            st.pseudo_gradient(g)
            st.compensate(g)
            gs.append(g.cpu())
        avg = fake_average([gs[0], 0.5 * gs[0]], codec, st.block_size)  # any average, the same for every state
        for st in states:
            st.commit_residual()
            st.update(avg.to(st.work_device), load=True)
        for i, st in enumerate(states[1:], 1):
            what = f"step {step}, state {i} ({st.device}, streamed {st.streamed})"
            assert torch.equal(gs[0], gs[i]), f"{what}: contribution"
            assert torch.equal(states[0].residual.cpu(), st.residual.cpu()), f"{what}: residual"
            assert torch.equal(states[0].outer.cpu(), st.outer.cpu()), f"{what}: outer weights"
    assert states[0].residual.abs().sum() > 0


@pytest.mark.parametrize("codec", CODECS)
def test_streamed_residual_passes_match_the_resident_ones(seed, codec, monkeypatch):
    """The residual streamed through staging pieces (the path of a CPU home on a GPU model, here with CPU staging)
    gets the same bits as resident, with parameters cut into several pieces."""
    from prime.outer import OuterState

    monkeypatch.setattr("prime.layout._CHUNK", 1024)
    gen = torch.Generator().manual_seed(seed)
    shapes = [(100, 37), (4097,), (3, 5, 7), (1,)]
    init = [torch.randn(*s, generator=gen) for s in shapes]
    params_list = [[nn.Parameter(t.clone()) for t in init] for _ in range(2)]
    states = [OuterState(params, block_size=256, error_feedback=codec, stream=streamed)
              for params, streamed in zip(params_list, (False, True))]
    assert states[1].streamed and not states[0].streamed
    residual_passes(states, params_list, gen, codec)


def test_fragments_with_overlap_keep_nodes_identical(seed):
    """fp4 with error feedback, 2 fragments with overlap (eager-merge; not in the reference above): the nodes end
    with the same outer weights after finish(), each with a residual of its own per fragment."""
    got = run_diloco(seed, 2, "fp4", 4, 3, fragments=2, overlap="eager-merge")
    for (w0, e0), (w1, e1) in zip(got[0][0], got[1][0]):
        assert all(torch.equal(a, b) for a, b in zip(w0, w1)), f"seed {seed}: outer weights differ"
        assert any(not torch.equal(a, b) for a, b in zip(e0, e1)), f"seed {seed}: residuals are the same"


def test_a_resume_names_each_outer_setting_that_changed(tmp_path, seed):
    """A checkpoint records the outer update's settings in effect (unset ones resolved: topk's defaults); a run
    resumed with other ones loads and names each change, (name, the checkpoint's, now), through the checkpoint
    format; the same settings, or a checkpoint that did not record them, name none."""
    from prime.checkpoint import Checkpointer, TrainCheckpoints
    from prime.diloco import describe_changes
    from test_builders import _Position

    def build(**kw):
        model = tiny_model(seed)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        d = DiLoCo(model, opt, DirectFakeRing(FakeGroup(1), 0), inner_steps=4, codec="topk", block_size=BS, **kw)
        return model, opt, d

    model, opt, d = build()
    for step in range(1, 6):
        inner_step(model, opt, seed, 0, step)
        d.step()
    ck = TrainCheckpoints(Checkpointer(str(tmp_path), 0, 0, 1, async_save=False), model, opt, _Position(), d,
                          local_sum=lambda v: list(v))
    assert ck.save(5, block=True)
    ck.close()
    sd = d.state_dict()
    assert sd["settings"]["outer_lr"] == 3.0 and sd["settings"]["keep"] == max(1, round(48 / 4096 * BS))
    d.close()
    for kw, want in ((dict(outer_lr=2.0, dense_outer_steps=1), [("outer_lr", 3.0, 2.0), ("dense_outer_steps", 0, 1)]),
                     (dict(feedback_decay=1.0), [("feedback_decay", 0.8, 1.0)]), ({}, [])):
        model, opt, d = build(**kw)
        ck = TrainCheckpoints(Checkpointer(str(tmp_path), 0, 0, 1, async_save=False), model, opt, _Position(), d,
                              local_sum=lambda v: list(v))
        assert ck.resume(None, 0, 1, publish=True) == 5
        assert d.resume_changes == want, d.resume_changes
        ck.close()
        d.close()
    line = describe_changes([("outer_lr", 3.0, 2.0)])
    assert "outer_lr 2.0 (was 3.0)" in line and line.count("\n") == 0
    model, opt, d = build(outer_lr=2.0)
    d.load_state_dict({k: v for k, v in sd.items() if k != "settings"})  # written before settings were recorded
    assert d.resume_changes == []
    d.close()
