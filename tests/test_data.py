"""Data: sources, disjoint shards, exact resume of the position, clear errors."""

import random

import numpy as np
import pytest
import torch

from prime.data import DOC_SEPARATOR, ShardedLoader, TokenSource, load_source


def counting_source(n):
    # token i has value i: a window's first token tells where it starts
    return TokenSource([np.arange(n, dtype=np.uint32)], f"{n} counting tokens")


def test_targets_are_inputs_shifted(seed):
    loader = ShardedLoader(counting_source(10_000), seq_len=16, batch_size=4, shard=0, num_shards=1, seed=seed)
    x, y = loader.next_batch()
    assert x.shape == y.shape == (4, 16) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(y - x, torch.ones_like(x))


def test_shards_are_disjoint_and_cover_one_epoch(seed):
    n, seq, shards = 5_000, 10, 3
    src = counting_source(n)
    seen = []
    for s in range(shards):
        loader = ShardedLoader(src, seq, batch_size=1, shard=s, num_shards=shards, seed=seed)
        starts = [int(loader.next_batch()[0][0, 0]) for _ in range(loader.windows_per_epoch)]
        assert len(set(starts)) == len(starts)  # no window twice in an epoch
        seen.append(set(starts))
    assert not (seen[0] & seen[1]) and not (seen[0] & seen[2]) and not (seen[1] & seen[2])
    assert set().union(*seen) == set(range(0, (n - 1) // seq * seq, seq))


def test_new_epoch_new_order(seed):
    loader = ShardedLoader(counting_source(1_000), 10, batch_size=1, shard=0, num_shards=1, seed=seed)
    e0 = [int(loader.next_batch()[0][0, 0]) for _ in range(loader.windows_per_epoch)]
    e1 = [int(loader.next_batch()[0][0, 0]) for _ in range(loader.windows_per_epoch)]
    assert sorted(e0) == sorted(e1) and e0 != e1 and loader.epoch == 1


def test_resume_position_exactly(seed):
    src = counting_source(3_000)
    a = ShardedLoader(src, 8, batch_size=5, shard=1, num_shards=2, seed=seed)
    for _ in range(17):  # past an epoch boundary (3000/8/2 = 187 windows, 85 used)
        a.next_batch()
    state = a.state_dict()
    b = ShardedLoader(src, 8, batch_size=5, shard=1, num_shards=2, seed=seed)
    b.load_state_dict(state)
    for _ in range(50):
        xa, _ = a.next_batch()
        xb, _ = b.next_batch()
        assert torch.equal(xa, xb), f"seed {seed}"
    c = ShardedLoader(src, 8, batch_size=5, shard=0, num_shards=2, seed=seed)
    with pytest.raises(ValueError, match="same number of nodes"):
        c.load_state_dict(state)


def test_embedded_corpus_is_byte_level_python():
    src = load_source("embedded")
    assert src.num_tokens > 1_000_000
    data = src.arrays[0]
    assert data.dtype == np.uint8 and data[-1] == DOC_SEPARATOR
    assert b"def " in data[:200_000].tobytes()


def test_text_directory(tmp_path):
    (tmp_path / "b.txt").write_bytes(b"second file")
    (tmp_path / "a.txt").write_bytes(b"first file")
    (tmp_path / ".hidden").write_bytes(b"never read")
    src = load_source("text", str(tmp_path))
    assert src.arrays[0].tobytes() == b"first file\x00second file\x00"


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_bin_shards_do_not_straddle_files(tmp_path, dtype, seed):
    rng = np.random.default_rng(seed)
    a = rng.integers(0, 1000, 101, dtype=np.int64).astype(dtype)
    b = rng.integers(0, 1000, 51, dtype=np.int64).astype(dtype)
    a.tofile(tmp_path / "00.bin")
    b.tofile(tmp_path / "01.bin")
    src = load_source("bin", str(tmp_path), dtype)
    assert src.num_tokens == 152
    loader = ShardedLoader(src, 10, batch_size=1, shard=0, num_shards=1, seed=seed, vocab_size=1000)
    rows = {tuple(torch.cat([x[0], y[0, -1:]]).tolist()) for x, y in (loader.next_batch() for _ in range(15))}
    expected = {tuple(a[i:i + 11].tolist()) for i in range(0, 91, 10)} | {tuple(b[i:i + 11].tolist()) for i in range(0, 41, 10)}
    assert rows == expected


def test_token_ids_beyond_vocab_are_refused(tmp_path):
    np.array([1, 2, 3, 70000] * 10, dtype=np.uint32).tofile(tmp_path / "x.bin")
    loader = ShardedLoader(load_source("bin", str(tmp_path), "uint32"), 4, 8, 0, 1, vocab_size=50000)
    with pytest.raises(ValueError, match="token id 70000 in the data is >= model.vocab_size"):
        loader.next_batch()


def test_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist or is not a directory"):
        load_source("bin", str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="holds no .bin files|holds no \\*.bin files"):
        load_source("bin", str(tmp_path))
    with pytest.raises(ValueError, match="holds no files"):
        load_source("text", str(tmp_path))
    (tmp_path / "odd.bin").write_bytes(b"abc")
    with pytest.raises(ValueError, match="not a multiple of 2"):
        load_source("bin", str(tmp_path), "uint16")
    with pytest.raises(ValueError, match="not enough data"):
        ShardedLoader(counting_source(100), 50, batch_size=4, shard=0, num_shards=2)
    with pytest.raises(ValueError, match="byte-level data needs model.vocab_size >= 256"):
        ShardedLoader(TokenSource([np.zeros(1000, dtype=np.uint8)], "bytes"), 10, 1, 0, 1, vocab_size=100)
