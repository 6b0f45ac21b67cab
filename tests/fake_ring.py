"""A stand-in for prime.comm.Ring with the same constructor and all_reduce, for testing the
benchmark harness's ring path before (and independently of) the real ring.

It is not a ring: it quantizes each rank's input once with the torch reference codec and sums
with gloo, and reports the bytes a real ring would send. Selected in the benchmark with
PRIME_BENCH_RING=fake_ring:FakeRing (and tests/ on PYTHONPATH)."""

import torch
import torch.distributed as dist

from prime import ops


class _Work:
    def __init__(self, bytes_sent: int):
        self.bytes_sent = bytes_sent

    def wait(self) -> None:
        """Already done: the fake all_reduce is synchronous."""


class FakeRing:
    """Same signature as prime.comm.Ring; needs the default (gloo) process group."""

    def __init__(self, store, rank, world_size, timeout=None, streams=1, secret=None, max_rate=None,
                 bind_addr=None, advertise_addr=None, checksum=True):
        assert dist.is_initialized() and dist.get_world_size() == world_size and dist.get_rank() == rank
        store.set(f"fake/{rank}", str(streams))  # touch the (prefixed) store like a rendezvous would
        self.world_size = world_size

    def all_reduce(self, tensor, op="sum", codec="none", block_size=256):
        """Quantize-once (codec int8) then a gloo sum; returns a finished work with bytes_sent."""
        n = tensor.numel()
        if codec == "int8":
            q, s = ops.quantize_int8_reference(tensor, block_size)
            tensor.copy_(ops.dequantize_int8_reference(q, s, block_size).view_as(tensor))
            payload = ops.wire_bytes(n, block_size)
        else:
            payload = n * tensor.element_size()
        dist.all_reduce(tensor)
        if op == "avg":
            tensor /= self.world_size
        return _Work(int(2 * (self.world_size - 1) * payload / self.world_size))

    def close(self) -> None:
        """Nothing to release."""
