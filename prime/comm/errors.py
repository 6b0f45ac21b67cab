"""Errors of the TCP ring. Every failure of a collective or of the rendezvous
raises CommError (or its subclass NonFiniteError) with the rank, the peer and
the place where it happened."""

from __future__ import annotations

from typing import List, Optional

from prime.ops import NonFiniteError as _CodecNonFiniteError

__all__ = ["CommError", "NonFiniteError", "error_from_info"]


class CommError(RuntimeError):
    """A collective or the ring's rendezvous failed.

    Attributes (-1 / "" when unknown):
      kind     "timeout", "connection_lost", "corrupt_frame", "protocol",
               "peer_failed", "non_finite", "handshake", "closed", "internal"
      rank     the rank raising
      peer     the neighbour involved
      origin   the rank where the failure started (another rank for "peer_failed")
      seq      the all_reduce sequence number (-1 outside a collective)
      phase    "reduce-scatter", "all-gather", "rendezvous" or "none"
      step, segment   position inside the collective
      cause    what happened, without the context
    """

    def __init__(
        self,
        message: str,
        *,
        kind: str = "internal",
        rank: int = -1,
        peer: int = -1,
        origin: int = -1,
        seq: int = -1,
        phase: str = "none",
        step: int = -1,
        segment: int = -1,
        cause: str = "",
        origin_message: str = "",
    ):
        super().__init__(message)
        self.kind = kind
        self.rank = rank
        self.peer = peer
        self.origin = origin
        self.seq = seq
        self.phase = phase
        self.step = step
        self.segment = segment
        self.cause = cause or message
        self.origin_message = origin_message


class NonFiniteError(CommError, _CodecNonFiniteError):
    """Some rank's input held NaN or Inf (or the sum overflowed): every rank raises
    it for the same collective, and no rank's tensor was modified.

    nonfinite_ranks: the ranks whose input held NaN/Inf (empty if only the sum overflowed)
    overflow: True when every input was finite but the result was not
    """

    def __init__(self, message: str, *, nonfinite_ranks: Optional[List[int]] = None, overflow: bool = False, **kw):
        super().__init__(message, kind="non_finite", **kw)
        self.nonfinite_ranks = list(nonfinite_ranks or [])
        self.overflow = overflow


def error_from_info(info: dict) -> CommError:
    """Builds the Python exception from the dict the C++ ring reports (prime._C)."""
    common = {
        "rank": info["rank"],
        "peer": info["peer"],
        "origin": info["origin"],
        "seq": info["seq"],
        "phase": info["phase"],
        "step": info["step"],
        "segment": info["segment"],
        "cause": info["cause"],
        "origin_message": info["origin_message"],
    }
    if info["kind"] == "non_finite":
        return NonFiniteError(
            info["message"], nonfinite_ranks=info["nonfinite_ranks"], overflow=info["overflow"], **common
        )
    return CommError(info["message"], kind=info["kind"], **common)
