"""The TCP ring between nodes: Ring, Work, CommError (see csrc/ring/)."""
