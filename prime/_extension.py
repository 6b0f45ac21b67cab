"""Loads the compiled core prime._C once; without it prime runs on the pure-torch fallback."""

from __future__ import annotations

import warnings

import torch  # noqa: F401  (loads libc10 and libtorch, which prime._C links against)

_BUILD_HINT = "Build it with `pip install --no-build-isolation -e .` in the repository (or `make build`)."

try:
    from prime import _C  # noqa: F401  (registers the torch ops prime::*)

    _ERROR = None
except ImportError as e:  # the package is usable without it, slower and without the ring
    _C = None
    _ERROR = e
    warnings.warn(
        f"prime: the compiled extension prime._C is not available ({e}); the codec falls back to "
        f"pure torch and the TCP ring is unavailable. {_BUILD_HINT}",
        RuntimeWarning,
        stacklevel=2,
    )


def available() -> bool:
    return _C is not None


def has_cuda_kernels() -> bool:
    return _C is not None and bool(_C.has_cuda())


def build_hint() -> str:
    if _C is None:
        return f"prime._C failed to import ({_ERROR}). {_BUILD_HINT}"
    return "prime._C was built without CUDA kernels (CPU-only torch, no nvcc, or PRIME_SKIP_CUDA=1)."


def require():
    """Returns prime._C or raises a RuntimeError that says how to build it."""
    if _C is None:
        raise RuntimeError(f"this feature needs the compiled extension prime._C. {build_hint()}")
    return _C
