"""prime-tokenize: text, JSONL or Parquet to the .bin token shards that `data.source = "bin"` reads.

    prime-tokenize corpus/ --out data/tok --vocab-size 8192             # trains a byte-level BPE first
    prime-tokenize a.jsonl b.parquet --out data/tok --tokenizer llama3/tokenizer.json --jsonl-field text
    prime-train --config configs/150M.toml --data.source bin --data.path data/tok

Inputs are files and directories (searched recursively, hidden and binary files
skipped; the output directory is never read), or `--files-from LIST`. By name:

  *.jsonl, *.ndjson   one JSON object per line; the document is its --jsonl-field
  *.parquet           one document per row of the --jsonl-field column (needs pyarrow)
  anything else       a text file (UTF-8) is one document
  (.gz after any of these: read through gzip)

Tokenizer: a `tokenizer.json` of the Hugging Face `tokenizers` library
(--tokenizer; a Llama-3 one works), or a byte-level BPE of --vocab-size tokens
trained on the first --train-sample-mb of the corpus. Either way it is copied to
OUT/tokenizer.json. Every document ends with the end-of-text token
(--eos-token; by default the first of EOS_CANDIDATES the tokenizer has).

The inputs are planned into shards of about --shard-size-mb of input (a large
JSONL or Parquet file is split at line or row-group boundaries); --workers
processes tokenize one shard each, single-threaded, into OUT/shard_NNNNN.bin
(uint16 when the vocabulary fits, else uint32), written under a temporary name
and renamed when whole. OUT/plan.json fixes the plan and OUT/progress.jsonl
lists the shards done, so running the same command again after an interruption
tokenizes only the shards that are missing, with the same result as an
uninterrupted run. OUT/meta.json, written last, describes the whole
(prime.data.read_metadata): tokenizer identity and SHA-256, vocabulary size,
dtype, token and document counts per shard. Training reads it to pick the
dtype and to check model.vocab_size.
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import hashlib
import json
import multiprocessing
import os
import queue
import shutil
import sys
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import numpy as np

from prime import faults
from prime.data import META_FILE, META_FORMAT, token_dtype_for
from prime.progress import Progress, format_count, format_duration

__all__ = ["main", "tokenize", "plan_inputs", "train_bpe", "load_tokenizer", "EOS_CANDIDATES", "TokenizeError"]

EOS_CANDIDATES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "<|im_end|>")
"""End-of-document tokens looked for, in order, when --eos-token is not given (Llama 3, GPT-2, Llama 2, Gemma, ...)."""
TRAINED_EOS = "<|endoftext|>"
"""The special token of a BPE trained here (id 0)."""
PLAN_FILE, PROGRESS_FILE, TOKENIZER_FILE = "plan.json", "progress.jsonl", "tokenizer.json"
BATCH_CHARS = 1 << 20
"""Characters handed to the tokenizer per call: large enough that the call dominates, small enough for memory."""
TEXT_PIECE_CHARS = 1 << 20
"""A long text document is encoded in pieces of about this many characters, cut where it cannot change the tokens."""


class TokenizeError(ValueError):
    """A bad input or setting (the message names it and says what to do)."""


# -- what the inputs are --------------------------------------------------------------------------


def _kind(path: str) -> str:
    name = path.lower()
    if name.endswith(".gz"):
        name = name[:-3]
    if name.endswith((".jsonl", ".ndjson")):
        return "jsonl"
    if name.endswith(".parquet"):
        return "parquet"
    return "text"


def _looks_binary(path: str) -> bool:
    """A NUL byte in the first 8 KiB (as git decides): not text. Gzip and Parquet files are read as such."""
    if path.lower().endswith((".gz", ".parquet")):
        return False
    with open(path, "rb") as f:
        return b"\0" in f.read(8192)


def _parquet():
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise TokenizeError("reading Parquet needs pyarrow, which is not installed: pip install pyarrow") from None
    return pq


def list_inputs(inputs: list[str], out_dir: str) -> tuple[list[str], list[str]]:
    """(files to read in order, files skipped as binary). Directories are walked sorted; OUT is never read."""
    out_real = os.path.realpath(out_dir)
    files, skipped, seen = [], [], set()

    def take(path: str) -> None:
        real = os.path.realpath(path)
        if real in seen or real == out_real or real.startswith(out_real + os.sep):
            return
        seen.add(real)
        (skipped if _looks_binary(path) else files).append(path)

    for item in inputs:
        if os.path.isdir(item):
            for dirpath, dirnames, filenames in os.walk(item):
                dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
                for name in sorted(filenames):
                    path = os.path.join(dirpath, name)
                    if not name.startswith(".") and os.path.isfile(path):
                        take(path)
        elif os.path.isfile(item):
            take(item)
        else:
            raise TokenizeError(f"input {item!r} is not a file or a directory")
    if not files:
        raise TokenizeError(f"no input files found in {' '.join(inputs)}"
                            + (f" ({len(skipped)} binary files skipped)" if skipped else ""))
    return files, skipped


def plan_inputs(files: list[str], shard_bytes: int) -> list[list[list]]:
    """Cuts the files into shards of about shard_bytes of input: each shard is a list of pieces
    [path, kind, start, end] (byte range for text and JSONL, row-group range for Parquet; a text or gzip
    file is one piece). Deterministic: the same files and sizes give the same plan."""
    shards, current, size = [], [], 0

    def close_current():
        nonlocal current, size
        if current:
            shards.append(current)
        current, size = [], 0

    for path in files:
        kind, nbytes = _kind(path), os.path.getsize(path)
        if kind == "parquet":
            meta = _parquet().ParquetFile(path).metadata
            groups = [meta.row_group(i).total_byte_size for i in range(meta.num_row_groups)]
            start, acc = 0, 0
            for i, g in enumerate(groups):
                acc += g
                if size + acc >= shard_bytes:
                    current.append([path, kind, start, i + 1])
                    start, acc = i + 1, 0
                    close_current()
            if start < len(groups):
                current.append([path, kind, start, len(groups)])
                size += acc
        elif kind == "jsonl" and not path.lower().endswith(".gz"):
            start = 0
            while nbytes - start > shard_bytes - size:
                end = start + max(1, shard_bytes - size)
                current.append([path, kind, start, end])
                start = end
                close_current()
            if start < nbytes or nbytes == 0:
                current.append([path, kind, start, nbytes])
                size += nbytes - start
        else:  # a text document is never split across shards (its tokens would depend on the cut)
            current.append([path, kind, 0, nbytes])
            size += nbytes
        if size >= shard_bytes:
            close_current()
    close_current()
    return shards


# -- reading documents ----------------------------------------------------------------------------


def _open(path: str):
    return gzip.open(path, "rb") if path.lower().endswith(".gz") else open(path, "rb")


def _is_safe_cut(text: str, j: int) -> bool:
    """Whether text[j] is a newline between two non-space characters: the byte-level BPE and Llama-3
    pre-tokenizers never join pieces across it, so the two sides encoded apart give the same tokens."""
    return 0 < j < len(text) - 1 and not text[j - 1].isspace() and not text[j + 1].isspace()


def _safe_cut(text: str, lo: int, near: int) -> int:
    """The index just after the last safe newline (_is_safe_cut) in [lo, near), else after the first one from
    near on, else len(text): a piece may grow, never cut where the tokens could change."""
    j = text.rfind("\n", lo, near)
    while j > lo and not _is_safe_cut(text, j):
        j = text.rfind("\n", lo, j)
    if j > lo:
        return j + 1
    j = text.find("\n", near)
    while j != -1 and not _is_safe_cut(text, j):
        j = text.find("\n", j + 1)
    return j + 1 if j != -1 else len(text)


def _text_pieces(text: str) -> Iterator[tuple[str, bool]]:
    """A document as (piece, is_last) of about TEXT_PIECE_CHARS each."""
    start = 0
    while len(text) - start > TEXT_PIECE_CHARS:
        cut = _safe_cut(text, start, start + TEXT_PIECE_CHARS)
        if cut >= len(text):
            break
        yield text[start:cut], False
        start = cut
    yield text[start:], True


def _jsonl_docs(path: str, start: int, end: int, field: str) -> Iterator[tuple[Optional[str], float]]:
    """(document, bytes read) for the lines of path that start in [start, end)."""
    with _open(path) as f:
        if start > 0:  # the line that holds byte start-1 belongs to the piece before
            f.seek(start - 1)
            f.readline()
        pos = f.tell()
        while pos < end or path.lower().endswith(".gz"):
            line = f.readline()
            if not line:
                break
            nbytes = len(line)
            if line.strip():
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise TokenizeError(f"{path}: the line at byte {pos} is not JSON ({e.msg})") from None
                if not isinstance(obj, dict) or field not in obj:
                    keys = sorted(obj)[:8] if isinstance(obj, dict) else type(obj).__name__
                    raise TokenizeError(f"{path}: the line at byte {pos} has no field {field!r} "
                                        f"(it has {keys}); name the text field with --jsonl-field")
                doc = obj[field]
                if doc is not None:
                    if not isinstance(doc, str):
                        raise TokenizeError(f"{path}: field {field!r} at byte {pos} is a "
                                            f"{type(doc).__name__}, not text")
                    yield doc, nbytes
                    nbytes = 0
            if nbytes:
                yield None, nbytes  # an empty line or a null document: progress only
            pos += len(line)


def _parquet_docs(path: str, first: int, last: int, field: str) -> Iterator[tuple[Optional[str], float]]:
    pf = _parquet().ParquetFile(path)
    if field not in pf.schema_arrow.names:
        raise TokenizeError(f"{path}: no column {field!r} (it has {pf.schema_arrow.names}); name the text "
                            "column with --jsonl-field")
    for i in range(first, last):
        nbytes = pf.metadata.row_group(i).total_byte_size
        column = pf.read_row_group(i, columns=[field]).column(0)
        docs = column.to_pylist()
        per_doc = nbytes / max(1, len(docs))
        for doc in docs:
            if doc is not None and not isinstance(doc, str):
                raise TokenizeError(f"{path}: column {field!r} holds {type(doc).__name__}, not text")
            yield doc, per_doc  # (None: a null value, progress only)


def _pieces(shard: list, field: str) -> Iterator[tuple[str, bool, float]]:
    """(text, ends a document, input bytes it stands for) over a shard's pieces."""
    for path, kind, start, end in shard:
        if kind == "text":
            with _open(path) as f:
                raw = f.read()
            text = raw.decode("utf-8", errors="replace")
            for piece, last in _text_pieces(text):
                yield piece, last, len(raw) * len(piece) / max(1, len(text))
        else:
            # A record's text is a document even when empty (it ends with the end-of-text token, as an empty
            # text file does); an empty line or a null value is none.
            docs = _jsonl_docs(path, start, end, field) if kind == "jsonl" else _parquet_docs(path, start, end, field)
            for doc, nbytes in docs:
                yield doc or "", doc is not None, nbytes


