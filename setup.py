"""Build of the `prime` package (distribution `prime-diloco`) and its compiled core `prime._C`.

The C++ extension is always built (codec CPU kernels, the TCP ring). The CUDA
codec kernels are added when the installed torch is a CUDA build and a CUDA
toolkit of the same major version, with its runtime library, is found (see
find_cuda_toolkit); otherwise the build says in one line why it skipped them.
Environment switches:

  PRIME_SKIP_CUDA=1          build without the CUDA kernels
  PRIME_CUDA_ARCHS="80;90"   compute capabilities to compile for (default 80;90)
  CUDA_HOME=/path            the toolkit to use (CUDA_PATH is read too); no search then
  MAX_JOBS=N                 parallel ninja jobs (torch's own switch)

Install with `pip install --no-build-isolation -e .` so that the build uses the
torch already installed instead of downloading a second one.
"""

import glob
import os
import re
import shutil
import subprocess
import sys
import sysconfig

from setuptools import find_packages, setup

try:
    import torch
except ImportError:  # pragma: no cover - only hit when torch is missing
    sys.exit(
        "prime: torch must be installed before building (pip install torch), and the build must "
        "run with --no-build-isolation so it sees that torch."
    )

HERE = os.path.dirname(os.path.abspath(__file__))
# The one line saying whether CUDA kernels are built and why not; `make build` prints it
# (pip -q hides a build's output).
DECISION_FILE = os.path.join(HERE, "build", "prime-cuda.txt")


def _sources(pattern):
    return sorted(os.path.relpath(p, HERE) for p in glob.glob(os.path.join(HERE, pattern), recursive=True))


def _cudart_dirs(home):
    """Directories under a toolkit root that hold libcudart (the link needs it)."""
    dirs = [os.path.join(home, d) for d in ("lib64", "lib")] + glob.glob(os.path.join(home, "targets", "*", "lib"))
    if os.path.realpath(home) == "/usr":  # a distribution's packaged toolkit: multiarch library dir
        dirs += glob.glob("/usr/lib/*-linux-gnu")
    return [d for d in dirs if glob.glob(os.path.join(d, "libcudart.so*"))]


