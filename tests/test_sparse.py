"""The sparse top-k format (prime/sparse.py) against bytes worked out by hand and a float64 reference."""

import pytest
import torch

from prime import _extension, ops, sparse


def test_two_chunks_give_the_bytes_worked_out_by_hand():
    # chunk 16, k 4. Chunk 0 keeps 3.0, 2.0, 1.0, 0.75: hi = mean(3, 2) = 2.5 (bf16 0x4020), lo = mean(1, 0.75) =
    # 0.875 (0x3F60), threshold 1.6875; positions 1, 3, 6, 11; codes (bit 0 hi, bit 1 negative) 3, 0, 1, 2.
    # Positions: 4 x 2^2 <= 16, so 2 lower bits (1, 3, 2, 3) and upper parts 0, 0, 1, 2 in unary: bits 0, 1, 3, 5
    # of 4 + 16 / 4 = 8. The last chunk (5 values) keeps ceil(5 * 4 / 16) = 2: 4.0 and -1.0, positions 1, 2;
    # 2 x 2^3 <= 16: 3 lower bits (1, 2), upper parts 0, 0: bits 0, 1 of 2 + 16 / 8 = 4.
    x = torch.tensor([0.5, -3.0, 0.25, 1.0, 0, 0, 2.0, 0, 0, 0, 0, -0.75, 0, 0, 0, 0.125,
                      0.0, 4.0, -1.0, 0.5, 0.0])
    want = [0x60, 0x3F, 0x20, 0x40, 0b101011, 1 | 3 << 2 | 2 << 4 | 3 << 6, 3 | 0 << 2 | 1 << 4 | 2 << 6,
            0x80, 0x3F, 0x80, 0x40, 0b11, 1 | 2 << 3, 1 | 2 << 2]
    payload = sparse.encode(x, chunk=16, k=4)
    assert payload.tolist() == want
    assert sparse.payload_bytes(21, 16, 4) == len(want)
    decoded = sparse.decode(payload, 21, chunk=16, k=4)
    expect = torch.zeros(21)
    expect[[1, 3, 6, 11]] = torch.tensor([-2.5, 0.875, 2.5, -0.875])
    expect[[17, 18]] = torch.tensor([4.0, -1.0])
    assert torch.equal(decoded, expect)