# -- the tokenizer --------------------------------------------------------------------------------


def _tokenizers():
    try:
        import tokenizers
    except ImportError:
        raise TokenizeError("prime-tokenize needs the Hugging Face tokenizers library: pip install tokenizers") from None
    return tokenizers


def load_tokenizer(path: str):
    """A tokenizers.Tokenizer from a tokenizer.json (TokenizeError naming the file when it is not one)."""
    tk = _tokenizers()
    try:
        return tk.Tokenizer.from_file(path)
    except Exception as e:  # the library raises a plain Exception on a bad file
        raise TokenizeError(f"{path} is not a tokenizer.json of the tokenizers library: {e}") from None


def train_bpe(texts: Iterator[str], vocab_size: int):
    """A byte-level BPE (GPT-2's pre-tokenizer, every byte in the alphabet, TRAINED_EOS as id 0) of at most
    vocab_size tokens, trained on `texts`."""
    tk = _tokenizers()
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[TRAINED_EOS], show_progress=False,
                                     initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return tok


def _eos_id(tok, eos_token: Optional[str], where: str) -> tuple[str, int]:
    names = [eos_token] if eos_token else list(EOS_CANDIDATES)
    for name in names:
        i = tok.token_to_id(name)
        if i is not None:
            return name, int(i)
    if eos_token:
        raise TokenizeError(f"--eos-token {eos_token!r} is not a token of {where}")
    raise TokenizeError(f"{where} has none of the end-of-text tokens {list(EOS_CANDIDATES)}: "
                        "name the one that ends a document with --eos-token")


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# -- one shard (in a worker process) --------------------------------------------------------------

