"""The sparse top-k format (prime/sparse.py) against bytes worked out by hand and a float64 reference."""

import pytest
import torch

from prime import ops, sparse


def test_two_chunks_give_the_bytes_worked_out_by_hand():
    # chunk 16 (4-bit positions), k 4. Chunk 0 keeps 3.0, 2.0, 1.0, 0.75: hi = mean(3, 2) = 2.5 (bf16 0x4020),
    # lo = mean(1, 0.75) = 0.875 (0x3F60), threshold 1.6875; positions 1, 3, 6, 11; codes (bit 0 hi, bit 1
    # negative) 3, 0, 1, 2. The last chunk (5 values) keeps ceil(5 * 4 / 16) = 2: 4.0 and -1.0, positions 1, 2.
    x = torch.tensor([0.5, -3.0, 0.25, 1.0, 0, 0, 2.0, 0, 0, 0, 0, -0.75, 0, 0, 0, 0.125,
                      0.0, 4.0, -1.0, 0.5, 0.0])
    want = [0x60, 0x3F, 0x20, 0x40, 1 | 3 << 4, 6 | 11 << 4, 3 | 0 << 2 | 1 << 4 | 2 << 6,
            0x80, 0x3F, 0x80, 0x40, 1 | 2 << 4, 1 | 2 << 2]
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
    for s in range(0, len(vals), chunk):
        part = vals[s : s + chunk]
        keep = -(-len(part) * k // chunk)
        order = sorted(range(len(part)), key=lambda i: (-abs(part[i]), i))[:keep]
        mags = [abs(part[i]) for i in order]
        upper = (keep + 1) // 2

        def bf16(v):
            return torch.tensor(v, dtype=torch.float64).to(torch.bfloat16).item()

        hi = bf16(sum(mags[:upper]) / upper)
        lo = bf16(sum(mags[upper:]) / (keep - upper)) if keep > upper else hi
        for i in order:
            m = hi if abs(part[i]) >= (lo + hi) / 2 else lo
            out[s + i] = -m if part[i] < 0 else m
    return torch.tensor(out, dtype=torch.float32)


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


def test_ties_go_to_the_lower_index_and_an_empty_tensor_is_empty():
    x = torch.ones(32)
    got = sparse.decode(sparse.encode(x, chunk=16, k=2), 32, chunk=16, k=2)
    assert got.nonzero().flatten().tolist() == [0, 1, 16, 17]
    assert sparse.encode(torch.zeros(0), chunk=16, k=2).numel() == 0 == sparse.payload_bytes(0, 16, 2)


def test_at_the_default_density_it_is_thirty_times_smaller_than_int8():
    int8 = ops.wire_bytes(1 << 20, ops.DEFAULT_BLOCK_SIZE, "int8") / (1 << 20)
    per_value = sparse.bytes_per_value(sparse.CHUNK, 64)
    assert per_value == (4 + 64 * 12 // 8 + 64 // 4) / 4096
    assert int8 / per_value > 30
    assert sparse.payload_bytes(1 << 20) == (1 << 20) // 4096 * (4 + 96 + 16)
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
