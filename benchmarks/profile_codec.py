"""What limits the GPU codec kernels: the compilers' resource reports, and one launch
of each kernel for Nsight Compute.

    python benchmarks/profile_codec.py                  # registers, spills, shared memory
    ncu --kernel-name regex:'quantize|dequantize' --section SpeedOfLight \\
        --section LaunchStats --section Occupancy \\
        python benchmarks/profile_codec.py --launch-only --mib 64

The report covers the CUDA kernels in prime/_C (cuobjdump --dump-resource-usage
on the built extension) and the Triton kernels (register and spill counts of
the compiled kernels, as launched by prime.kernels). --launch-only launches
quantize and dequantize-add twice per GPU backend and nothing else of the
codec, so ncu profiles those launches: the first of each pair includes
compilation or module load on the host, not on the GPU, so both profiles count.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from prime import ops  # noqa: E402


def cuda_resources() -> list[str]:
    """The resource lines cuobjdump prints for every kernel of prime/_C (demangled when c++filt exists)."""
    libs = glob.glob(os.path.join(ROOT, "prime", "_C*.so"))
    tool = shutil.which("cuobjdump")
    if not libs or tool is None:
        return [f"(no CUDA resource report: extension {libs or 'not built'}, cuobjdump {tool or 'not found'})"]
    text = subprocess.run([tool, "--dump-resource-usage", libs[0]], capture_output=True, text=True).stdout
    lines, function = [], None
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("Function"):
            function = line.split("Function", 1)[1].strip().rstrip(":")
        elif line.startswith("REG") and function:
            lines.append(f"{demangle(function)}: {line}")
            function = None
    return lines or ["(cuobjdump printed no kernels)"]


def demangle(name: str) -> str:
    filt = shutil.which("c++filt")
    if filt is None:
        return name
    out = subprocess.run([filt, name], capture_output=True, text=True).stdout.strip()
    if not out:
        return name
    out = out.replace("(anonymous namespace)", "{anon}")
    return out.split("(")[0]  # the name and template arguments say enough; drop the parameter list


def triton_resources(n: int, block: int) -> list[str]:
    """Registers, spills and shared memory of the Triton kernels as prime.kernels launches them."""
    from prime.kernels import codec as tk

    x = torch.randn(n, device="cuda")
    q = torch.empty(n, dtype=torch.int8, device="cuda")
    scales = torch.empty(-(-n // block), dtype=torch.float32, device="cuda")
    acc = torch.randn(n, device="cuda")
    kernels = {
        "quantize (fp32 in)": tk._launch_quantize(x, q, scales, block, None),
        "quantize, stochastic": tk._launch_quantize(x, q, scales, block, 1234),
        "dequantize-add": tk._launch_dequantize(q, scales, acc, block, True),
    }
    torch.cuda.synchronize()
    out = []
    for what, k in kernels.items():
        meta = getattr(k, "metadata", None)
        warps = getattr(meta, "num_warps", "?")
        shared = getattr(meta, "shared", getattr(k, "shared", "?"))
        out.append(f"triton {what}: {getattr(k, 'n_regs', '?')} registers, {getattr(k, 'n_spills', '?')} spills, "
                   f"{warps} warps, {shared} B shared")
    return out


def launch_once(n: int, block: int) -> None:
    """Two launches of quantize and dequantize-add per GPU backend (ncu profiles both)."""
    x = torch.randn(n, device="cuda")
    acc = torch.randn(n, device="cuda")
    for backend in [b for b in ("cuda", "triton") if b in ops.available_backends("cuda")]:
        for _ in range(2):  # the first call also compiles / loads on the host; the kernels are the same
            q, scales = ops.quantize_int8(x, block, backend=backend, check_finite=False)
            ops.dequantize_add_int8_(acc, q, scales, block, backend=backend)
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mib", default="64,256", help="fp32 MiB per call (comma list)")
    p.add_argument("--block-size", type=int, default=64, help="int8 codec block size (default 64, the codec's)")
    p.add_argument("--launch-only", action="store_true", help="only launch the kernels (run under ncu)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("profile_codec: needs a CUDA GPU", file=sys.stderr)
        return 2
    sizes = [int(m) * (1 << 20) // 4 for m in args.mib.split(",")]
    if args.launch_only:
        for n in sizes:
            launch_once(n, args.block_size)
        return 0
    print(f"device: {torch.cuda.get_device_name()}")
    print("CUDA kernels (cuobjdump --dump-resource-usage):")
    for line in cuda_resources():
        print("  " + line)
    print(f"Triton kernels ({sizes[0] * 4 >> 20} MiB launch, block {args.block_size}):")
    for line in triton_resources(sizes[0], args.block_size):
        print("  " + line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
