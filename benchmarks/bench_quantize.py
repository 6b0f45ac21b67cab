"""Throughput of the block codecs (int8 and fp4, side by side): every backend next
to the pure-torch reference (eager, and for int8 torch.compile) and a plain copy of
the same bytes.

    python benchmarks/bench_quantize.py --quick                 # CPU here, or the GPU when present
    python benchmarks/bench_quantize.py --device cuda           # 1 MiB .. 1 GiB
    python benchmarks/bench_quantize.py --device cpu --sizes 64 --codecs int8,fp4
    python benchmarks/bench_quantize.py --device cpu --sizes 64 --codecs int8,int8@256   # two block sizes

Sizes are fp32 input bytes (n = size / 4 elements). GB/s counts bytes read plus
bytes written, the way a memory-bound kernel is judged (C: the code bytes, n for
int8, ceil(n/2) for fp4):

    copy            4n read + 4n written (the bandwidth ceiling; "% copy" is relative to it)
    quantize        in_bytes*n read + C + 4n/B written
    dequantize      C + 4n/B read + 4n written (fp32 out)
    dequantize_add  C + 4n/B + 4n read + 4n written

(the ops' scales are fp32 tensors, 4 bytes each, also int8's, which a ring payload
carries in 2). B: the block a codec is named with (--codecs int8@256), else --block-size,
else each codec's default (int8 64, fp4 256).

fp4 moves fewer bytes than int8 for the same n, so its GB/s understate it next to
int8's; "Gval/s" (values per second, n / time) compares the two codecs at the same
input, the rate a ring needs.

Each number is the median over repeats of a batch of calls; implementations are
interleaved repeat by repeat so background load hits them alike. Inputs rotate
over several buffers when one set would stay in the last-level cache. Outputs
are allocated by each call, as a user of the op would see it (on the CPU that
includes the page faults of fresh memory for all contenders alike).

Before timing, every implementation's output is checked bit for bit against
the eager reference (NaN-aware for decoded values): a fast wrong kernel fails
the benchmark instead of winning it.

Writes a table to stdout and JSON to benchmarks/results/quantize_<device>_<date>.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import random
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # run from a checkout without installing

from prime import _extension  # noqa: E402
from prime import ops  # noqa: E402

MiB = 1 << 20
FULL_SIZES_MIB = [1, 4, 16, 64, 256, 1024]
QUICK_SIZES_MIB = [1, 64]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


# ---------------------------------------------------------------------------
# implementations: each maker returns fn(x) / fn(q, s) / fn(acc, q, s), or None when unavailable


def _triton_codec(device, codec_name):
    try:
        from prime.kernels import codec  # written by the Triton work; may be absent
    except Exception as e:  # ImportError, or triton itself failing to import
        return None, f"prime.kernels.codec not importable ({type(e).__name__}: {e})"
    for name in (f"quantize_{codec_name}", f"dequantize_{codec_name}", f"dequantize_add_{codec_name}_", "available"):
        if not hasattr(codec, name):
            return None, f"prime.kernels.codec has no {name}"
    try:
        ok = codec.available(device)
    except Exception as e:
        return None, f"prime.kernels.codec.available failed ({e})"
    if not ok:
        return None, f"Triton kernels not available on {device}"
    return codec, ""


# Per codec: the code bytes of n values, and the reference ops (dequantize takes n, as fp4's does).
CODECS = {
    "int8": dict(code_bytes=lambda n: n, quantize=ops.quantize_int8_reference,
                 dequantize=lambda q, s, n, B, dtype: ops.dequantize_int8_reference(q, s, B, dtype),
                 dequantize_add=ops.dequantize_add_int8_reference_),
    "fp4": dict(code_bytes=ops.fp4_bytes, quantize=ops.quantize_fp4_reference,
                dequantize=ops.dequantize_fp4_reference, dequantize_add=ops.dequantize_add_fp4_reference_),
}


def _op_triple(quantize, dequantize, dequantize_add, codec, block):
    """(fq(x, seed), fd(q, s, n), fa(acc, q, s)) over ops with the argument order of prime.ops' torch ops."""
    if codec == "fp4":
        return (lambda x, seed: quantize(x, block, seed),
                lambda q, s, n: dequantize(q, s, n, block, torch.float32),
                lambda acc, q, s: dequantize_add(acc, q, s, block))
    return (lambda x, seed: quantize(x, block, seed),
            lambda q, s, n: dequantize(q, s, block, torch.float32),
            lambda acc, q, s: dequantize_add(acc, q, s, block))


