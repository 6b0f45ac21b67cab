"""Triton versions of the codec ops (installed as prime.kernels), bit-identical to the C++ ones."""