_worker_tok = None
_worker_counters = None


def _worker_init(tokenizer_path: str, counters) -> None:
    global _worker_tok, _worker_counters
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker: the workers are the parallelism
    _worker_tok = load_tokenizer(tokenizer_path)
    _worker_counters = counters


def _report_shared(nbytes: float, ntokens: int) -> None:
    with _worker_counters.get_lock():
        _worker_counters[0] += int(nbytes)
        _worker_counters[1] += ntokens


def _worker_shard(job: tuple) -> dict:
    return tokenize_shard(_worker_tok, *job, report=_report_shared)


def _encode(tok, texts: list[str]) -> list[list[int]]:
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)  # _fast: no offsets (tokenizers >= 0.20)
    return [e.ids for e in encode(texts, add_special_tokens=False)]


def tokenize_shard(tok, index: int, shard: list, out_dir: str, field: str, eos_id: int, dtype: str,
                   report: Callable[[float, int], None]) -> dict:
    """Tokenizes one shard into out_dir/shard_{index:05d}.bin (via a .tmp file and a rename); returns its record."""
    name = f"shard_{index:05d}.bin"
    tmp = os.path.join(out_dir, name + ".tmp")
    np_dtype = np.dtype(dtype)
    tokens = documents = 0
    batch, ends, chars, batch_bytes = [], [], 0, 0.0

    def flush(f) -> None:
        nonlocal tokens, documents, batch, ends, chars, batch_bytes
        flat: list[int] = []
        for ids, end in zip(_encode(tok, batch), ends):
            flat.extend(ids)
            if end:
                flat.append(eos_id)
                documents += 1
        np.asarray(flat, dtype=np_dtype).tofile(f)
        tokens += len(flat)
        report(batch_bytes, len(flat))
        batch, ends, chars, batch_bytes = [], [], 0, 0.0

    with open(tmp, "wb") as f:
        for text, end, nbytes in _pieces(shard, field):
            batch.append(text)
            ends.append(end)
            chars += len(text)
            batch_bytes += nbytes
            if chars >= BATCH_CHARS:
                flush(f)
        if batch:
            flush(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(out_dir, name))
    return {"shard": index, "file": name, "tokens": tokens, "documents": documents}