def backend_impls(device, block, all_isas, codec="int8"):
    """name -> (quantize(x, seed), dequantize(q, s, n), dequantize_add_(acc, q, s)) of `codec`; plus notes on skips."""
    impls, notes = {}, []
    P = torch.ops.prime if _extension.available() else None

    def torch_ops():
        return _op_triple(getattr(P, f"quantize_{codec}"), getattr(P, f"dequantize_{codec}"),
                          getattr(P, f"dequantize_add_{codec}_"), codec, block)

    if device.type == "cpu" and _extension.available():
        isas = P._cpu_codec_isas()
        impls["cpu"] = torch_ops()
        notes.append(f"cpu backend uses {P._cpu_codec_plan()} (supported here: {', '.join(isas)})")
        if all_isas:
            for isa in isas:
                impls[f"cpu-{isa}"] = _op_triple(
                    lambda x, b, seed, isa=isa: getattr(P, f"_quantize_{codec}_isa")(x, b, seed, isa),
                    lambda *a, isa=isa: getattr(P, f"_dequantize_{codec}_isa")(*a, isa),
                    lambda *a, isa=isa: getattr(P, f"_dequantize_add_{codec}_isa_")(*a, isa),
                    codec, block)
    elif device.type == "cpu":
        notes.append(f"cpu backend skipped: {_extension.build_hint()}")
    if device.type == "cuda":
        if _extension.has_cuda_kernels():
            impls["cuda"] = torch_ops()
        else:
            notes.append(f"cuda backend skipped: {_extension.build_hint()}")
        triton_codec, why = _triton_codec(device, codec)
        if triton_codec is not None:
            impls["triton"] = _op_triple(getattr(triton_codec, f"quantize_{codec}"),
                                         getattr(triton_codec, f"dequantize_{codec}"),
                                         getattr(triton_codec, f"dequantize_add_{codec}_"), codec, block)
        else:
            notes.append(f"triton skipped: {why}")
    return impls, notes


def quantize_reference_compilable(x, block_size, seed, c127):
    """prime.ops.quantize_int8_reference rearranged for torch.compile, same bits (the
    benchmark checks the compiled output bit for bit against the eager reference):

    - the constant 127 comes in as a tensor (c127, one element): under torch.compile
      a constant divisor gets folded into a multiply by its rounded reciprocal, which
      changes the last bit of some scales (seen with inductor's Triton backend);
    - the non-finite test reads the block's max |x| (NaN and Inf propagate through
      amax) instead of a separate all(isfinite) reduction, and flagged blocks are
      zeroed in fp32 before the int8 cast: inductor's C++ backend makes slow mask
      code of the bool reduction and of an int8 where (the reference itself
      compiled ran at ~1 GB/s here, this at ~3x that)."""
    flat = x.reshape(-1).to(torch.float32)
    n = flat.numel()
    nb = ops.num_blocks(n, block_size)
    blocks = torch.nn.functional.pad(flat, (0, nb * block_size - n)).view(nb, block_size)
    amax = blocks.abs().amax(dim=1)
    nonfinite = ~torch.isfinite(amax)
    a = torch.where(nonfinite, 0.0, amax)
    c = c127.expand_as(a)
    # a / 127.5 (stochastic rounding: a / 127) rounded up to the scale grid, inv = 1 / scale (tensor / tensor)
    scale = ops.grid_scale_reference(a / (c + 0.5 if seed is None else c))
    one = c / c
    inv = torch.where(scale > 0, one / torch.where(scale > 0, scale, 1.0), 0.0)
    inv = torch.where(torch.isinf(inv), 0.0, inv)
    scale = torch.where(nonfinite, float("nan"), scale)
    v = blocks * inv[:, None]
    if seed is None:
        r = torch.round(v)
    else:
        index = torch.arange(nb * block_size, dtype=torch.int64, device=x.device).view(nb, block_size)
        u = ops.stochastic_uniform_reference(seed, index)
        f = torch.floor(v)
        r = f + (u < (v - f)).to(torch.float32)
    r = torch.where(nonfinite[:, None], 0.0, r.clamp(-ops.QMAX, ops.QMAX))
    return r.to(torch.int8).reshape(-1)[:n].contiguous(), scale.contiguous()


