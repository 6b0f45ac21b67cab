// The block codecs (int8, fp4) on raw CUDA device memory (docs/wire-format.md). Depends
// only on the CUDA runtime: the torch ops (ops_cuda.cu) wrap it, and it can be
// compile-checked without torch (tools/check_cuda_compile.sh).
//
// Every launcher enqueues its kernels on `stream` and returns at once: no host
// synchronization, no allocation. They return cudaGetLastError() after the
// launches. Pointers are device pointers; 16-byte aligned pointers take the
// vector-load path, others a slower element-wise path with the same results.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <optional>

#include "codec.h"

namespace prime::codec::cuda {

// q[0, n) and scales[0, ceil(n/block)) from x[0, n) of `type`. Blocks with NaN or
// Inf get the canonical NaN scale (0x7fc00000) and zero q. Unlike the CPU
// version it cannot return the count of such blocks without a host sync: read
// the scales instead.
cudaError_t quantize(const void* x, InputType type, int64_t n, int64_t block, int8_t* q, float* scales,
                     std::optional<uint32_t> seed, cudaStream_t stream);

// y[i] = float(q[i]) * scale, rounded to `out_type` (y holds n elements of it).
cudaError_t dequantize(const int8_t* q, const float* scales, int64_t n, int64_t block, void* y, InputType out_type,
                       cudaStream_t stream);

// acc[i] = acc[i] + float(q[i]) * scale (multiply, then add: never fused).
cudaError_t dequantize_add(float* acc, const int8_t* q, const float* scales, int64_t n, int64_t block,
                           cudaStream_t stream);

// fp4 (q: fp4_bytes(n) bytes, two codes each, value 2j in the low nibble of byte j):
// each is its int8 namesake above for this format. 16-byte aligned pointers take the
// vector path.
cudaError_t quantize_fp4(const void* x, InputType type, int64_t n, int64_t block, uint8_t* q, float* scales,
                         std::optional<uint32_t> seed, cudaStream_t stream);
cudaError_t dequantize_fp4(const uint8_t* q, const float* scales, int64_t n, int64_t block, void* y,
                           InputType out_type, cudaStream_t stream);
cudaError_t dequantize_add_fp4(float* acc, const uint8_t* q, const float* scales, int64_t n, int64_t block,
                               cudaStream_t stream);

}  // namespace prime::codec::cuda
