// CPU implementation of the block codecs (docs/wire-format.md): picks the
// block kernels of the best instruction set the CPU has (cpu_scalar.cpp,
// cpu_avx2.cpp, cpu_avx512.cpp; all give the same bits) and spreads whole
// blocks over threads with at::parallel_for.
#include "codec.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <string>

#include "cpu_kernels.h"

namespace prime::codec {
namespace {

cpu::Kernels kernels_for(Isa isa) {
  TORCH_CHECK(isa_supported(isa), "the CPU codec kernels for ", isa_name(isa), " do not run on this CPU");
  switch (isa) {
#if PRIME_CODEC_X86
    case Isa::kAvx512:
      return cpu::avx512_kernels();
    case Isa::kAvx2:
      return cpu::avx2_kernels();
#endif
    default:
      return cpu::scalar_kernels();
  }
}

// Round-to-nearest quantize on AVX2, everything else on AVX-512, when the CPU
// has both. Measured on the 2-core Xeon of the CI machine, one thread, 64 MiB,
// GB/s (AVX-512 vs AVX2): round-to-nearest quantize fp32 B=256 12.0 vs 13.9,
// bf16 13.4 vs 14.5, B=32 9.9 vs 10.1, B=4096 12.0 vs 12.8; stochastic quantize
// 8.5 vs 7.1; dequantize-add 23.4 vs 21.1. (Packing 64 values per 512-bit store
// instead of 16 made the AVX-512 quantize slower still.)
int64_t quantize_mixed(const void* x, InputType type, int64_t n, int64_t block, int8_t* q, float* scales,
                       bool stochastic, uint32_t seed, int64_t first_index) {
  static const cpu::Kernels nearest = kernels_for(Isa::kAvx2), stochastic_rounding = kernels_for(Isa::kAvx512);
  return (stochastic ? stochastic_rounding : nearest)
      .quantize(x, type, n, block, q, scales, stochastic, seed, first_index);
}

bool mixed() { return best_isa() == Isa::kAvx512 && isa_supported(Isa::kAvx2); }

const cpu::Kernels& best_kernels() {
  static const cpu::Kernels kernels = [] {
    cpu::Kernels k = kernels_for(best_isa());
    if (mixed()) k.quantize = &quantize_mixed;
    return k;
  }();
  return kernels;
}

// Work per task: 64 Ki elements (256 KiB of fp32) amortizes waking a thread
// (a few microseconds) while a 1 MiB tensor still splits across 4 threads.
constexpr int64_t kGrainElements = int64_t{1} << 16;

// Calls f(first_element, element_count, first_block) on block-aligned ranges
// that cover [0, n), in parallel. at::parallel_for runs OpenMP threads (this
// file is compiled with -fopenmp) and runs inline when already inside a
// parallel region or when the range is below one grain.
template <class F>
void for_block_ranges(int64_t n, int64_t block, const F& f) {
  const int64_t grain = std::max<int64_t>(1, kGrainElements / block);
  at::parallel_for(0, num_blocks(n, block), grain, [&](int64_t b0, int64_t b1) {
    const int64_t start = b0 * block;
    f(start, std::min(b1 * block, n) - start, b0);
  });
}

int64_t element_size(InputType type) { return type == InputType::kFloat32 ? 4 : 2; }

// The codes of element `start` (a block boundary, so even): one byte a value for int8,
// two values a byte for fp4.
int8_t* codes_at(int8_t* q, int64_t start) { return q + start; }
const int8_t* codes_at(const int8_t* q, int64_t start) { return q + start; }
uint8_t* codes_at(uint8_t* q, int64_t start) { return q + start / 2; }
const uint8_t* codes_at(const uint8_t* q, int64_t start) { return q + start / 2; }

// Each runs a kernel of one format (Kernels::quantize or quantize_fp4, ...) over a whole buffer.
template <class Code, class Kernel>
int64_t quantize_with(Kernel kernel, const void* x, InputType type, int64_t n, int64_t block, Code* q, float* scales,
                      std::optional<uint32_t> seed) {
  std::atomic<int64_t> bad{0};
  const int64_t esize = element_size(type);
  for_block_ranges(n, block, [&](int64_t start, int64_t len, int64_t b0) {
    const void* xs = static_cast<const char*>(x) + start * esize;
    bad += kernel(xs, type, len, block, codes_at(q, start), scales + b0, seed.has_value(), seed.value_or(0), start);
  });
  return bad.load();
}

template <class Code, class Kernel>
void dequantize_with(Kernel kernel, const Code* q, const float* scales, int64_t n, int64_t block, void* y,
                     InputType out_type) {
  const int64_t esize = element_size(out_type);
  for_block_ranges(n, block, [&](int64_t start, int64_t len, int64_t b0) {
    kernel(codes_at(q, start), scales + b0, len, block, static_cast<char*>(y) + start * esize, out_type);
  });
}

template <class Code, class Kernel>
void dequantize_add_with(Kernel kernel, float* acc, const Code* q, const float* scales, int64_t n, int64_t block) {
  for_block_ranges(n, block, [&](int64_t start, int64_t len, int64_t b0) {
    kernel(acc + start, codes_at(q, start), scales + b0, len, block);
  });
}

template <class Code, class Kernel>
void error_with(Kernel kernel, const void* x, InputType type, const Code* q, const float* scales, int64_t n,
                int64_t block, double* err, double* ref) {
  const int64_t esize = element_size(type);
  std::mutex mu;
  for_block_ranges(n, block, [&](int64_t start, int64_t len, int64_t b0) {
    double e = 0, r = 0;
    kernel(static_cast<const char*>(x) + start * esize, type, codes_at(q, start), scales + b0, len, block, &e, &r);
    std::lock_guard<std::mutex> lock(mu);
    *err += e;
    *ref += r;
  });
}

using ErrorKernel = void (*)(const void*, InputType, const int8_t*, const float*, int64_t, int64_t, double*, double*);
using Fp4ErrorKernel = void (*)(const void*, InputType, const uint8_t*, const float*, int64_t, int64_t, double*,
                                double*);

// The float64 error pass is arithmetic-bound: the widest vectors win.
ErrorKernel error_kernel(Isa isa) {
  TORCH_CHECK(isa_supported(isa), "the CPU codec kernels for ", isa_name(isa), " do not run on this CPU");
#if PRIME_CODEC_X86
  if (isa == Isa::kAvx512) return &cpu::quantize_error_sq_avx512;
  if (isa == Isa::kAvx2) return &cpu::quantize_error_sq_avx2;
#endif
  return &cpu::quantize_error_sq_scalar;
}

Fp4ErrorKernel fp4_error_kernel(Isa isa) {
  TORCH_CHECK(isa_supported(isa), "the CPU codec kernels for ", isa_name(isa), " do not run on this CPU");
#if PRIME_CODEC_X86
  if (isa == Isa::kAvx512) return &cpu::quantize_error_sq_fp4_avx512;
  if (isa == Isa::kAvx2) return &cpu::quantize_error_sq_fp4_avx2;
#endif
  return &cpu::quantize_error_sq_fp4_scalar;
}

}  // namespace

// ---- instruction sets ----

bool isa_supported(Isa isa) {
  switch (isa) {
    case Isa::kScalar:
      return true;
#if PRIME_CODEC_X86
    case Isa::kAvx2:
      __builtin_cpu_init();
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
    case Isa::kAvx512:
      __builtin_cpu_init();
      return __builtin_cpu_supports("avx512f");
#endif
    default:
      return false;
  }
}

Isa best_isa() {
  // AVX-512 first (best_kernels still runs round-to-nearest quantize on AVX2).
  static const Isa best = isa_supported(Isa::kAvx512) ? Isa::kAvx512
                          : isa_supported(Isa::kAvx2) ? Isa::kAvx2
                                                      : Isa::kScalar;
  return best;
}

std::string cpu_kernel_plan() {
  if (mixed()) return "avx2 for round-to-nearest quantize, avx512 for the rest";
  return isa_name(best_isa());
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kScalar:
      return "scalar";
    case Isa::kAvx2:
      return "avx2";
    case Isa::kAvx512:
      return "avx512";
  }
  return "unknown";
}

