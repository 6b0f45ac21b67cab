"""prime.hashing: the tree hash the nodes compare, against its definition recomputed with hashlib alone."""

import hashlib
import random

import pytest
import torch

import prime.hashing as hashing
from prime.hashing import tensors_hash


def _reference(tensors, digest_size: int, piece: int) -> bytes:
    """The module docstring's formula, one leaf after the other."""
    root = hashlib.blake2b(digest_size=digest_size, person=b"prime-root")
    for t in tensors:
        data = t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        root.update(len(data).to_bytes(8, "little"))
        for at in range(0, len(data), piece):
            root.update(hashlib.blake2b(data[at : at + piece], digest_size=32, person=b"prime-leaf").digest())
    return root.digest()


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_the_tree_hash_is_its_definition_whatever_the_threads(monkeypatch, device):
    piece = 4096
    monkeypatch.setattr(hashing, "PIECE_BYTES", piece)
    rng = random.Random()
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    sizes = [rng.randrange(1, 20 * piece // 4) for _ in range(3)] + [piece // 4, 1]  # pieces and a partial one
    tensors = [torch.randn(n, generator=gen).to(device) for n in sizes]
    tensors.append(torch.randn(37, 129, generator=gen).to(torch.bfloat16).t().to(device))  # not contiguous
    want = _reference(tensors, 8, piece)
    for threads in (1, 3, 8):  # (on the GPU: 2, 4 and 9 staging buffers, each filled again many times)
        assert tensors_hash(tensors, 8, threads=threads) == want
    mixed = [t.cpu() if i % 2 else t for i, t in enumerate(tensors)]  # host and GPU tensors in one call
    assert tensors_hash(mixed, 8, threads=2) == want
    assert tensors_hash(tensors, 16) == _reference(tensors, 16, piece)
    changed = [t.clone() for t in tensors]
    i = rng.randrange(changed[0].numel())
    changed[0].view(-1)[i] = torch.nextafter(changed[0].view(-1)[i], torch.tensor(float("inf"), device=device))
    assert tensors_hash(changed, 8) != want, "one ulp of one value must change the hash"
    joined = [torch.cat([tensors[0], tensors[1]])] + tensors[2:]
    assert tensors_hash(joined, 8) != want, "the split into tensors is part of the value"


def test_the_default_threads_are_this_processs_share_of_its_cpus(monkeypatch):
    """torchrun's LOCAL_WORLD_SIZE processes hash at once: each takes its share, at least 1, at most 16."""
    import os

    cpus = len(os.sched_getaffinity(0))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert hashing.default_threads() == max(1, min(hashing.MAX_THREADS, cpus))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(cpus + 1))
    assert hashing.default_threads() == 1
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert hashing.default_threads() == 16
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert hashing.default_threads() == 8
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "junk")
    assert hashing.default_threads() == 16