def _reference(x: torch.Tensor, chunk: int, k: int) -> torch.Tensor:
    """The decoded tensor, from the format's definition, in float64 and plain Python."""
    out = [0.0] * x.numel()
    vals = x.tolist()

    def bf16(v):
        return torch.tensor(v, dtype=torch.float64).to(torch.bfloat16).item()

    def mean(ms):  # float64, added left to right
        total = 0.0
        for m in ms:
            total = total + m
        return total / len(ms)

    for s in range(0, len(vals), chunk):
        part = vals[s : s + chunk]
        keep = -(-len(part) * k // chunk)
        by_size = sorted(range(len(part)), key=lambda i: (-abs(part[i]), i))[:keep]
        kept = sorted(by_size)  # ascending position
        upper = set(by_size[: (keep + 1) // 2])
        c_hi = mean([abs(part[i]) for i in kept if i in upper])
        rest = [abs(part[i]) for i in kept if i not in upper]
        c_lo = mean(rest) if rest else c_hi
        high = [i for i in kept if abs(part[i]) >= (c_lo + c_hi) / 2]
        low = [i for i in kept if abs(part[i]) < (c_lo + c_hi) / 2]
        hi = bf16(mean([abs(part[i]) for i in high]))
        lo = bf16(mean([abs(part[i]) for i in low])) if low else hi
        for i in kept:
            m = hi if i in high else lo
            out[s + i] = -m if part[i] < 0 else m
    return torch.tensor(out, dtype=torch.float32)


def test_levels_are_the_means_of_their_members_and_a_round_trip_is_a_fixed_point():
    # chunk 16, k 4, kept 10, -1, 1, 1: the halves' means 5.5 and 1 split at 3.25, so 10 alone is hi = 10 and
    # the three 1s are lo = 1: every kept value decodes exactly.
    x = torch.zeros(16)
    x[[2, 5, 9, 14]] = torch.tensor([1.0, 10.0, -1.0, 1.0])
    assert torch.equal(sparse.decode(sparse.encode(x, chunk=16, k=4), 16, chunk=16, k=4), x)
    # decode(encode(.)) of any tensor is a fixed point, so a contribution error feedback already passed through
    # the format travels unchanged
    gen = torch.Generator().manual_seed(11)
    for chunk, k in ((16, 3), (256, 8), (4096, 64), (128, 128)):
        x = torch.randn(5 * chunk + 7, generator=gen) * torch.exp(2 * torch.randn(5 * chunk + 7, generator=gen))
        y = sparse.decode(sparse.encode(x, chunk=chunk, k=k), x.numel(), chunk=chunk, k=k)
        assert torch.equal(sparse.decode(sparse.encode(y, chunk=chunk, k=k), x.numel(), chunk=chunk, k=k), y)


@pytest.mark.parametrize("n,chunk,k", [(5000, 256, 4), (4096, 4096, 64), (10000, 4096, 64), (300, 16, 3),
                                       (1, 64, 1), (777, 128, 128)])
def test_decode_matches_the_float64_reference_and_the_sizes(n, chunk, k):
    gen = torch.Generator().manual_seed(n * 31 + k)
    x = torch.randn(n, generator=gen) * torch.exp(torch.randn(n, generator=gen))  # heavy-tailed, no ties
    payload = sparse.encode(x, chunk=chunk, k=k)
    assert payload.numel() == sparse.payload_bytes(n, chunk, k)
    decoded = sparse.decode(payload, n, chunk=chunk, k=k)
    assert torch.equal(decoded, _reference(x, chunk, k))
    for s in range(0, n, chunk):  # exactly the top k_j of each chunk, each with its sign
        part, got = x[s : s + chunk], decoded[s : s + chunk]
        keep = sparse.chunk_keep(part.numel(), chunk, k)
        top = set(part.abs().topk(keep).indices.tolist())
        assert set(got.nonzero().flatten().tolist()) == top
        assert torch.equal(torch.sign(got[list(top)]), torch.sign(part[list(top)]))


needs_kernels = pytest.mark.skipif(not _extension.available(), reason="prime._C is not built")


def _nasty(n: int, gen: torch.Generator) -> torch.Tensor:
    """Heavy tails, exact ties, zeros of both signs, subnormals and a run of equal magnitudes."""
    x = torch.randn(n, generator=gen) * torch.exp(3 * torch.randn(n, generator=gen))
    pick = torch.randint(0, 6, (n,), generator=gen)
    x = torch.where(pick == 0, torch.round(x), x)  # many exact ties
    x = torch.where(pick == 1, torch.zeros(n), x)
    x = torch.where(pick == 2, torch.full((n,), -0.0), x)
    x = torch.where(pick == 3, x * 1e-40, x)  # subnormal
    if n > 40:
        x[10:40] = 2.5 * torch.sign(torch.randn(30, generator=gen))
    return x


@needs_kernels
@pytest.mark.parametrize("chunk,k", [(16, 1), (16, 3), (16, 16), (64, 5), (256, 8), (1024, 33), (4096, 64),
                                     (4096, 4096)])
def test_the_kernels_give_the_references_bytes_and_values(chunk, k):
    gen = torch.Generator().manual_seed(chunk * 7 + k)
    for n in (1, chunk - 1, chunk, 3 * chunk + 5, 9 * chunk):
        for x in (torch.randn(n, generator=gen), _nasty(n, gen), torch.zeros(n)):
            want = sparse.encode_reference(x, chunk, k)
            got = sparse.encode(x, chunk, k, backend="cpu")
            assert torch.equal(got, want), (n, chunk, k)
            ref = sparse.decode_reference(want, n, chunk, k)
            dec = sparse.decode(got, n, chunk, k, backend="cpu")
            assert torch.equal(dec.view(torch.int32), ref.view(torch.int32)), (n, chunk, k)  # bits, signed zeros too
            acc = torch.randn(n, generator=gen)
            want_acc = acc + ref
            torch.ops.prime.sparse_decode_add_(acc, got, chunk, k)
            kept = ref != 0
            assert torch.equal(acc[kept], want_acc[kept])


@needs_kernels
def test_the_kernels_refuse_what_the_reference_refuses():
    with pytest.raises(ValueError, match="non-finite"):
        sparse.encode(torch.tensor([1.0, float("inf")] * 20), chunk=16, k=2, backend="cpu")
    with pytest.raises(ValueError, match="overflows bf16"):
        sparse.encode(torch.full((16,), 3.4e38), chunk=16, k=2, backend="cpu")
    with pytest.raises(ValueError, match="overflows bf16"):
        sparse.encode_reference(torch.full((16,), 3.4e38), chunk=16, k=2)
    for nan_at in (3, 40):  # NaN in one chunk, an overflow in another: the input is not finite, whatever the order
        both = torch.cat([torch.randn(32), torch.full((16,), 3.4e38)]) if nan_at == 3 else \
            torch.cat([torch.full((16,), 3.4e38), torch.randn(32)])
        both[nan_at] = float("nan")
        with pytest.raises(ValueError, match="non-finite"):
            sparse.encode(both, chunk=16, k=2, backend="cpu")
        with pytest.raises(ValueError, match="non-finite"):
            sparse.encode_reference(both, chunk=16, k=2)
    with pytest.raises(ValueError, match=r"values kept per chunk must be in \[1"):
        sparse.lower_bits(0, 4096)
    payload = sparse.encode(torch.randn(100), chunk=16, k=4, backend="cpu")
    with pytest.raises(ValueError, match="expected"):
        sparse.decode(payload[:-1], 100, chunk=16, k=4, backend="cpu")
    for what, bad in malformed_payloads():
        for backend in ("torch", "cpu"):
            with pytest.raises(ValueError, match="not ascending"):
                sparse.decode(bad, 21, chunk=16, k=4, backend=backend)
            acc = torch.arange(21.0)
            with pytest.raises(ValueError, match="not ascending"):
                sparse.decode_add_(acc, bad, chunk=16, k=4, backend=backend)
            assert torch.equal(acc, torch.arange(21.0)), (what, backend)


def malformed_payloads() -> list:
    """(what is wrong, payload) for 21 values, chunk 16, k 4: the hand-worked payload above with each way its
    positions can be malformed at the right size."""
    good = [0x60, 0x3F, 0x20, 0x40, 0b101011, 1 | 3 << 2 | 2 << 4 | 3 << 6, 3 | 0 << 2 | 1 << 4 | 2 << 6,
            0x80, 0x3F, 0x80, 0x40, 0b11, 1 | 2 << 3, 1 | 2 << 2]
    cases = {"an upper bit missing": (4, 0b001011), "an upper bit too many": (4, 0b1101011),
             "a bit past the area's positions": (4, 0b10000000 | 0b1011),
             "lower parts descending in a bucket": (5, 3 | 1 << 2 | 2 << 4 | 3 << 6),
             "lower parts equal in a bucket": (5, 1 | 1 << 2 | 2 << 4 | 3 << 6),
             "a position past a short chunk's end": (11, 0b101)}
    out = []
    for what, (at, byte) in cases.items():
        bad = list(good)
        bad[at] = byte
        out.append((what, torch.tensor(bad, dtype=torch.uint8)))
    return out


def selection_corner_chunks(gen: torch.Generator) -> torch.Tensor:
    """Chunks of 4096 that take the GPU encoders' rarer selection paths at k = 64 (kernels/_sparse_kernels.py,
    csrc/codec/sparse_cuda.cu): a zero group of each kernel's grouping (a run of 64; the first 4 of every 256),
    so that the bound from the groups' maxima leaves more candidates than the kernel holds and the threshold is
    searched over the whole chunk; more values tied at the bound than it holds (spread, so every group's maximum
    is the tie); every value equal; every value zero; ties at the top of a few groups only; then a short last
    chunk."""
    def noise():
        return torch.randn(4096, generator=gen)

    zero_run, zero_stride = noise(), noise()
    zero_run[:64] = 0.0
    zero_stride.view(-1, 256)[:, :4] = 0.0
    spread_ties = noise() * 0.1
    spread_ties[::7] = 3.0 * torch.sign(torch.randn(586, generator=gen))
    top_ties = noise()
    top_ties[:600] = -2.0 ** 20
    return torch.cat([zero_run, zero_stride, spread_ties, torch.full((4096,), 1.5), torch.zeros(4096), top_ties,
                      noise()[:1000]])


needs_cuda_kernels = pytest.mark.skipif(not (torch.cuda.is_available() and _extension.has_cuda_kernels()),
                                        reason="needs a GPU and a CUDA build of prime._C")


@needs_cuda_kernels
@pytest.mark.parametrize("chunk,k", [(16, 1), (16, 3), (16, 16), (64, 5), (256, 8), (1024, 33), (4096, 16),
                                     (4096, 64), (4096, 256), (4096, 300), (4096, 4096)])
def test_the_cuda_kernels_give_the_cpu_kernels_bytes_and_values(chunk, k):
    gen = torch.Generator().manual_seed(chunk * 7 + k)
    inputs = [(n, x) for n in (1, chunk - 1, chunk, 3 * chunk + 5, 200 * chunk + 7)
              for x in (torch.randn(n, generator=gen), _nasty(n, gen), torch.zeros(n))]
    corner = selection_corner_chunks(gen)
    inputs.append((corner.numel(), corner))
    for n, x in inputs:
        want = sparse.encode(x, chunk, k, backend="cpu")
        got = sparse.encode(x.cuda(), chunk, k, backend="cuda")
        assert got.is_cuda and torch.equal(got.cpu(), want), (n, chunk, k)
        unaligned = torch.cat([torch.zeros(1), x]).cuda()[1:]  # 4 bytes past a 16-byte boundary: no vector loads
        assert torch.equal(sparse.encode(unaligned, chunk, k, backend="cuda").cpu(), want), (n, chunk, k)
        dec = sparse.decode(got, n, chunk, k, backend="cuda")
        assert torch.equal(dec.cpu().view(torch.int32), sparse.decode(want, n, chunk, k).view(torch.int32))
        acc = torch.randn(n, generator=gen)
        out = sparse.decode_add_(acc.cuda(), got, chunk, k, backend="cuda")
        assert torch.equal(out.cpu(), sparse.decode_add_(acc, want, chunk, k, backend="cpu")), (n, chunk, k)


@needs_cuda_kernels
def test_the_cuda_kernels_refuse_bad_input_and_leave_the_accumulator():
    x = torch.ones(64, device="cuda")
    x[3] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        sparse.encode(x, 32, 4, backend="cuda")
    with pytest.raises(ValueError, match="overflows bf16"):
        sparse.encode(torch.full((32,), 3.4e38, device="cuda"), 32, 4, backend="cuda")
    both = torch.cat([torch.full((32,), 3.4e38), torch.randn(32)]).cuda()
    both[40] = float("nan")  # NaN in one chunk, an overflow in another: not finite
    with pytest.raises(ValueError, match="non-finite"):
        sparse.encode(both, 32, 4, backend="cuda")
    payload = sparse.encode(torch.arange(64.0, device="cuda"), 32, 4, backend="cuda")
    for what, bad in malformed_payloads():
        acc = torch.arange(21.0, device="cuda")
        with pytest.raises(ValueError, match="not ascending"):
            sparse.decode_add_(acc, bad.cuda(), 16, 4, backend="cuda")
        assert torch.equal(acc.cpu(), torch.arange(21.0)), what
        with pytest.raises(ValueError, match="not ascending"):
            sparse.decode(bad.cuda(), 21, 16, 4, backend="cuda")
    with pytest.raises(ValueError, match="expected"):
        sparse.decode(payload[:-1], 64, 32, 4, backend="cuda")
    assert sparse._backend(None, torch.device("cuda")) == "cuda"


def test_ties_go_to_the_lower_index_and_an_empty_tensor_is_empty():
    x = torch.ones(32)
    got = sparse.decode(sparse.encode(x, chunk=16, k=2), 32, chunk=16, k=2)
    assert got.nonzero().flatten().tolist() == [0, 1, 16, 17]
    assert sparse.encode(torch.zeros(0), chunk=16, k=2).numel() == 0 == sparse.payload_bytes(0, 16, 2)


def test_at_the_default_density_it_is_thirty_times_smaller_than_int8():
    int8 = ops.wire_bytes(1 << 20, ops.DEFAULT_BLOCK_SIZE, "int8") / (1 << 20)
    per_value = sparse.bytes_per_value(sparse.CHUNK, 64)
    # 64 x 2^6 <= 4096: 6 lower bits a position (48 bytes), upper parts in 64 + 4096 / 64 bits (16 bytes)
    assert sparse.lower_bits(64, 4096) == 6 and per_value == (4 + 16 + 48 + 64 // 4) / 4096
    assert int8 / per_value > 30
    assert sparse.payload_bytes(1 << 20) == (1 << 20) // 4096 * (4 + 16 + 48 + 16)
    # the compact positions against 12 bits each, at DiLoCo's densities: 48 and 96 of 4096
    assert [sparse.payload_bytes(4096, 4096, k) for k in (48, 96)] == [4 + 14 + 36 + 12, 4 + 28 + 60 + 24]
    assert [4 + k * 12 // 8 + k // 4 for k in (48, 96)] == [88, 172]
    assert sparse.keep_for_density(0.0156) == 64 and sparse.density(4096, 64) == 64 / 4096


def test_error_feedback_keeps_what_the_payload_drops():
    # Over rounds, what was sent plus the residual carried is what was put in (up to fp32 rounding), and the
    # residual stays bounded: nothing is lost for good.
    gen = torch.Generator().manual_seed(7)
    n, rounds = 8192, 12
    residual, sent, put = torch.zeros(n), torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
    for _ in range(rounds):
        x = torch.randn(n, generator=gen)
        v = x + residual
        out = sparse.decode(sparse.encode(v, chunk=1024, k=32), n, chunk=1024, k=32)
        residual = v - out
        sent += out.double()
        put += x.double()
    assert torch.allclose(sent + residual.double(), put, atol=1e-4)
    assert residual.norm() < 4 * put.norm()


def test_bad_input_is_refused_with_what_is_wrong():
    with pytest.raises(ValueError, match="power of two"):
        sparse.encode(torch.randn(10), chunk=100, k=4)
    with pytest.raises(ValueError, match=r"k \(values kept"):
        sparse.encode(torch.randn(10), chunk=16, k=17)
    with pytest.raises(ValueError, match="non-finite"):
        sparse.encode(torch.tensor([1.0, float("nan")]), chunk=16, k=1)
    with pytest.raises(ValueError, match="flat float32"):
        sparse.encode(torch.randn(4, 4), chunk=16, k=1)
    payload = sparse.encode(torch.randn(100), chunk=16, k=4)
    with pytest.raises(ValueError, match="expected"):
        sparse.decode(payload[:-1], 100, chunk=16, k=4)
    bad = payload.clone()
    bad[4] = 0x00  # the first two positions of chunk 0 become 0 and 0: not ascending
    with pytest.raises(ValueError, match="not ascending"):
        sparse.decode(bad, 100, chunk=16, k=4)
    with pytest.raises(ValueError, match="density"):
        sparse.keep_for_density(0.0)


# -- the collective (reference: owners sum and select again, then every rank gets every shard) ---------------


def test_shards_are_whole_chunks_covering_the_tensor_once():
    for n, world, chunk in ((50000, 4, 4096), (4096, 3, 4096), (100, 2, 16), (0, 2, 16), (16 * 7, 7, 16)):
        parts = sparse.shards(n, world, chunk)
        assert len(parts) == world and parts[0][0] == 0 and parts[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(parts, parts[1:]))
        assert all(lo % chunk == 0 and lo <= hi for lo, hi in parts)
        counts = [-(-(hi - lo) // chunk) for lo, hi in parts]
        assert max(counts) - min(counts) <= 1 or n < chunk * world


@pytest.mark.parametrize("world", [2, 3, 5])
def test_owner_average_matches_a_plain_reference_and_conserves_every_contribution(world):
    n, chunk, k = 3000 + world * 77, 256, 8
    gen = torch.Generator().manual_seed(world)
    contributions = [torch.randn(n, generator=gen) * torch.exp(torch.randn(n, generator=gen)) for _ in range(world)]
    got = sparse.owner_average(contributions, chunk, k)
    # the reference: the owner's own values exact, the other ranks' shards through the format (plain float64
    # Python), added in the order o+1, o+2, ... in fp32, over the world size, through the format again
    want = torch.zeros(n)
    for o, (lo, hi) in enumerate(sparse.shards(n, world, chunk)):
        total = contributions[o][lo:hi].clone()
        for j in range(1, world):
            total += _reference(contributions[(o + j) % world][lo:hi], chunk, k)
        want[lo:hi] = _reference(total / world, chunk, k)
    assert torch.equal(got.average, want)
    # nothing is lost for good: what every rank put in = world x what it applies + the residuals they keep
    put = sum(c.double() for c in contributions)
    kept = world * got.average.double() + sum(r.double() for r in got.residuals)
    assert torch.allclose(kept, put, rtol=0, atol=1e-5 * float(put.abs().max())), float((kept - put).abs().max())
    # each rank sends its payload of every other shard, and its own shard's sum to every other rank
    parts = sparse.shards(n, world, chunk)
    for r in range(world):
        others = sum(sparse.payload_bytes(hi - lo, chunk, k) for q, (lo, hi) in enumerate(parts) if q != r)
        own = (world - 1) * sparse.payload_bytes(parts[r][1] - parts[r][0], chunk, k)
        assert got.sent[r] == others + own


@needs_cuda_kernels
def test_owner_average_on_the_gpu_gives_the_cpu_average():
    n, chunk, k, world = 70000, 4096, 48, 3
    gen = torch.Generator().manual_seed(7)
    contributions = [torch.randn(n, generator=gen) * torch.exp(torch.randn(n, generator=gen)) for _ in range(world)]
    want = sparse.owner_average(contributions, chunk, k, k_average=96)
    got = sparse.owner_average([c.cuda() for c in contributions], chunk, k, k_average=96)
    assert got.average.is_cuda and torch.equal(got.average.cpu(), want.average) and got.sent == want.sent
    # the residuals are each device's own: on an H200 they were not the CPU's bits while the average was (most
    # likely the last bit of the division by the world size, which the 2-bit coding does not show; a residual
    # stays on its owner). They must still keep every contribution
    put = sum(c.double() for c in contributions)
    kept = world * got.average.double().cpu() + sum(r.double().cpu() for r in got.residuals)
    assert torch.allclose(kept, put, rtol=0, atol=1e-5 * float(put.abs().max())), float((kept - put).abs().max())


def test_owner_average_refuses_contributions_on_two_devices():
    x = torch.randn(512)
    with pytest.raises(ValueError, match="same device"):
        sparse.owner_average([x, x.to("meta")], 256, 8)


def test_identical_contributions_that_the_format_holds_come_back_exact():
    # one kept magnitude per half, bf16-exact, on the same positions on every rank: the sum of 4 is held exactly
    chunk, k, world = 64, 4, 4
    x = torch.zeros(4 * chunk)
    for s in range(0, x.numel(), chunk):
        x[s + 3], x[s + 10], x[s + 20], x[s + 41] = 1.5, -1.5, 0.25, -0.25
    got = sparse.owner_average([x.clone() for _ in range(world)], chunk, k)
    assert torch.equal(got.average, x) and all(not bool(r.any()) for r in got.residuals)


def test_bytes_per_rank_stay_a_thirtieth_of_int8_at_every_world_size():
    n = 64 * 4096
    for world in (2, 4, 8, 16):
        parts = sparse.shards(n, world)
        per_rank = max(sum(sparse.payload_bytes(hi - lo) for q, (lo, hi) in enumerate(parts) if q != r)
                       + (world - 1) * sparse.payload_bytes(parts[r][1] - parts[r][0]) for r in range(world))
        int8 = 2 * (world - 1) / world * ops.wire_bytes(n, codec="int8")
        assert per_rank * 30 <= int8, (world, per_rank, int8)


def test_the_dense_codec_takes_what_the_sparse_one_would_not_shrink():
    assert not sparse.sparse_pays(4095)  # less than a chunk
    assert sparse.sparse_pays(4096) and sparse.sparse_pays(10 ** 6)
    # bytes never decide it: at every chunk size and density a record is under int8's bytes (everything kept:
    # 4 bits a value and 4 bytes)
    for chunk in (16, 32, 64, 256, 1024, 4096):
        for k in range(1, chunk + 1):
            n = chunk * 3 + chunk // 2
            assert sparse.payload_bytes(n, chunk, k) < ops.wire_bytes(n, codec="int8"), (chunk, k)
        assert sparse.payload_bytes(chunk, chunk, chunk) == 4 + chunk // 2


# -- the codec in the outer step: settings and what is refused ----------------------------------------------


def test_the_topk_settings_and_what_they_refuse():
    from prime.config import load_config
    from prime.diloco import DiLoCo

    cfg = load_config(None, [("diloco.codec", "topk"), ("diloco.density", "0.0625")], env={}).validate()
    assert cfg.diloco.resolved_block_size() == 4096 and cfg.diloco.density == 0.0625
    with pytest.raises(ValueError, match=r"diloco\.density must be in \(0, 1\]"):
        load_config(None, [("diloco.codec", "topk"), ("diloco.density", "0")], env={}).validate()
    with pytest.raises(ValueError, match=r"diloco\.density must be unset unless diloco\.codec = 'topk'"):
        load_config(None, [("diloco.density", "0.1")], env={}).validate()
    with pytest.raises(ValueError, match=r"diloco\.error_feedback = false is refused with codec 'topk'"):
        load_config(None, [("diloco.codec", "topk"), ("diloco.error_feedback", "false")], env={}).validate()
    load_config(None, [("diloco.codec", "topk"), ("diloco.density", "1")], env={}).validate()  # under int8's bytes
    # elastic nodes carry it (each owner's dropped part is its own: no hand-over when members change)
    load_config(None, [("diloco.codec", "topk"), ("elastic.enabled", "true")], env={}).validate()
    model = torch.nn.Linear(64, 64)
    d = DiLoCo(model, None, None, codec="topk", density=0.01)  # one node: no outer steps, but the settings
    assert d.keep == 41 and d.settings()["keep"] == 41 and d.error_feedback
    with pytest.raises(ValueError, match="density is a setting of codec 'topk'"):
        DiLoCo(model, None, None, codec="int8", density=0.01)
    # the bytes the metrics count per value: the format's at the chosen density
    from prime.codecs import CODECS

    assert CODECS["topk"].bytes_per_value(4096, 64 / 4096) == sparse.bytes_per_value(4096, 64)
