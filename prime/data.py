"""Training data: token sources, disjoint shards per process, resumable order.

Three sources:

  embedded  the Python standard library's own top-level .py files
            (os.path.dirname(os.__file__), sorted by name), read as bytes:
            nothing to download, vocabulary 256. Files are joined with a NUL
            byte, which never occurs in source code, as document separator.
  text      every regular file under a directory (recursively, sorted by path,
            hidden files skipped), read as bytes the same way.
  bin       pre-tokenized *.bin shards (a bare array of uint16 or uint32 token
            ids), memory-mapped, never loaded whole. prime-tokenize writes
            them with a meta.json (read_metadata) that names the shards, the
            dtype and the tokenizer's vocabulary; without one (nanoGPT's
            shards) every *.bin is read as data.bin_dtype (uint16 for auto).

A source is cut into windows of seq_len + 1 tokens (inputs and shifted targets)
that never straddle two .bin files. Window w belongs to shard w mod S, where
S = nodes x processes per node and shard = node_rank * procs + local_rank, so
every process reads data no other process reads. Each epoch visits a shard's
windows in a fresh permutation drawn from (seed, shard, epoch); the position
(epoch, cursor) is all a checkpoint needs for an exact resume.
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

__all__ = ["TokenSource", "ShardedLoader", "load_source", "embedded_corpus_dir", "DOC_SEPARATOR", "META_FILE",
           "META_FORMAT", "read_metadata", "token_dtype_for", "check_vocab_size"]

DOC_SEPARATOR = 0  # byte value joining documents of byte-level sources
META_FILE = "meta.json"
"""What prime-tokenize writes beside its shards, last (its presence means the tokenization is whole)."""
META_FORMAT = "prime-tokens-1"


def token_dtype_for(vocab_size: int) -> str:
    """The narrowest shard dtype that holds every id of a vocabulary: uint16 up to 65536 tokens, else uint32."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def read_metadata(path: str) -> Optional[dict]:
    """The meta.json of a prime-tokenize output directory, checked; None when there is none (plain shards).

    Raises ValueError when the directory holds an unfinished tokenization or a meta.json that is not one."""
    meta_path = os.path.join(path, META_FILE)
    if not os.path.exists(meta_path):
        if os.path.exists(os.path.join(path, "plan.json")):
            raise ValueError(f"data.path {path!r} holds an unfinished prime-tokenize run (plan.json, no {META_FILE}): "
                             "run the same prime-tokenize command again to finish it")
        return None
    try:
        with open(meta_path) as f:
            meta = json.load(f)
        ok = meta.get("format") == META_FORMAT and isinstance(meta.get("vocab_size"), int) and \
            meta.get("dtype") in ("uint16", "uint32") and isinstance(meta.get("shards"), list)
    except (OSError, ValueError, AttributeError):
        ok = False
    if not ok:
        raise ValueError(f"{meta_path} is not a prime-tokenize metadata file (format {META_FORMAT}); "
                         "tokenize again with prime-tokenize, or remove it to read the *.bin files as they are")
    return meta


def check_vocab_size(meta: dict, path: str, vocab_size: int) -> None:
    """Raises ValueError naming both numbers when a model of vocab_size rows cannot embed the tokens of `meta`."""
    if vocab_size < meta["vocab_size"]:
        raise ValueError(
            f"model.vocab_size is {vocab_size}, but the data under {path} was tokenized with a vocabulary of "
            f"{meta['vocab_size']} tokens ({os.path.join(path, META_FILE)}): set model.vocab_size to "
            f"{meta['vocab_size']} (or more), or leave it unset to take it from the data"
        )


def embedded_corpus_dir() -> str:
    """The directory of the Python standard library, whose .py files are the embedded corpus."""
    return os.path.dirname(os.__file__)