// ---- single-threaded ranges (the ring calls these from its own threads) ----

int64_t quantize_range(const void* x, InputType type, int64_t n, int64_t block, int8_t* q, float* scales,
                       std::optional<uint32_t> seed, int64_t first_index) {
  return best_kernels().quantize(x, type, n, block, q, scales, seed.has_value(), seed.value_or(0), first_index);
}

void dequantize_range(const int8_t* q, const float* scales, int64_t n, int64_t block, float* y) {
  best_kernels().dequantize(q, scales, n, block, y, InputType::kFloat32);
}

void dequantize_add_range(float* acc, const int8_t* q, const float* scales, int64_t n, int64_t block) {
  best_kernels().dequantize_add(acc, q, scales, n, block);
}

int64_t quantize_fp4_range(const void* x, InputType type, int64_t n, int64_t block, uint8_t* q, float* scales,
                           std::optional<uint32_t> seed, int64_t first_index) {
  return best_kernels().quantize_fp4(x, type, n, block, q, scales, seed.has_value(), seed.value_or(0), first_index);
}

// ---- multithreaded whole buffers ----

int64_t quantize(const void* x, InputType type, int64_t n, int64_t block, int8_t* q, float* scales,
                 std::optional<uint32_t> seed) {
  return quantize_with(best_kernels().quantize, x, type, n, block, q, scales, seed);
}

