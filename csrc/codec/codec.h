// The int8 block codec on raw CPU memory (docs/wire-format.md). Used by the torch
// ops (ops_cpu.cpp) and directly by the ring, which works on raw buffers.
#pragma once

#include <cstdint>
#include <optional>

namespace prime::codec {

constexpr int kQMax = 127;
constexpr int kMinBlock = 32;
constexpr int kMaxBlock = 4096;

enum class InputType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

inline int64_t num_blocks(int64_t n, int64_t block) { return (n + block - 1) / block; }
inline bool valid_block_size(int64_t b) { return b >= kMinBlock && b <= kMaxBlock && (b & (b - 1)) == 0; }

// Quantizes x[0, n) (of `type`) into q[0, n) and scales[0, ceil(n/block)).
// `first_index` is the flattened index of x[0]: stochastic rounding (seed set)
// keys its generator by it. Returns the number of blocks holding NaN or Inf
// (those get a NaN scale and zero q). Single-threaded: the caller splits work
// at block boundaries.
int64_t quantize_range(const void* x, InputType type, int64_t n, int64_t block, int8_t* q, float* scales,
                       std::optional<uint32_t> seed = std::nullopt, int64_t first_index = 0);

// y[i] = float(q[i]) * scale  (fp32 out).
void dequantize_range(const int8_t* q, const float* scales, int64_t n, int64_t block, float* y);

// acc[i] = acc[i] + float(q[i]) * scale  (multiply, then add: never fused).
void dequantize_add_range(float* acc, const int8_t* q, const float* scales, int64_t n, int64_t block);

// Multithreaded versions over a whole buffer (at::parallel_for, block-aligned grains).
int64_t quantize(const void* x, InputType type, int64_t n, int64_t block, int8_t* q, float* scales,
                 std::optional<uint32_t> seed = std::nullopt);
void dequantize(const int8_t* q, const float* scales, int64_t n, int64_t block, float* y);
void dequantize_add(float* acc, const int8_t* q, const float* scales, int64_t n, int64_t block);

}  // namespace prime::codec