@dataclass
class TokenSource:
    """Token arrays (one per .bin file, or one for a byte corpus) and where they came from."""

    arrays: list
    """numpy arrays (uint8, uint16 or uint32), possibly memory-mapped."""
    description: str
    """One line for the log: what was read and how many tokens it holds."""
    vocab_size: Optional[int] = None
    """The vocabulary of the tokenizer that made the tokens, when known (prime-tokenize's meta.json)."""

    @property
    def num_tokens(self) -> int:
        return int(sum(a.shape[0] for a in self.arrays))

    def max_token_bound(self) -> Optional[int]:
        """An upper bound on token ids known without scanning (256 for bytes), else None."""
        if all(a.dtype == np.uint8 for a in self.arrays):
            return 256
        return self.vocab_size


def _read_bytes(files: list[str], what: str) -> TokenSource:
    parts = []
    for path in files:
        with open(path, "rb") as f:
            parts.append(np.frombuffer(f.read(), dtype=np.uint8))
        parts.append(np.array([DOC_SEPARATOR], dtype=np.uint8))
    data = np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint8)
    return TokenSource([data], f"{what}: {len(files)} files, {data.shape[0] / 1e6:.2f}M byte tokens")


def _load_bin(path: str, bin_dtype: str) -> TokenSource:
    meta = read_metadata(path)
    if meta is not None:
        if bin_dtype not in ("auto", meta["dtype"]):
            raise ValueError(f"data.bin_dtype is {bin_dtype!r}, but {os.path.join(path, META_FILE)} says the shards "
                             f"are {meta['dtype']!r}: leave data.bin_dtype at 'auto'")
        dtype = np.dtype(meta["dtype"])
        files, sizes = [], {}
        for shard in meta["shards"]:
            f = os.path.join(path, shard["file"])
            files.append(f)
            sizes[f] = shard["tokens"] * dtype.itemsize
            if not os.path.exists(f):
                raise ValueError(f"{f} is missing: {META_FILE} lists it; tokenize again with prime-tokenize")
    else:
        dtype = np.dtype("uint16" if bin_dtype == "auto" else bin_dtype)
        files, sizes = sorted(glob.glob(os.path.join(path, "*.bin"))), {}
        if not files:
            raise ValueError(f"data.path {path!r} holds no *.bin files (data.source = 'bin')")
    arrays = []
    for f in files:
        size = os.path.getsize(f)
        if f in sizes and size != sizes[f]:
            raise ValueError(f"{f} has {size} bytes, {META_FILE} says {sizes[f]}: the shard is damaged or from "
                             "another run; tokenize again with prime-tokenize")
        if size % dtype.itemsize:
            raise ValueError(
                f"{f} has {size} bytes, not a multiple of {dtype.itemsize}: is data.bin_dtype ({dtype.name}) right?"
            )
        if size:
            arrays.append(np.memmap(f, dtype=dtype, mode="r"))
    src = TokenSource(arrays, "")
    what = f"vocabulary {meta['vocab_size']}, " if meta is not None else ""
    src.description = f"{len(files)} .bin shards under {path} ({what}{dtype.name}), {src.num_tokens / 1e6:.2f}M tokens"
    if meta is not None:
        src.vocab_size = meta["vocab_size"]
    return src


def load_source(source: str, path: str = "", bin_dtype: str = "auto") -> TokenSource:
    """Opens the token source named by DataConfig (source, path, bin_dtype). Raises ValueError when it is missing or empty."""
    if source == "embedded":
        root = embedded_corpus_dir()
        files = sorted(glob.glob(os.path.join(root, "*.py")))
        if not files:
            raise ValueError(f"the embedded corpus is empty: no .py files in {root}; use data.source = 'text' or 'bin'")
        return _read_bytes(files, f"embedded corpus ({root}/*.py)")
    if not path or not os.path.isdir(path):
        raise ValueError(f"data.path {path!r} does not exist or is not a directory (data.source = {source!r})")
    if source == "text":
        files = []
        for dirpath, dirnames, filenames in os.walk(path):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            files += [os.path.join(dirpath, n) for n in sorted(filenames) if not n.startswith(".")]
        files = sorted(f for f in files if os.path.isfile(f))
        if not files:
            raise ValueError(f"data.path {path!r} holds no files (data.source = 'text')")
        return _read_bytes(files, f"text files under {path}")
    if source == "bin":
        return _load_bin(path, bin_dtype)
    raise ValueError(f"data.source must be 'embedded', 'text' or 'bin', got {source!r}")