def reference_impls(block, compile_ref, compile_sr, codec="int8"):
    """The pure-torch reference, eager and (int8) under torch.compile(fullgraph=True)."""
    c = CODECS[codec]
    out = {"ref-eager": (lambda x, seed: c["quantize"](x, block, seed),
                         lambda q, s, n: c["dequantize"](q, s, n, block, torch.float32),
                         lambda acc, q, s: c["dequantize_add"](acc, q, s, block))}
    if compile_ref and codec == "int8":
        # Ask inductor for the eager numerics the wire format needs, where this torch
        # has the switches: no FMA contraction in its Triton kernels, and IEEE
        # division instead of Triton's approximate div.full. Whether it worked is
        # checked bit for bit below.
        cfg = torch._inductor.config
        if hasattr(cfg, "emulate_precision_casts"):
            cfg.emulate_precision_casts = True
        if hasattr(getattr(cfg, "eager_numerics", None), "division_rounding"):
            cfg.eager_numerics.division_rounding = True
        # the decoders are the reference itself; quantize is the variant above
        cq = torch.compile(quantize_reference_compilable, fullgraph=True, dynamic=False)
        c127 = {}
        cd = torch.compile(ops.dequantize_int8_reference, fullgraph=True, dynamic=False)
        ca = torch.compile(ops.dequantize_add_int8_reference_, fullgraph=True, dynamic=False)

        def quantize(x, seed):
            if seed is not None and not compile_sr:
                return None  # compiling the int64 hash is slow on small CPUs; opt in with --compile-sr
            if x.device not in c127:
                c127[x.device] = torch.full((1,), float(ops.QMAX), device=x.device)
            return cq(x, block, seed, c127[x.device])

        out["ref-compiled"] = (
            quantize,
            lambda q, s, n: cd(q, s, block, torch.float32),
            lambda acc, q, s: ca(acc, q, s, block),
        )
    return out


# ---------------------------------------------------------------------------
# timing


class Timer:
    """Wall time on the CPU; CUDA events on the GPU (no host sync inside a batch)."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def batch(self, fn, slots, k, first=0):
        """Seconds per call of fn(slot) over k calls cycling through slots from slots[first]."""
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for i in range(first, first + k):
                fn(slots[i % len(slots)])
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3 / k
        t0 = time.perf_counter()
        for i in range(first, first + k):
            fn(slots[i % len(slots)])
        return (time.perf_counter() - t0) / k


def last_level_cache_bytes(device):
    if device.type == "cuda":
        return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 * MiB))
    try:  # Linux: the largest cache of cpu0
        best = 0
        base = "/sys/devices/system/cpu/cpu0/cache"
        for entry in os.listdir(base):
            path = os.path.join(base, entry, "size")
            if os.path.exists(path):
                text = open(path).read().strip()
                mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1], 1)
                best = max(best, int(text.rstrip("KMG")) * mult)
        return best or 32 * MiB
    except OSError:
        return 32 * MiB


def nan_aware_equal(a, b):
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype.is_floating_point:
        na, nb = torch.isnan(a), torch.isnan(b)
        return bool(torch.equal(na, nb)) and bool(torch.equal(a[~na], b[~nb]))
    return bool(torch.equal(a, b))


def same_encoding(got, want):
    (q, s), (qr, sr) = got, want
    return bool(torch.equal(q, qr)) and bool(torch.equal(s.view(torch.int32), sr.view(torch.int32)))


# ---------------------------------------------------------------------------


def codec_name(spec):
    """The codec of a --codecs entry ("int8", or "int8@256": int8 at block 256)."""
    return spec.partition("@")[0]


def block_of(args, spec):
    """The block size a --codecs entry is timed at: its own (int8@256), --block-size, else the codec's default."""
    name, _, block = spec.partition("@")
    if block:
        return int(block)
    return args.block_size if args.block_size is not None else ops.default_block_size(name)


