"""Fake (meta) implementations of the prime::* ops: shapes only, for torch.compile and opcheck."""

import torch

from prime import _extension

if _extension.available():

    @torch.library.register_fake("prime::quantize_int8")
    def _quantize_int8_fake(x, block_size, seed=None):
        n = x.numel()
        nb = (n + block_size - 1) // block_size
        return x.new_empty((n,), dtype=torch.int8), x.new_empty((nb,), dtype=torch.float32)

    @torch.library.register_fake("prime::dequantize_int8")
    def _dequantize_int8_fake(q, scales, block_size, dtype):
        return q.new_empty((q.numel(),), dtype=dtype)

    @torch.library.register_fake("prime::dequantize_add_int8_")
    def _dequantize_add_int8_fake(acc, q, scales, block_size):
        return None

    @torch.library.register_fake("prime::quantize_fp4")
    def _quantize_fp4_fake(x, block_size, seed=None):
        n = x.numel()
        nb = (n + block_size - 1) // block_size
        return x.new_empty(((n + 1) // 2,), dtype=torch.uint8), x.new_empty((nb,), dtype=torch.float32)

    @torch.library.register_fake("prime::dequantize_fp4")
    def _dequantize_fp4_fake(q, scales, numel, block_size, dtype):
        return q.new_empty((numel,), dtype=dtype)

    @torch.library.register_fake("prime::dequantize_add_fp4_")
    def _dequantize_add_fp4_fake(acc, q, scales, block_size):
        return None

    @torch.library.register_fake("prime::sparse_encode")
    def _sparse_encode_fake(x, chunk, k):
        from prime.sparse import payload_bytes

        return x.new_empty((payload_bytes(x.numel(), chunk, k),), dtype=torch.uint8)

    @torch.library.register_fake("prime::sparse_decode")
    def _sparse_decode_fake(payload, numel, chunk, k):
        return payload.new_empty((numel,), dtype=torch.float32)

    @torch.library.register_fake("prime::sparse_decode_add_")
    def _sparse_decode_add_fake(acc, payload, chunk, k):
        return None
