"""The TCP ring between nodes: Ring, Work, CommError (C++ core in csrc/ring/).

    ring = prime.comm.Ring(store, rank, world_size)
    ring.all_reduce(tensor, op="avg", codec="int8").wait()
"""

from prime.comm.errors import CommError, NonFiniteError
from prime.comm.rendezvous import host_store
from prime.comm.ring import DEFAULT_SEGMENT_BYTES, DEFAULT_STREAMS, Ring, RingProtocol, Work, WorkProtocol, WorkStats

__all__ = [
    "Ring",
    "Work",
    "WorkStats",
    "RingProtocol",
    "WorkProtocol",
    "CommError",
    "NonFiniteError",
    "DEFAULT_SEGMENT_BYTES",
    "DEFAULT_STREAMS",
    "host_store",
]