def bench_size(size_bytes, args, device, timer, impls, refs):
    """Times every op of one size for every codec; returns result rows. impls, refs: codec -> name -> ops."""
    n = size_bytes // 4
    dtype = DTYPES[args.dtype]
    in_bytes = torch.tensor([], dtype=dtype).element_size()

    def nbytes_of(codec):
        nb = math.ceil(n / block_of(args, codec))
        code = CODECS[codec_name(codec)]["code_bytes"](n)
        return {"quantize": in_bytes * n + code + 4 * nb, "quantize_sr": in_bytes * n + code + 4 * nb,
                "dequantize": code + 4 * nb + 4 * n, "dequantize_add": code + 4 * nb + 8 * n}

    nbytes = {codec: nbytes_of(codec) for codec in impls}
    # the biggest working set of one call decides how many buffer sets rotate
    footprint = max([8 * n] + [v for per in nbytes.values() for v in per.values()])
    cache = last_level_cache_bytes(device)
    sets = 1
    if not args.no_rotate:
        sets = max(1, min(math.ceil(2 * cache / footprint), max(1, (args.rotate_mib * MiB) // footprint)))

    gen = torch.Generator(device="cpu").manual_seed(args.seed + n)
    xs, accs, ys = [], [], []
    for _ in range(sets):
        xs.append(torch.randn(n, generator=gen).mul_(0.01).to(device=device, dtype=dtype))
        accs.append(torch.randn(n, generator=gen).to(device))
        ys.append(torch.empty(n, device=device))
    x32s = [x.float() for x in xs] if dtype != torch.float32 else xs

    ops_to_run = ["copy", "quantize", "quantize_sr", "dequantize", "dequantize_add"]
    contenders = []  # (codec, op, impl name, fn(slot), slots)
    contenders.append(("", "copy", "torch", lambda i: ys[i].copy_(x32s[i]), list(range(sets))))

    eager_ok = size_bytes <= args.max_eager_mib * MiB
    skipped, inexact = [], []

    def verify(codec, name, op, ok):
        """A backend that is not bit-exact fails the benchmark; the compiled reference is only flagged
        (torch.compile may fuse or approximate: then its speed is not the same computation's)."""
        if ok:
            return
        msg = f"{codec} {name} {op}: output differs from the eager reference at {size_bytes} bytes"
        if name != "ref-compiled":
            raise SystemExit(msg)
        print(f"# WARNING: {msg}; its row is marked *", flush=True)
        inexact.append((codec, op, name))

    for codec in impls:
        ref = CODECS[codec_name(codec)]
        B = block_of(args, codec)
        qs = [ref["quantize"](x, B) for x in xs]
        # reference results of slot 0, for the bit checks
        x0, (q0, s0), acc0 = xs[0], qs[0], accs[0]
        want_q = {"quantize": qs[0], "quantize_sr": ref["quantize"](x0, B, args.seed)}
        want_deq = ref["dequantize"](q0, s0, n, B, torch.float32)
        want_acc = ref["dequantize_add"](acc0.clone(), q0, s0, B)
        all_impls = dict(impls[codec])
        for name, fns in refs[codec].items():
            if name == "ref-eager" and not eager_ok:
                continue
            all_impls[name] = fns
        for name, (fq, fd, fa) in all_impls.items():
            t0 = time.perf_counter()
            # correctness of slot 0 first (compiles too, for ref-compiled)
            verify(codec, name, "quantize", same_encoding(fq(x0, None), want_q["quantize"]))
            contenders.append((codec, "quantize", name, lambda i, fq=fq: fq(xs[i], None), list(range(sets))))
            got = fq(x0, args.seed)
            if got is None:
                skipped.append(f"{codec} {name} quantize_sr (compile with --compile-sr)")
            else:
                verify(codec, name, "quantize_sr", same_encoding(got, want_q["quantize_sr"]))
                contenders.append(
                    (codec, "quantize_sr", name, lambda i, fq=fq: fq(xs[i], args.seed + i), list(range(sets)))
                )
            verify(codec, name, "dequantize", nan_aware_equal(fd(q0, s0, n), want_deq))
            contenders.append((codec, "dequantize", name, lambda i, fd=fd, qs=qs: fd(*qs[i], n), list(range(sets))))
            acc = acc0.clone()
            fa(acc, q0, s0)
            verify(codec, name, "dequantize_add", nan_aware_equal(acc, want_acc))
            # the accumulator keeps growing over the repeats; magnitude does not change the speed
            contenders.append(
                (codec, "dequantize_add", name, lambda i, fa=fa, qs=qs: fa(accs[i], *qs[i]), list(range(sets)))
            )
            if args.verbose:
                print(f"  checked {codec} {name} in {time.perf_counter() - t0:.1f} s", flush=True)
    if not eager_ok:
        skipped.append(f"ref-eager above --max-eager-mib {args.max_eager_mib}")

    # warm up and choose the calls per batch: about target_ms per batch
    plans = []
    for codec, op, name, fn, slots in contenders:
        for i in slots:
            fn(i)
        timer.sync()
        once = min(timer.batch(fn, slots, 1, j) for j in range(3))
        k = max(1, min(2000, round(args.target_ms / 1e3 / max(once, 1e-7))))
        plans.append((codec, op, name, fn, slots, k))

    # interleaved: every contender (both codecs) once per repeat, so background load hits them alike,
    # in a fresh order each repeat: a batch that follows one reading the same buffers (the copy
    # before the first quantize) finds them in the last-level cache, which a fixed order would
    # give to the same contender every time (seen: +40% for the first quantize at 64 MiB)
    times = {(codec, op, name): [] for codec, op, name, _, _, _ in plans}
    order = random.Random(args.seed)
    for r in range(args.repeats):
        for codec, op, name, fn, slots, k in order.sample(plans, len(plans)):
            # each batch goes on where the last one stopped, so calls keep rotating buffers
            times[(codec, op, name)].append(timer.batch(fn, slots, k, first=r * k))

    rows = []
    copy_t = statistics.median(times[("", "copy", "torch")])
    copy_gbps = 8 * n / copy_t / 1e9
    for op in ops_to_run:
        for (codec, op2, name), ts in times.items():
            if op2 != op:
                continue
            t = statistics.median(ts)
            moved = 8 * n if op == "copy" else nbytes[codec][op]
            gbps = moved / t / 1e9
            rows.append(
                {
                    "codec": codec or "-",
                    "op": op,
                    "impl": name,
                    "size_bytes": size_bytes,
                    "n": n,
                    "block_size": block_of(args, codec) if codec else None,
                    "input_dtype": args.dtype,
                    "bytes_moved": moved,
                    "time_s": t,
                    "time_s_min": min(ts),
                    "gbps": gbps,
                    "gvalues_per_s": n / t / 1e9,
                    "pct_of_copy": 100.0 * gbps / copy_gbps,
                    "rotating_sets": sets,
                    "bit_exact": (codec, op, name) not in inexact,
                }
            )
    return rows, skipped


def device_description(device):
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model = platform.processor() or "cpu"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}, {torch.get_num_threads()} threads"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--sizes", type=str, default=None, help="comma-separated fp32 input sizes in MiB (default 1..1024)")
    p.add_argument("--quick", action="store_true", help=f"sizes {QUICK_SIZES_MIB} MiB, fewer repeats")
    p.add_argument("--block-size", type=int, default=None,
                   help="block size of every codec (default: each codec's, int8 64, fp4 256)")
    p.add_argument("--codecs", type=str, default="int8,fp4",
                   help="comma-separated block codecs to time side by side, each optionally at a block (int8@256)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="input dtype of quantize")
    p.add_argument("--repeats", type=int, default=None, help="timed batches per implementation (median)")
    p.add_argument("--target-ms", type=float, default=None, help="wall time of one timed batch")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (torch.set_num_threads)")
    p.add_argument("--all-isas", action="store_true", help="CPU: also time each instruction set's kernels")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile reference")
    p.add_argument("--compile-sr", action="store_true", help="also compile the stochastic-rounding reference")
    p.add_argument("--max-eager-mib", type=int, default=None, help="skip the eager reference above this size")
    p.add_argument("--no-rotate", action="store_true", help="reuse one input even when it fits in cache")
    p.add_argument("--rotate-mib", type=int, default=None, help="memory for rotating input sets")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", type=str, default=None, help="JSON path (default benchmarks/results/...)")
    p.add_argument("--verbose", action="store_true")
    args = p.parse_args(argv)

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device")
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.block_size is not None:
        ops.check_block_size(args.block_size)
    is_cpu = device.type == "cpu"
    sizes = (
        [float(s) for s in args.sizes.split(",")]
        if args.sizes
        else (QUICK_SIZES_MIB if args.quick else FULL_SIZES_MIB)
    )
    if args.repeats is None:
        args.repeats = 5 if args.quick else 9
    if args.target_ms is None:
        args.target_ms = 20.0 if is_cpu else 5.0
    if args.max_eager_mib is None:
        # the eager reference holds ~25 bytes of temporaries per element (more with SR)
        args.max_eager_mib = 256 if is_cpu else 1024
    if args.rotate_mib is None:
        args.rotate_mib = 1024 if is_cpu else 4096
    for name in ("recompile_limit", "cache_size_limit"):  # one compiled graph per size and op
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(64, getattr(torch._dynamo.config, name)))

    codecs = [c for c in args.codecs.split(",") if c]
    for c in codecs:
        if codec_name(c) not in CODECS:
            raise SystemExit(f"--codecs: {c!r} is not one of {', '.join(CODECS)} (optionally @block)")
        ops.check_block_size(block_of(args, c), f"the block of --codecs {c}")
    impls, refs, notes = {}, {}, []
    for c in codecs:
        impls[c], codec_notes = backend_impls(device, block_of(args, c), args.all_isas, codec_name(c))
        notes += [n for n in codec_notes if n not in notes]
        refs[c] = reference_impls(block_of(args, c), not args.no_compile, args.compile_sr, codec_name(c))
    desc = device_description(device)
    blocks = ", ".join(f"{c} {block_of(args, c)}" for c in codecs)
    print(f"# codec throughput on {desc}; torch {torch.__version__}; block {blocks}; input {args.dtype}")
    for note in notes:
        print(f"# {note}")
    print(f"# command: python {' '.join(sys.argv)}")

    all_rows, all_skipped = [], []
    for mib in sizes:
        size_bytes = int(mib * MiB) // 4 * 4
        rows, skipped = bench_size(size_bytes, args, device, Timer(device), impls, refs)
        all_rows += rows
        all_skipped += [f"{mib:g} MiB: {s}" for s in skipped]
        print(f"\n## {mib:g} MiB fp32-equivalent (n = {size_bytes // 4}), rotating {rows[0]['rotating_sets']} set(s)")
        print(f"{'op':<16}{'codec':<10}{'impl':<14}{'time':>12}{'GB/s':>10}{'% copy':>9}{'Gval/s':>9}")
        for r in rows:
            t = r["time_s"]
            ts = f"{t * 1e3:.3f} ms" if t >= 1e-3 else f"{t * 1e6:.1f} us"
            impl = r["impl"] + ("" if r["bit_exact"] else " *")
            print(f"{r['op']:<16}{r['codec']:<10}{impl:<14}{ts:>12}{r['gbps']:>10.1f}{r['pct_of_copy']:>8.0f}%"
                  f"{r['gvalues_per_s']:>9.2f}")
        sys.stdout.flush()
    for s in all_skipped:
        print(f"# skipped {s}")
    if any(not r["bit_exact"] for r in all_rows):
        print("# * not bit-identical to the eager reference (torch.compile fused or approximated): a different computation")

    slug = "cpu" if is_cpu else "cuda-" + desc.replace(" ", "-")
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = args.out or os.path.join(HERE, "results", f"quantize_{slug}_{stamp}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(
            {
                "benchmark": "bench_quantize",
                "device": desc,
                "device_type": device.type,
                "threads": torch.get_num_threads(),
                "torch": torch.__version__,
                "python": platform.python_version(),
                "command": "python " + " ".join(sys.argv),
                "date": stamp,
                "notes": notes,
                "skipped": all_skipped,
                "rows": all_rows,
            },
            f,
            indent=1,
        )
    print(f"\n# wrote {os.path.relpath(out)}")


if __name__ == "__main__":
    main()
