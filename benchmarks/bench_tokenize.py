"""prime-tokenize's throughput against the tokenizers library's own batch API on one core.

    python benchmarks/bench_tokenize.py                 # ~20 MiB of Python source text, BPE of 8192 tokens
    python benchmarks/bench_tokenize.py --mib 64 --repeats 5

The corpus is the Python standard library's .py files (recursively, sorted),
repeated until it holds --mib MiB, one file per document. A byte-level BPE of
--vocab-size tokens is trained on it once (prime.tokenize.train_bpe). Then, each
repeat, interleaved so background load hits them alike:

  library encode_batch       Tokenizer.encode_batch over batches of documents already in memory,
                             TOKENIZERS_PARALLELISM=false (one core): the ceiling of one core
  library encode_batch_fast  the same without offsets (what prime-tokenize calls)
  prime-tokenize, 1 worker   the whole pipeline from the files on disk to the shards: read, decode,
                             encode, append the end-of-text token, write uint16, record progress
  prime-tokenize, K workers  the same with K = os.cpu_count() worker processes

Before timing, the shards are checked against the library's tokens document by
document. Tokens/s are medians over the repeats; the ratio of the 1-worker
pipeline to encode_batch is what the pipeline costs (1.0: free).

Writes a table to stdout and JSON to benchmarks/results/tokenize_cpu.json (--out).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # run from a checkout without installing

from prime import tokenize as tk  # noqa: E402
from prime.data import load_source  # noqa: E402


def make_corpus(root: str, mib: float) -> list[str]:
    """Copies stdlib .py files into root until it holds `mib` MiB; returns the documents in reading order."""
    stdlib = os.path.dirname(os.__file__)
    files = sorted(p for p in glob.glob(os.path.join(stdlib, "**", "*.py"), recursive=True)
                   if "site-packages" not in p and os.path.getsize(p) > 0)
    docs, total, i = [], 0, 0
    while total < mib * 2**20:
        src = files[i % len(files)]
        with open(src, "rb") as f:
            raw = f.read()
        if b"\0" not in raw[:8192]:
            text = raw.decode("utf-8", errors="replace")
            with open(os.path.join(root, f"doc{i:06d}.txt"), "wb") as f:
                f.write(raw)
            docs.append(text)
            total += len(raw)
        i += 1
    return docs


def library_rate(tok, docs: list[str], fast: bool, batch_chars: int) -> tuple[float, int]:
    """(seconds, tokens) of the library's batch API over every document, one core."""
    encode = tok.encode_batch_fast if fast else tok.encode_batch
    batches, cur, chars = [], [], 0
    for d in docs:
        cur.append(d)
        chars += len(d)
        if chars >= batch_chars:
            batches.append(cur)
            cur, chars = [], 0
    if cur:
        batches.append(cur)
    t0 = time.perf_counter()
    n = 0
    for b in batches:
        for e in encode(b, add_special_tokens=False):
            n += len(e.ids)
    return time.perf_counter() - t0, n


def pipeline_rate(corpus: str, tokenizer: str, out: str, workers: int) -> tuple[float, int]:
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    meta = tk.tokenize(tk.Settings(inputs=[corpus], out=out, tokenizer=tokenizer, workers=workers,
                                   shard_size_mb=max(1.0, args.mib / 8), progress=False), say=lambda m: None)
    return time.perf_counter() - t0, meta["num_tokens"]


def main() -> int:
    global args
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=float, default=20.0, help="corpus size in MiB (default 20)")
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=os.path.join(HERE, "results", "tokenize_cpu.json"))
    args = p.parse_args()
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    work = tempfile.mkdtemp(prefix="bench_tokenize_")
    try:
        corpus = os.path.join(work, "corpus")
        os.makedirs(corpus)
        docs = make_corpus(corpus, args.mib)
        mib = sum(os.path.getsize(os.path.join(corpus, n)) for n in os.listdir(corpus)) / 2**20
        t0 = time.perf_counter()
        tok = tk.train_bpe(iter(docs), args.vocab_size)
        train_s = time.perf_counter() - t0
        tj = os.path.join(work, "tokenizer.json")
        tok.save(tj)
        out = os.path.join(work, "out")
        # correctness first: the shards hold the library's tokens of every document, each ended by the eos
        pipeline_rate(corpus, tj, out, 1)
        eos = tok.token_to_id(tk.TRAINED_EOS)
        ref = np.concatenate([np.array(e.ids + [eos], dtype=np.int64)
                              for e in tok.encode_batch(docs, add_special_tokens=False)])
        got = np.concatenate([np.asarray(a, dtype=np.int64) for a in load_source("bin", out).arrays])
        assert np.array_equal(ref, got), "prime-tokenize's shards differ from the library's tokens"
        workers = os.cpu_count() or 1
        cases = {"library encode_batch": lambda: library_rate(tok, docs, False, tk.BATCH_CHARS),
                 "library encode_batch_fast": lambda: library_rate(tok, docs, True, tk.BATCH_CHARS),
                 "prime-tokenize, 1 worker": lambda: pipeline_rate(corpus, tj, out, 1),
                 f"prime-tokenize, {workers} workers": lambda: pipeline_rate(corpus, tj, out, workers)}
        times: dict = {k: [] for k in cases}
        tokens: dict = {}
        for _ in range(args.repeats):
            for name, fn in cases.items():
                s, n = fn()
                times[name].append(s)
                tokens[name] = n
        base = statistics.median(times["library encode_batch"])
        rows = []
        print(f"corpus {mib:.1f} MiB ({len(docs)} documents), BPE {args.vocab_size} trained in {train_s:.1f} s; "
              f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}")
        print(f"{'':34} {'median s':>9} {'M tokens/s':>11} {'vs encode_batch':>16}")
        for name in cases:
            med = statistics.median(times[name])
            rate = tokens[name] / med
            rows.append({"case": name, "median_s": med, "times_s": times[name], "tokens": tokens[name],
                         "tokens_per_s": rate, "vs_encode_batch": base / med})
            print(f"{name:34} {med:9.3f} {rate / 1e6:11.3f} {base / med:15.2f}x")
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"corpus_mib": mib, "documents": len(docs), "vocab_size": args.vocab_size,
                       "repeats": args.repeats, "cpu": platform.processor() or platform.machine(),
                       "cores": os.cpu_count(), "load_avg": os.getloadavg(), "rows": rows}, f, indent=1)
        print(f"wrote {args.out}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
