"""The replica check's weights hash: one blake2b stream (before) against prime.hashing's tree (now), side by side.

    python3 benchmarks/bench_hash.py --gib 2 --threads 1,2 --repeats 3                   # CPU only
    python3 benchmarks/bench_hash.py --gib 8 --threads 1,4,8 --device cuda,cpu --out R.json
    python3 benchmarks/bench_hash.py --device cuda --before OLD_hashing.py    # an earlier version side by side

For each device (the outer state on the GPU, or in host memory), times over --repeats, alternated:
  stream   hashlib.blake2b over the tensor's bytes (the tensor copied to the host first when on the GPU)
  tree@T   prime.hashing.tensors_hash with T threads
  before@T the same of an earlier prime/hashing.py (--before), checked to give the same value
and prints GB/s (medians) and the ratio to the stream. Random fp32 data, fresh each run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from prime.hashing import tensors_hash  # noqa: E402


def _stream(t: torch.Tensor) -> bytes:
    h = hashlib.blake2b(digest_size=8)
    h.update(t.cpu().numpy().data)
    return h.digest()


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0, help="size of the tensor (GiB of fp32)")
    ap.add_argument("--threads", default="1,2", help="thread counts of the tree hash")
    ap.add_argument("--device", default="cpu", help="devices, comma-separated (cpu, cuda)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--before", default=None,
                    help="a file holding an earlier prime/hashing.py: its tree@T runs too, as before@T")
    ap.add_argument("--out", default=None, help="JSON with every sample")
    args = ap.parse_args(argv)
    threads = [int(x) for x in args.threads.split(",")]
    before = None
    if args.before:
        import importlib.util

        spec = importlib.util.spec_from_file_location("hashing_before", args.before)
        before = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(before)
    n = int(args.gib * (1 << 30)) // 4
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    result = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "gib": args.gib,
              "torch_threads": torch.get_num_threads(), "devices": {}}
    for device in args.device.split(","):
        x = torch.randn(n, generator=gen).to(device)
        methods = {"stream": lambda: _stream(x)}
        methods.update({f"tree@{t}": (lambda t=t: tensors_hash([x], 8, threads=t)) for t in threads})
        if before is not None:
            methods.update({f"before@{t}": (lambda t=t: before.tensors_hash([x], 8, threads=t)) for t in threads})
        samples: dict = {m: [] for m in methods}
        digests: dict = {}
        for _ in range(args.repeats):
            for m, fn in methods.items():  # alternated: the machine's noise falls on every method alike
                if device == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                got = fn()
                samples[m].append(time.perf_counter() - t0)
                if m != "stream":  # every tree gives the same value, whatever its threads and version
                    digests.setdefault(got, []).append(m)
        if len(digests) != 1:
            raise SystemExit(f"bench_hash: the tree hashes differ on {device}: {digests}")
        gb = n * 4 / 1e9
        med = {m: statistics.median(s) for m, s in samples.items()}
        for m in methods:
            print(f"{device:5s} {m:8s} {gb / med[m]:6.2f} GB/s  median {med[m]:.3f} s  x{med['stream'] / med[m]:.2f} "
                  "against the stream", flush=True)
        result["devices"][device] = {"samples_s": samples, "median_s": med, "gb": gb}
        del x
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
