"""A stand-in for prime.comm.Ring with the same constructor and all_reduce, for testing the
benchmark harness's ring path before (and independently of) the real ring.

It is not a ring: it quantizes each rank's input once with the torch reference codec and sums
with gloo, and reports the bytes a real ring would send. Selected in the benchmark with
PRIME_BENCH_RING=fake_ring:FakeRing (and tests/ on PYTHONPATH)."""

import time

import torch.distributed as dist

from prime import ops
from prime.comm import WorkStats

# Every fake all_reduce takes at least this long, so the harness test can check the
# times it records against a known floor.
DELAY_S = 0.02


class _Work:
    def __init__(self, n: int, bytes_sent: int, total_s: float):
        self._stats = WorkStats(seq=0, numel=n, bytes_sent=bytes_sent, bytes_received=bytes_sent, frames_sent=1,
                                frames_received=1, quantize_s=0.0, reduce_s=0.0, wait_s=0.0, commit_s=0.0,
                                queue_s=0.0, total_s=total_s)

    def wait(self, timeout=None) -> bool:
        """Already done: the fake all_reduce is synchronous."""
        return True

    def is_completed(self) -> bool:
        return True

    def stats(self) -> WorkStats:
        return self._stats


class FakeRing:
    """Same signature as prime.comm.Ring (prime.comm.RingProtocol); needs the default (gloo) process group."""

    def __init__(self, store, rank, world_size, timeout=None, streams=1, secret=None, max_rate=None,
                 bind_addr=None, advertise_addr=None, checksum=True):
        assert dist.is_initialized() and dist.get_world_size() == world_size and dist.get_rank() == rank
        store.set(f"fake/{rank}", str(streams))  # touch the (prefixed) store like a rendezvous would
        self.rank, self.world_size = rank, world_size

    def all_reduce(self, tensor, op="sum", codec="none", block_size=256):
        """Quantize-once (codec int8) then a gloo sum; returns a finished work with bytes_sent."""
        t0 = time.perf_counter()
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
        time.sleep(DELAY_S)
        return _Work(n, int(2 * (self.world_size - 1) * payload / self.world_size), time.perf_counter() - t0)

    def close(self) -> None:
        """Nothing to release."""
