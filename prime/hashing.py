"""A hash of tensors that nodes compare (the replica check's weights hash, metrics.outer_hash), on many threads.

blake2b hashes 0.6 GB/s on one core of an H200 host (benchmarks/RESULTS.md), so one stream over a 10B
model's outer weights (20 GB a process, with two processes per node) took about 34 s at every start. Here every
PIECE_BYTES piece of each tensor is hashed on its own (a leaf) on a pool of threads (hashlib lets go of the
GIL for large buffers), and the root hashes, for each tensor in order, its length and its leaves' digests:

    leaf = blake2b(piece, digest_size=32, person="prime-leaf")
    root = blake2b(le64(nbytes_0) leaf_0_0 leaf_0_1 ... le64(nbytes_1) leaf_1_0 ..., digest_size, person="prime-root")

The value depends only on the tensors' bytes and their split into tensors, never on the threads or the
device. A GPU tensor's pieces go to the host through a ring of page-locked buffers, one more than the
threads: the copy engine fills the next buffers (asynchronously, on the tensor's stream) while the threads
hash the earlier ones, and a buffer is filled again only once its leaf is hashed. The buffers are
registered with CUDA for the call and given back at its end.
"""

from __future__ import annotations

import collections
import hashlib
import os
from concurrent.futures import Future, ThreadPoolExecutor
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
    order: collections.deque = collections.deque()  # what the root takes next: lengths (bytes) and leaves (futures)
    leaves = 0  # futures in `order`
    staging = _Staging(threads + 1)

    def take_oldest() -> None:
        nonlocal leaves
        item = order.popleft()
        if isinstance(item, Future):
            item = item.result()
            leaves -= 1
        root.update(item)

    try:
        with ThreadPoolExecutor(threads) as pool:
            for t in tensors:
                flat = t.detach().contiguous().view(-1).view(torch.uint8)
                n = flat.numel()
                order.append(n.to_bytes(8, "little"))
                for at in range(0, n, PIECE_BYTES):
                    while leaves >= (staging.count if flat.is_cuda else 2 * threads):
                        take_oldest()  # bounds the host memory; on the GPU, frees the buffer filled next
                    piece = flat[at : at + PIECE_BYTES]
                    if piece.is_cuda:
                        host, copied = staging.fill(piece)
                        order.append(pool.submit(_leaf_when, host, copied))
                    else:
                        order.append(pool.submit(_leaf, piece))
                    leaves += 1
            while order:
                take_oldest()
    finally:
        staging.close()
    return root.digest()


def _leaf(piece: torch.Tensor) -> bytes:
    return hashlib.blake2b(piece.numpy().data, digest_size=32, person=b"prime-leaf").digest()


def _leaf_when(host: torch.Tensor, copied) -> bytes:
    copied.synchronize()  # the copy into this page-locked buffer has landed
    return _leaf(host)


class _Staging:
    """`count` page-locked host buffers of PIECE_BYTES, used in turn (made at the first GPU piece). The caller
    fills buffer i again only once the leaf that read it is done (tensors_hash keeps at most `count` leaves
    in flight)."""

    def __init__(self, count: int):
        self.count = count
        self._buffers: list = []  # (tensor, registered with CUDA)
        self._devices: set = set()
        self._next = 0

    def fill(self, piece: torch.Tensor):
        """Copies `piece` (on the GPU) into the next buffer, asynchronously on the current stream: (the host
        view of the piece, a CUDA event recorded after the copy)."""
        if not self._buffers:
            cudart = torch.cuda.cudart()
            for _ in range(self.count):
                buf = torch.empty(PIECE_BYTES, dtype=torch.uint8)
                # (a buffer CUDA would not lock still works: its copies are then synchronous)
                registered = int(cudart.cudaHostRegister(buf.data_ptr(), PIECE_BYTES, 0)) == 0
                self._buffers.append((buf, registered))
        buf = self._buffers[self._next][0]
        self._next = (self._next + 1) % self.count
        host = buf[: piece.numel()]
        self._devices.add(piece.device)
        with torch.cuda.device(piece.device):
            host.copy_(piece, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
        return host, copied

    def close(self) -> None:
        for device in self._devices:  # no copy into a buffer outlives it (an error may leave some in flight)
            torch.cuda.synchronize(device)
        for buf, registered in self._buffers:
            if registered:
                torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())
        self._buffers, self._devices = [], set()
