// The block codecs (int8 and fp4) on raw CPU memory (docs/wire-format.md). Used by the
// torch ops (ops_cpu.cpp) and directly by the ring, which works on raw buffers.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

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

// The int8 round-trip error of x[0, n) (of `type`, widened to fp32 exactly as quantize
// reads it) given what quantize wrote for it (q, scales): adds to *err the sum of
// (double(float(q[i]) * scale) - double(x[i]))^2 and to *ref the sum of double(x[i])^2,
// in float64, over the blocks with a finite scale (a block holding NaN or Inf has no
// error to speak of: the collective that sends it fails anyway). One pass over memory
// that was just quantized; multithreaded like quantize (the order of the float64
// additions across threads may vary: the sums may differ in their last bits).
void quantize_error_sq(const void* x, InputType type, const int8_t* q, const float* scales, int64_t n, int64_t block,
                       double* err, double* ref);

// ---------------------------------------------------------------------------
// Additions: decoding straight into bf16 / fp16, and the choice of instruction set.

// y[i] = float(q[i]) * scale, rounded to `out_type` (nearest even; a NaN scale gives NaN).
// Multithreaded; y holds n elements of out_type.
void dequantize_as(const int8_t* q, const float* scales, int64_t n, int64_t block, void* y, InputType out_type);

// The instruction sets the CPU kernels exist for. All give the same bits; the
// fastest one the CPU supports is picked at run time (the build never uses
// -march=native, so one binary serves every x86-64).
enum class Isa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

bool isa_supported(Isa isa);
Isa best_isa();                 // fastest supported; kScalar off x86-64
const char* isa_name(Isa isa);  // "scalar", "avx2", "avx512"
std::string cpu_kernel_plan();  // which kernels the entry points without an Isa use, in words

// The multithreaded entry points with the instruction set named (tests run every
// supported one against the reference). `isa` must be supported.
int64_t quantize(Isa isa, const void* x, InputType type, int64_t n, int64_t block, int8_t* q, float* scales,
                 std::optional<uint32_t> seed);
void dequantize_as(Isa isa, const int8_t* q, const float* scales, int64_t n, int64_t block, void* y,
                   InputType out_type);
void dequantize_add(Isa isa, float* acc, const int8_t* q, const float* scales, int64_t n, int64_t block);
void quantize_error_sq(Isa isa, const void* x, InputType type, const int8_t* q, const float* scales, int64_t n,
                       int64_t block, double* err, double* ref);

// ---------------------------------------------------------------------------
// fp4 (docs/wire-format.md): 4-bit E2M1 codes, two a byte (value 2j in the low nibble of
// byte j), one fp32 scale a / 6 per block. `q` holds fp4_bytes(n) bytes. Each function
// is its int8 namesake above for this format.

constexpr float kFp4Max = 6.0f;
inline int64_t fp4_bytes(int64_t n) { return (n + 1) / 2; }

int64_t quantize_fp4_range(const void* x, InputType type, int64_t n, int64_t block, uint8_t* q, float* scales,
                           std::optional<uint32_t> seed = std::nullopt, int64_t first_index = 0);
int64_t quantize_fp4(const void* x, InputType type, int64_t n, int64_t block, uint8_t* q, float* scales,
                     std::optional<uint32_t> seed = std::nullopt);
void dequantize_fp4_as(const uint8_t* q, const float* scales, int64_t n, int64_t block, void* y, InputType out_type);
void dequantize_add_fp4(float* acc, const uint8_t* q, const float* scales, int64_t n, int64_t block);
void quantize_error_sq_fp4(const void* x, InputType type, const uint8_t* q, const float* scales, int64_t n,
                           int64_t block, double* err, double* ref);

int64_t quantize_fp4(Isa isa, const void* x, InputType type, int64_t n, int64_t block, uint8_t* q, float* scales,
                     std::optional<uint32_t> seed);
void dequantize_fp4_as(Isa isa, const uint8_t* q, const float* scales, int64_t n, int64_t block, void* y,
                       InputType out_type);
void dequantize_add_fp4(Isa isa, float* acc, const uint8_t* q, const float* scales, int64_t n, int64_t block);
void quantize_error_sq_fp4(Isa isa, const void* x, InputType type, const uint8_t* q, const float* scales, int64_t n,
                           int64_t block, double* err, double* ref);

}  // namespace prime::codec
