"""PRIME: DiLoCo training over the internet with an int8 ring all-reduce over TCP."""

from prime import _extension, ops
from prime import _fake  # noqa: F401  (fake kernels so torch.compile and opcheck see the ops)
from prime.ops import dequantize_add_int8_, dequantize_int8, quantize_int8
from prime.comm import backend as _backend  # noqa: F401  (registers the torch.distributed backend "prime")

__version__ = "0.1.0"

__all__ = ["ops", "quantize_int8", "dequantize_int8", "dequantize_add_int8_", "__version__", "DiLoCo",
           "OuterStepResult", "Sync", "SyncResult", "RingSync", "OuterState"]

# name -> module of the lazily imported names
_LAZY = {"DiLoCo": "prime.diloco", "OuterStepResult": "prime.diloco", "Sync": "prime.sync",
         "SyncResult": "prime.sync", "RingSync": "prime.sync", "OuterState": "prime.outer"}


def __getattr__(name):
    # Lazy: `prime.DiLoCo` and `prime.comm` pull in torch.distributed only when used.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    if name == "comm":
        import importlib

        return importlib.import_module("prime.comm")
    raise AttributeError(f"module 'prime' has no attribute {name!r}")