# -- the whole run --------------------------------------------------------------------------------


@dataclass
class Settings:
    inputs: list
    out: str
    tokenizer: Optional[str] = None
    vocab_size: Optional[int] = None
    jsonl_field: str = "text"
    workers: int = 1
    shard_size_mb: float = 256.0
    train_sample_mb: float = 512.0
    eos_token: Optional[str] = None
    overwrite: bool = False
    progress: Optional[bool] = None  # None: a bar on a terminal


def _input_signature(files: list[str]) -> list:
    return [[os.path.abspath(p), os.path.getsize(p), os.stat(p).st_mtime_ns] for p in files]


def _read_json(path: str) -> Optional[dict]:
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _write_json(path: str, obj: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def _done_shards(out: str, dtype: str) -> dict:
    """The shards progress.jsonl lists whose .bin has the recorded size (others are done again)."""
    done = {}
    path = os.path.join(out, PROGRESS_FILE)
    if not os.path.exists(path):
        return done
    item = np.dtype(dtype).itemsize
    with open(path) as f:
        for line in f:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:  # a line cut by the interruption
                continue
            bin_path = os.path.join(out, rec["file"])
            if os.path.exists(bin_path) and os.path.getsize(bin_path) == rec["tokens"] * item:
                done[rec["shard"]] = rec
    return done


def _clear(out: str) -> None:
    for name in os.listdir(out):
        if name in (PLAN_FILE, PROGRESS_FILE, TOKENIZER_FILE, META_FILE) or (
                name.startswith("shard_") and (name.endswith(".bin") or name.endswith(".bin.tmp"))):
            os.remove(os.path.join(out, name))


def _prepare_tokenizer(s: Settings, shards: list, say: Callable[[str], None]) -> tuple[dict, object]:
    """Copies or trains the tokenizer into OUT/tokenizer.json; returns (its description, the tokenizer)."""
    dest = os.path.join(s.out, TOKENIZER_FILE)
    if s.tokenizer:
        tok = load_tokenizer(s.tokenizer)
        if os.path.abspath(s.tokenizer) != os.path.abspath(dest):
            shutil.copyfile(s.tokenizer, dest + ".tmp")
            os.replace(dest + ".tmp", dest)
        return {"source": os.path.abspath(s.tokenizer), "trained": False}, tok
    limit = s.train_sample_mb * 2**20
    seen = {"bytes": 0.0, "documents": 0}

    def sample() -> Iterator[str]:
        for shard in shards:
            for text, _end, nbytes in _pieces(shard, s.jsonl_field):
                if seen["bytes"] >= limit:
                    return
                seen["bytes"] += nbytes
                seen["documents"] += 1
                if text:
                    yield text

    say(f"training a byte-level BPE of {s.vocab_size} tokens on up to {s.train_sample_mb:g} MiB of the inputs ...")
    t0 = time.perf_counter()
    tok = train_bpe(sample(), s.vocab_size)
    got = tok.get_vocab_size(with_added_tokens=True)
    say(f"  trained in {time.perf_counter() - t0:.1f} s on {seen['bytes'] / 2**20:.1f} MiB"
        + (f"; the sample gave {got} tokens, fewer than the {s.vocab_size} asked" if got < s.vocab_size else ""))
    tok.save(dest + ".tmp")
    os.replace(dest + ".tmp", dest)
    return {"source": f"byte-level BPE trained by prime-tokenize on {seen['bytes'] / 2**20:.1f} MiB of the inputs",
            "trained": True, "requested_vocab_size": s.vocab_size}, tok


def _check_settings(s: Settings) -> None:
    """Raises TokenizeError naming the option that is wrong."""
    if bool(s.tokenizer) == bool(s.vocab_size):
        raise TokenizeError("give either --tokenizer tokenizer.json or --vocab-size N (to train a BPE)")
    if s.vocab_size is not None and not 258 <= s.vocab_size <= 2**32:
        raise TokenizeError(f"--vocab-size must be in [258, 2^32] (256 bytes, the end-of-text token and at least "
                            f"one merge), got {s.vocab_size}")
    if s.workers < 1:
        raise TokenizeError(f"--workers must be >= 1, got {s.workers}")
    if not s.shard_size_mb > 0 or not s.train_sample_mb > 0:
        raise TokenizeError("--shard-size-mb and --train-sample-mb must be > 0")
    if s.tokenizer and not os.path.isfile(s.tokenizer):
        raise TokenizeError(f"--tokenizer {s.tokenizer!r} is not a file")


def _plan_or_resume(s: Settings, files: list, shards: list, say: Callable[[str], None]) -> tuple:
    """(tokenizer, its info, its path under OUT): the plan in OUT resumed when it is of these inputs and settings
    and its tokenizer is intact, else a new plan (shards of another tokenizer removed, the tokenizer loaded or
    trained). Raises TokenizeError when OUT holds another tokenization and --overwrite is not given."""
    settings = {"jsonl_field": s.jsonl_field, "shard_size_mb": s.shard_size_mb, "eos_token": s.eos_token,
                "tokenizer": os.path.abspath(s.tokenizer) if s.tokenizer else None,
                "tokenizer_sha256": _sha256(s.tokenizer) if s.tokenizer else None,
                "vocab_size": s.vocab_size, "train_sample_mb": s.train_sample_mb if s.vocab_size else None}
    plan = {"inputs": _input_signature(files), "settings": settings, "shards": shards}
    if s.overwrite:
        _clear(s.out)
    old = _read_json(os.path.join(s.out, PLAN_FILE))
    tok_path = os.path.join(s.out, TOKENIZER_FILE)
    if old is not None and {k: old.get(k) for k in plan} != plan:
        what = [k for k in ("inputs", "settings", "shards") if old.get(k) != plan[k]]
        raise TokenizeError(f"{s.out} holds a tokenization of other {' and '.join(what)} ({PLAN_FILE}); resume "
                            "it with the same command, or pass --overwrite to start again, or use another --out")
    if old is not None and os.path.exists(tok_path) and _sha256(tok_path) == old.get("tokenizer_sha256"):
        say(f"resuming the tokenization in {s.out} ({PLAN_FILE} matches these inputs)")
        return load_tokenizer(tok_path), old["tokenizer_info"], tok_path
    for name in os.listdir(s.out):  # shards of an unfinished plan with another tokenizer are not ours
        if name.startswith("shard_") or name in (PROGRESS_FILE, META_FILE):
            os.remove(os.path.join(s.out, name))
    tok_info, tok = _prepare_tokenizer(s, shards, say)
    plan["tokenizer_sha256"], plan["tokenizer_info"] = _sha256(tok_path), tok_info
    _write_json(os.path.join(s.out, PLAN_FILE), plan)
    return tok, tok_info, tok_path


def tokenize(s: Settings, say: Callable[[str], None] = print) -> dict:
    """Runs (or resumes) a tokenization; returns the metadata written to OUT/meta.json."""
    _check_settings(s)
    t_start = time.perf_counter()
    os.makedirs(s.out, exist_ok=True)
    files, skipped = list_inputs(s.inputs, s.out)
    shards = plan_inputs(files, int(s.shard_size_mb * 2**20))
    tok, tok_info, tok_path = _plan_or_resume(s, files, shards, say)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    eos_token, eos_id = _eos_id(tok, s.eos_token, s.tokenizer or tok_path)
    dtype = token_dtype_for(vocab)
    done = _done_shards(s.out, dtype)
    todo = [i for i in range(len(shards)) if i not in done]
    total_bytes = float(sum(os.path.getsize(p) for p in files))
    shard_bytes = [float(sum(_piece_bytes(p) for p in sh)) for sh in shards]
    start_bytes = sum(shard_bytes[i] for i in done)
    if done:
        say(f"{len(done)} of {len(shards)} shards were done before; tokenizing the other {len(todo)}")
    bar = Progress(total_bytes, unit="", label="tokenizing", start=start_bytes,
                   fmt=lambda b: f"{b / 2**20:.1f} MiB" if b < 2**30 else f"{b / 2**30:.2f} GiB",
                   interactive=s.progress, stream=sys.stdout, every_s=30.0)
    progress_log = open(os.path.join(s.out, PROGRESS_FILE), "a")
    t0 = time.perf_counter()
    live = {"bytes": 0.0, "tokens": 0}  # read and written by this run so far

    def show(nbytes: float, ntokens: int) -> None:
        live["bytes"], live["tokens"] = nbytes, ntokens
        rate = ntokens / max(1e-9, time.perf_counter() - t0)
        bar.update(start_bytes + nbytes, tokens=f"{format_count(ntokens)} tokens", rate=f"{format_count(rate)} tok/s")

    def finished(rec: dict) -> None:
        done[rec["shard"]] = rec
        progress_log.write(json.dumps(rec) + "\n")
        progress_log.flush()
        os.fsync(progress_log.fileno())
        faults.hit("tokenize.after_shard", len(done), log=bar.write)  # prime/faults.py

    jobs = [(i, shards[i], s.out, s.jsonl_field, eos_id, dtype) for i in todo]
    try:
        if s.workers == 1 or len(jobs) <= 1:
            os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core, like one worker
            for job in jobs:
                finished(tokenize_shard(tok, *job, report=lambda b, n: show(live["bytes"] + b, live["tokens"] + n)))
        else:
            _run_pool(min(s.workers, len(jobs)), jobs, tok_path, show, finished)
    finally:
        progress_log.close()
        bar.close()
    records = [done[i] for i in range(len(shards))]
    meta = {
        "format": META_FORMAT,
        "tokenizer": {"file": TOKENIZER_FILE, "sha256": _sha256(tok_path), "eos_token": eos_token, "eos_id": eos_id,
                      **tok_info},
        "vocab_size": vocab,
        "dtype": dtype,
        "num_tokens": sum(r["tokens"] for r in records),
        "num_documents": sum(r["documents"] for r in records),
        "shards": [{"file": r["file"], "tokens": r["tokens"], "documents": r["documents"]} for r in records],
        "inputs": {"files": len(files), "bytes": int(total_bytes), "skipped_binary": len(skipped),
                   "jsonl_field": s.jsonl_field},
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "tool": "prime-tokenize",
    }
    _write_json(os.path.join(s.out, META_FILE), meta)
    wall = time.perf_counter() - t_start
    tok_s = time.perf_counter() - t0
    new_tokens = live["tokens"]
    say(f"prime-tokenize: {len(files)} files ({total_bytes / 2**20:.1f} MiB"
        + (f"; {len(skipped)} binary files skipped" if skipped else "") + f") -> "
        f"{meta['num_tokens']:,} tokens in {meta['num_documents']:,} documents, {len(records)} {dtype} "
        f"shard{'s' if len(records) != 1 else ''} under {s.out} in {format_duration(wall)}"
        + (f" (tokenizing: {format_count(new_tokens / tok_s)} tokens/s)" if new_tokens and tok_s > 0 else ""))
    say(f"  tokenizer: {tok_info['source']}; vocabulary {vocab}, end of text {eos_token!r} = {eos_id}")
    say(f"  train on it: --data.source bin --data.path {s.out} (model.vocab_size {vocab} is read from {META_FILE})")
    return meta


def _piece_bytes(piece: list) -> float:
    path, kind, start, end = piece
    if kind == "parquet":
        meta = _parquet().ParquetFile(path).metadata
        return float(sum(meta.row_group(i).total_byte_size for i in range(start, end)))
    return float(end - start)


def _run_pool(workers: int, jobs: list, tok_path: str, show, finished) -> None:
    """The shards on `workers` spawned processes (spawn: the tokenizers library must not be forked)."""
    ctx = multiprocessing.get_context("spawn")
    counters = ctx.Array("q", 2)  # input bytes read, tokens written, by every worker so far
    results: queue.Queue = queue.Queue()
    pool = ctx.Pool(workers, initializer=_worker_init, initargs=(tok_path, counters))
    try:
        for job in jobs:
            pool.apply_async(_worker_shard, (job,), callback=results.put, error_callback=results.put)
        for _ in jobs:
            while True:
                with counters.get_lock():
                    show(counters[0], counters[1])
                try:
                    rec = results.get(timeout=0.2)
                    break
                except queue.Empty:
                    continue
            if isinstance(rec, BaseException):
                raise rec
            finished(rec)
        with counters.get_lock():
            show(counters[0], counters[1])
        pool.close()
    finally:
        pool.terminate()
        pool.join()


def main(argv=None) -> int:
    """prime-tokenize INPUT... --out DIR [--tokenizer tokenizer.json | --vocab-size N] [options]."""
    p = argparse.ArgumentParser(prog="prime-tokenize", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    p.add_argument("inputs", nargs="*", metavar="INPUT", help="files and directories to tokenize")
    p.add_argument("--files-from", metavar="LIST", help="a file naming one input per line (added to INPUT)")
    p.add_argument("--out", required=True, metavar="DIR", help="where the shards, tokenizer.json and meta.json go")
    t = p.add_mutually_exclusive_group()
    t.add_argument("--tokenizer", metavar="tokenizer.json", help="a tokenizers-library tokenizer to use")
    t.add_argument("--vocab-size", type=int, metavar="N", help="train a byte-level BPE of N tokens on the inputs")
    p.add_argument("--jsonl-field", default="text", metavar="NAME",
                   help="the text field of JSONL objects and the text column of Parquet files (default text)")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1, metavar="K",
                   help="processes tokenizing shards in parallel (default: one per core)")
    p.add_argument("--shard-size-mb", type=float, default=256.0, metavar="MB",
                   help="input MiB per output shard (default 256)")
    p.add_argument("--train-sample-mb", type=float, default=512.0, metavar="MB",
                   help="with --vocab-size: train on the first MB MiB of the inputs (default 512)")
    p.add_argument("--eos-token", metavar="TOKEN", help="the token appended to every document "
                   f"(default: the first of {', '.join(EOS_CANDIDATES)} the tokenizer has)")
    p.add_argument("--overwrite", action="store_true", help="start again, replacing what --out holds of an earlier run")
    p.add_argument("--no-progress", action="store_true", help="plain lines even on a terminal")
    args = p.parse_args(argv)
    inputs = list(args.inputs)
    try:
        if args.files_from:
            with open(args.files_from) as f:
                inputs += [line.strip() for line in f if line.strip()]
        if not inputs:
            raise TokenizeError("no INPUT given (files, directories or --files-from LIST)")
        tokenize(Settings(inputs=inputs, out=args.out, tokenizer=args.tokenizer, vocab_size=args.vocab_size,
                          jsonl_field=args.jsonl_field, workers=args.workers, shard_size_mb=args.shard_size_mb,
                          train_sample_mb=args.train_sample_mb, eos_token=args.eos_token, overwrite=args.overwrite,
                          progress=False if args.no_progress else None))
    except (TokenizeError, OSError) as e:
        print(f"prime-tokenize: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"prime-tokenize: interrupted; run the same command again to resume (shards done are kept in "
              f"{args.out})", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