def _toolkit_version(home):
    """(major, minor) of the nvcc in home/bin, or None."""
    try:
        out = subprocess.run([os.path.join(home, "bin", "nvcc"), "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"release (\d+)\.(\d+)", out)
    return (int(m.group(1)), int(m.group(2))) if m else None


def _check_toolkit(home, want_major):
    """'' if home is a usable toolkit for torch's CUDA major version, else why not (a few words)."""
    if not os.access(os.path.join(home, "bin", "nvcc"), os.X_OK):
        return f"{home} has no bin/nvcc"
    if not _cudart_dirs(home):
        return f"{home} has no CUDA runtime library (libcudart)"
    version = _toolkit_version(home)
    if version is None:
        return f"{home}/bin/nvcc --version did not say its release"
    if version[0] != want_major:
        return f"{home} is CUDA {version[0]}.{version[1]}, torch {torch.__version__} is built for CUDA {torch.version.cuda}"
    return ""


def _toolkits_behind_nvcc():
    """Toolkit roots behind the nvcc on PATH, most trusted first.

    The nvcc on PATH may be a symlink or a wrapper script that execs the real one
    (torch's own guess, the grandparent of that file, then has no runtime library).
    nvcc reports its own install directory in a dry run (`#$ TOP=...`), whatever ran it.
    """
    nvcc = shutil.which("nvcc")
    if not nvcc:
        return []
    roots = []
    try:
        dry = subprocess.run([nvcc, "--dryrun", "-x", "cu", "-E", os.devnull], capture_output=True, text=True, timeout=60)
        m = re.search(r"^#\$ TOP=(.+)$", dry.stdout + dry.stderr, re.MULTILINE)
        if m:
            roots.append(os.path.realpath(m.group(1).strip()))
    except (OSError, subprocess.SubprocessError):
        pass
    roots.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    roots.append(os.path.dirname(os.path.dirname(nvcc)))
    return roots


def _standard_toolkits():
    def version_key(path):
        return [int(n) for n in re.findall(r"\d+", os.path.basename(path))]

    versioned = sorted(glob.glob("/usr/local/cuda-*"), key=version_key, reverse=True)
    return ["/usr/local/cuda"] + versioned + ["/opt/cuda"]


def find_cuda_toolkit():
    """(cuda_home, reason): the toolkit to build the CUDA kernels with, or None and why not (one line).

    Order: PRIME_SKIP_CUDA; a CPU-only torch; CUDA_HOME / CUDA_PATH (taken as given, never
    searched past); the toolkit behind the nvcc on PATH; /usr/local/cuda, /usr/local/cuda-*
    (newest first), /opt/cuda. A toolkit must have bin/nvcc, libcudart and torch's CUDA major version.
    """
    if os.environ.get("PRIME_SKIP_CUDA", "0") not in ("", "0"):
        return None, "PRIME_SKIP_CUDA is set"
    if torch.version.cuda is None:
        return None, f"the installed torch {torch.__version__} is a CPU-only build"
    want_major = int(torch.version.cuda.split(".")[0])
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            home = os.path.realpath(os.environ[var])
            why = _check_toolkit(home, want_major)
            return (None, f"{var}: {why}") if why else (home, "")
    seen, rejected = set(), []
    for home in _toolkits_behind_nvcc() + _standard_toolkits():
        home = os.path.realpath(home)
        if home in seen or not os.path.isdir(home):
            continue
        seen.add(home)
        why = _check_toolkit(home, want_major)
        if not why:
            return home, ""
        if os.path.exists(os.path.join(home, "bin", "nvcc")):  # only report places that looked like toolkits
            rejected.append(why)
    if not rejected:
        return None, "no CUDA toolkit found (no nvcc on PATH or in /usr/local/cuda*, /opt/cuda; set CUDA_HOME)"
    return None, f"no usable CUDA toolkit ({'; '.join(rejected)}; set CUDA_HOME)"


def _cuda_arch_flags():
    archs = os.environ.get("PRIME_CUDA_ARCHS", "80;90")
    flags = []
    for arch in filter(None, (a.strip() for a in archs.replace(",", ";").split(";"))):
        if not arch.isdigit():
            sys.exit(f"prime: PRIME_CUDA_ARCHS entry {arch!r} is not a compute capability like 90")
        flags.append(f"-gencode=arch=compute_{arch},code=sm_{arch}")
    return flags


def _announce(line):
    print(line, file=sys.stderr)
    os.makedirs(os.path.dirname(DECISION_FILE), exist_ok=True)
    with open(DECISION_FILE, "w") as f:
        f.write(line + "\n")


cuda_home, why_not = find_cuda_toolkit()
if cuda_home:
    # torch's build helpers read CUDA_HOME when torch.utils.cpp_extension is first imported,
    # and otherwise guess it from the nvcc on PATH: set it before that import.
    os.environ["CUDA_HOME"] = cuda_home
from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension  # noqa: E402

# -ffp-contract=off: the wire format forbids fused multiply-add (every backend must
# produce the same bits), and GCC contracts a*b+c by default when FMA is available.
# -g0: setuptools compiles with Python's own CFLAGS, which ask for debug info (-g); for the files that
# include torch's headers that info costs about a third of the build (ops.cpp: 89 s with it, 57 s without,
# on 2 cores), and nobody steps through torch's headers in this extension.
cxx_flags = ["-O3", "-g0", "-std=c++17", "-ffp-contract=off", "-fopenmp", "-Wall", "-Wno-unused-function"]
sources = _sources("csrc/**/*.cpp")

if cuda_home:
    # --fmad=false: same reason as -ffp-contract=off above.
    arch_flags = _cuda_arch_flags()
    nvcc_flags = ["-O3", "--fmad=false", "-std=c++17", "--expt-relaxed-constexpr"] + arch_flags
    _announce(f"prime: building with the CUDA codec kernels (CUDA_HOME={cuda_home}, torch CUDA {torch.version.cuda}, "
              f"{' '.join(f.split(',code=')[1] for f in arch_flags)})")
    ext = CUDAExtension(
        "prime._C",
        sources + _sources("csrc/**/*.cu"),
        define_macros=[("PRIME_WITH_CUDA", "1")],
        extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags},
        extra_link_args=["-fopenmp", "-ldl"],  # -ldl: the ring dlopens libcrypto (glibc < 2.34)
    )
else:
    _announce(f"prime: building without the CUDA codec kernels: {why_not}.")
    ext = CppExtension(
        "prime._C",
        sources,
        extra_compile_args={"cxx": cxx_flags},
        extra_link_args=["-fopenmp", "-ldl"],  # -ldl: the ring dlopens libcrypto (glibc < 2.34)
    )


class BuildExt(BuildExtension.with_options(use_ninja=True)):
    """torch's build_ext; editable builds keep their object files where the others do.

    setuptools' PEP 660 editable build compiles in a fresh temporary directory each time.
    Pointing it at the directory of `setup.py build_ext` and of `pip install .`
    (build/temp.<platform>-<python>) lets ninja recompile only the sources that changed,
    whichever of the three built last.
    """

    def finalize_options(self):
        super().finalize_options()
        if getattr(self, "editable_mode", False):
            plat = f"{sysconfig.get_platform()}-{sys.implementation.cache_tag}"
            self.build_temp = os.path.join(HERE, "build", f"temp.{plat}")


setup(
    # `prime` on the package index is another project; the import name stays `prime`.
    name="prime-diloco",
    version="0.1.0",
    description="DiLoCo training over the internet: an int8 ring all-reduce over TCP and the training loop around it",
    # kernels/ (the Triton codec) is reached as prime.kernels through the link prime/kernels
    packages=find_packages(include=["prime", "prime.*"]),
    python_requires=">=3.10",
    # torch is not pinned here: any torch >= 2.6 already installed is kept (the extension is
    # built against it). matplotlib only draws the loss plots and is optional.
    install_requires=["torch>=2.6", "numpy", "tomli; python_version < '3.11'"],
    extras_require={"plot": ["matplotlib"], "tokenize": ["tokenizers", "pyarrow"],
                    "track": ["tensorboard", "wandb"],
                    "test": ["pytest", "matplotlib", "tokenizers", "pyarrow", "tensorboard", "wandb"],
                    "triton": ["triton"]},
    ext_modules=[ext],
    cmdclass={"build_ext": BuildExt},
    entry_points={
        "console_scripts": [
            "prime-train=prime.train:main",
            "prime-simulate=prime.simulate:main",
            "prime-tokenize=prime.tokenize:main",
        ]
    },
    zip_safe=False,
)