void dequantize(const int8_t* q, const float* scales, int64_t n, int64_t block, float* y) {
  dequantize_with(best_kernels().dequantize, q, scales, n, block, y, InputType::kFloat32);
}

void dequantize_as(const int8_t* q, const float* scales, int64_t n, int64_t block, void* y, InputType out_type) {
  dequantize_with(best_kernels().dequantize, q, scales, n, block, y, out_type);
}

void dequantize_add(float* acc, const int8_t* q, const float* scales, int64_t n, int64_t block) {
  dequantize_add_with(best_kernels().dequantize_add, acc, q, scales, n, block);
}

void quantize_error_sq(const void* x, InputType type, const int8_t* q, const float* scales, int64_t n, int64_t block,
                       double* err, double* ref) {
  error_with(error_kernel(best_isa()), x, type, q, scales, n, block, err, ref);
}

int64_t quantize_fp4(const void* x, InputType type, int64_t n, int64_t block, uint8_t* q, float* scales,
                     std::optional<uint32_t> seed) {
  return quantize_with(best_kernels().quantize_fp4, x, type, n, block, q, scales, seed);
}

void dequantize_fp4_as(const uint8_t* q, const float* scales, int64_t n, int64_t block, void* y, InputType out_type) {
  dequantize_with(best_kernels().dequantize_fp4, q, scales, n, block, y, out_type);
}

void dequantize_add_fp4(float* acc, const uint8_t* q, const float* scales, int64_t n, int64_t block) {
  dequantize_add_with(best_kernels().dequantize_add_fp4, acc, q, scales, n, block);
}

void quantize_error_sq_fp4(const void* x, InputType type, const uint8_t* q, const float* scales, int64_t n,
                           int64_t block, double* err, double* ref) {
  error_with(fp4_error_kernel(best_isa()), x, type, q, scales, n, block, err, ref);
}

// ---- one named instruction set (tests, benchmarks) ----

int64_t quantize(Isa isa, const void* x, InputType type, int64_t n, int64_t block, int8_t* q, float* scales,
                 std::optional<uint32_t> seed) {
  return quantize_with(kernels_for(isa).quantize, x, type, n, block, q, scales, seed);
}

void dequantize_as(Isa isa, const int8_t* q, const float* scales, int64_t n, int64_t block, void* y,
                   InputType out_type) {
  dequantize_with(kernels_for(isa).dequantize, q, scales, n, block, y, out_type);
}

void dequantize_add(Isa isa, float* acc, const int8_t* q, const float* scales, int64_t n, int64_t block) {
  dequantize_add_with(kernels_for(isa).dequantize_add, acc, q, scales, n, block);
}

void quantize_error_sq(Isa isa, const void* x, InputType type, const int8_t* q, const float* scales, int64_t n,
                       int64_t block, double* err, double* ref) {
  error_with(error_kernel(isa), x, type, q, scales, n, block, err, ref);
}

int64_t quantize_fp4(Isa isa, const void* x, InputType type, int64_t n, int64_t block, uint8_t* q, float* scales,
                     std::optional<uint32_t> seed) {
  return quantize_with(kernels_for(isa).quantize_fp4, x, type, n, block, q, scales, seed);
}

void dequantize_fp4_as(Isa isa, const uint8_t* q, const float* scales, int64_t n, int64_t block, void* y,
                       InputType out_type) {
  dequantize_with(kernels_for(isa).dequantize_fp4, q, scales, n, block, y, out_type);
}

void dequantize_add_fp4(Isa isa, float* acc, const uint8_t* q, const float* scales, int64_t n, int64_t block) {
  dequantize_add_with(kernels_for(isa).dequantize_add_fp4, acc, q, scales, n, block);
}

void quantize_error_sq_fp4(Isa isa, const void* x, InputType type, const uint8_t* q, const float* scales, int64_t n,
                           int64_t block, double* err, double* ref) {
  error_with(fp4_error_kernel(isa), x, type, q, scales, n, block, err, ref);
}

}  // namespace prime::codec