class ShardedLoader:
    """Batches of (inputs, targets), each int64 [batch_size, seq_len], from one shard of a TokenSource.

    Deterministic given (seed, shard, num_shards, seq_len, batch_size); state_dict()
    and load_state_dict() save and restore the position exactly.
    """

    def __init__(
        self,
        source: TokenSource,
        seq_len: int,
        batch_size: int,
        shard: int,
        num_shards: int,
        seed: int = 0,
        vocab_size: Optional[int] = None,
    ):
        if not 0 <= shard < num_shards:
            raise ValueError(f"shard {shard} is not in [0, {num_shards})")
        self.source, self.seq_len, self.batch_size = source, seq_len, batch_size
        self.shard, self.num_shards, self.seed, self.vocab_size = shard, num_shards, seed, vocab_size
        # Window table: (array index, start offset) of every window of seq_len + 1 tokens.
        starts = []
        for i, arr in enumerate(source.arrays):
            n = (arr.shape[0] - 1) // seq_len  # windows overlap by one token: targets are inputs shifted by one
            if n > 0:
                starts.append(np.stack([np.full(n, i, dtype=np.int64), np.arange(n, dtype=np.int64) * seq_len], 1))
        table = np.concatenate(starts) if starts else np.zeros((0, 2), dtype=np.int64)
        self.windows = table[shard::num_shards]
        if self.windows.shape[0] < batch_size:
            raise ValueError(
                f"not enough data: {source.description} gives {table.shape[0]} windows of {seq_len + 1} tokens, "
                f"{self.windows.shape[0]} for shard {shard} of {num_shards}, fewer than one batch of {batch_size}; "
                "use more data, a shorter data.seq_len or a smaller train.micro_batch_size"
            )
        bound = source.max_token_bound()
        if vocab_size is not None and bound is not None and bound > vocab_size:
            what = "byte-level data" if bound == 256 and source.vocab_size is None else "the data's tokenizer"
            raise ValueError(f"{what} needs model.vocab_size >= {bound}, got {vocab_size}")
        self._check_ids = vocab_size is not None and bound is None
        self.epoch, self.cursor = 0, 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, self.shard, self.num_shards, epoch])
        return rng.permutation(self.windows.shape[0])

    @property
    def windows_per_epoch(self) -> int:
        return int(self.windows.shape[0])

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next (inputs, targets); wraps into a new epoch (new permutation) when the shard is used up."""
        rows = np.empty((self.batch_size, self.seq_len + 1), dtype=np.int64)
        for b in range(self.batch_size):
            if self.cursor >= len(self._order):
                self.epoch, self.cursor = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            arr_i, start = self.windows[self._order[self.cursor]]
            rows[b] = self.source.arrays[arr_i][start : start + self.seq_len + 1]
            self.cursor += 1
        if self._check_ids:
            top = int(rows.max())
            if top >= self.vocab_size:
                raise ValueError(
                    f"token id {top} in the data is >= model.vocab_size ({self.vocab_size}); "
                    "was the data tokenized with another vocabulary, or is data.bin_dtype wrong?"
                )
        t = torch.from_numpy(rows)
        return t[:, :-1], t[:, 1:]

    def state_dict(self) -> dict:
        """The position: restoring it makes next_batch() continue exactly where it was."""
        return {"epoch": self.epoch, "cursor": self.cursor, "shard": self.shard, "num_shards": self.num_shards}

    def load_state_dict(self, state: dict) -> None:
        if (state["shard"], state["num_shards"]) != (self.shard, self.num_shards):
            raise ValueError(
                f"the checkpoint's data position is for shard {state['shard']} of {state['num_shards']}, "
                f"this process reads shard {self.shard} of {self.num_shards}: resume with the same number of nodes "
                "and processes per node"
            )
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])
        self._order = self._permutation(self.epoch)
