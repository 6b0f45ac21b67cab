"""Build of the `prime` package and its compiled core `prime._C`.

The C++ extension is always built (codec CPU kernels, the TCP ring). The CUDA
codec kernels are added when the installed torch is a CUDA build and nvcc is
found. Environment switches:

  PRIME_SKIP_CUDA=1          build without the CUDA kernels
  PRIME_CUDA_ARCHS="80;90"   compute capabilities to compile for (default 80;90)
  MAX_JOBS=N                 parallel ninja jobs (torch's own switch)

Install with `pip install --no-build-isolation -e .` so that the build uses the
torch already installed instead of downloading a second one.
"""

import glob
import os
import shutil
import sys

from setuptools import find_packages, setup

try:
    import torch
    from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension, CUDA_HOME
except ImportError:  # pragma: no cover - only hit when torch is missing
    sys.exit(
        "prime: torch must be installed before building (pip install torch), and the build must "
        "run with --no-build-isolation so it sees that torch."
    )

HERE = os.path.dirname(os.path.abspath(__file__))


def _sources(pattern):
    return sorted(os.path.relpath(p, HERE) for p in glob.glob(os.path.join(HERE, pattern), recursive=True))


def _cuda_decision():
    """Returns (use_cuda, reason) where reason explains a skip in one line."""
    if os.environ.get("PRIME_SKIP_CUDA", "0") not in ("", "0"):
        return False, "PRIME_SKIP_CUDA is set"
    if torch.version.cuda is None:
        return False, f"the installed torch {torch.__version__} is a CPU-only build"
    nvcc = os.path.join(CUDA_HOME, "bin", "nvcc") if CUDA_HOME else shutil.which("nvcc")
    if not nvcc or not os.path.exists(nvcc):
        return False, "nvcc was not found (set CUDA_HOME)"
    return True, ""


def _cuda_arch_flags():
    archs = os.environ.get("PRIME_CUDA_ARCHS", "80;90")
    flags = []
    for arch in filter(None, (a.strip() for a in archs.replace(",", ";").split(";"))):
        if not arch.isdigit():
            sys.exit(f"prime: PRIME_CUDA_ARCHS entry {arch!r} is not a compute capability like 90")
        flags.append(f"-gencode=arch=compute_{arch},code=sm_{arch}")
    return flags


# -ffp-contract=off: the wire format forbids fused multiply-add (every backend must
# produce the same bits), and GCC contracts a*b+c by default when FMA is available.
cxx_flags = ["-O3", "-std=c++17", "-ffp-contract=off", "-fopenmp", "-Wall", "-Wno-unused-function"]
sources = _sources("csrc/**/*.cpp")
use_cuda, why_not = _cuda_decision()

if use_cuda:
    # --fmad=false: same reason as -ffp-contract=off above.
    nvcc_flags = ["-O3", "--fmad=false", "-std=c++17", "--expt-relaxed-constexpr"] + _cuda_arch_flags()
    ext = CUDAExtension(
        "prime._C",
        sources + _sources("csrc/**/*.cu"),
        define_macros=[("PRIME_WITH_CUDA", "1")],
        extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags},
        extra_link_args=["-fopenmp", "-ldl"],  # -ldl: the ring dlopens libcrypto (glibc < 2.34)
    )
else:
    print(f"prime: building without the CUDA codec kernels: {why_not}.")
    ext = CppExtension(
        "prime._C",
        sources,
        extra_compile_args={"cxx": cxx_flags},
        extra_link_args=["-fopenmp", "-ldl"],  # -ldl: the ring dlopens libcrypto (glibc < 2.34)
    )

setup(
    name="prime",
    version="0.1.0",
    description="DiLoCo training over the internet: an int8 ring all-reduce over TCP and the training loop around it",
    # kernels/ (the Triton codec) is reached as prime.kernels through the link prime/kernels
    packages=find_packages(include=["prime", "prime.*"]),
    python_requires=">=3.10",
    ext_modules=[ext],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    entry_points={
        "console_scripts": [
            "prime-train=prime.train:main",
            "prime-simulate=prime.simulate:main",
        ]
    },
    zip_safe=False,
)
