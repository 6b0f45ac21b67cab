"""A hash of tensors that nodes compare (the replica check's weights hash, metrics.outer_hash), on many threads.

blake2b hashes 0.6 GB/s on one core of an H200 host (benchmarks/RESULTS.md), so one stream over a 10B
model's outer weights (20 GB a process, with two processes per node) took about 34 s at every start. Here every
PIECE_BYTES piece of each tensor is hashed on its own (a leaf) on a pool of threads (hashlib lets go of the
GIL for large buffers), and the root hashes, for each tensor in order, its length and its leaves' digests:

    leaf = blake2b(piece, digest_size=32, person="prime-leaf")
    root = blake2b(le64(nbytes_0) leaf_0_0 leaf_0_1 ... le64(nbytes_1) leaf_1_0 ..., digest_size, person="prime-root")

The value depends only on the tensors' bytes and their split into tensors, never on the threads. A GPU
tensor goes to the host a piece at a time (at most two pieces a thread in flight).
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable, Optional

import torch

__all__ = ["tensors_hash", "default_threads", "PIECE_BYTES"]

PIECE_BYTES = 32 << 20
"""Bytes of one leaf (a 10B model's 20 GB share: about 600 leaves)."""

MAX_THREADS = 16


def default_threads() -> int:
    """This process's share of the CPUs it may run on (the node's processes hash at the same time: torchrun's
    LOCAL_WORLD_SIZE of them), at most MAX_THREADS. Not torch's intra-op threads: torchrun sets those to 1."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        local = 1
    return max(1, min(MAX_THREADS, cpus // local))


def tensors_hash(tensors: Iterable[torch.Tensor], digest_size: int = 8, threads: Optional[int] = None) -> bytes:
    """The tree hash of the module docstring over `tensors` (any dtype and device; their bytes as laid out in
    memory once contiguous). threads: hashing threads (default: default_threads())."""
    threads = threads or default_threads()
    root = hashlib.blake2b(digest_size=digest_size, person=b"prime-root")
    with ThreadPoolExecutor(threads) as pool:
        for t in tensors:
            flat = t.detach().contiguous().view(-1).view(torch.uint8)
            n = flat.numel()
            root.update(n.to_bytes(8, "little"))
            pending: list = []
            for at in range(0, n, PIECE_BYTES):
                piece = flat[at : at + PIECE_BYTES].cpu()  # (a view of a host tensor: no copy)
                pending.append(pool.submit(_leaf, piece))
                if len(pending) >= 2 * threads:  # bounds the host memory of a GPU tensor's pieces
                    root.update(pending.pop(0).result())
            for f in pending:
                root.update(f.result())
    return root.digest()


def _leaf(piece: torch.Tensor) -> bytes:
    return hashlib.blake2b(piece.numpy().data, digest_size=32, person=b"prime-leaf").digest()
