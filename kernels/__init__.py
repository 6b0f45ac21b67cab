"""Triton versions of the codec ops (installed as prime.kernels), bit-identical to the C++ ones.

kernels.codec holds the ops and their launchers, kernels._codec_kernels the
@triton.jit kernels; both import triton, so import them only when asked for
(prime.ops does, lazily).
"""
