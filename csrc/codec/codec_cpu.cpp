// CPU implementation of the int8 block codec (docs/wire-format.md): picks the
// block kernels of the best instruction set the CPU has (cpu_scalar.cpp,
// cpu_avx2.cpp, cpu_avx512.cpp; all give the same bits) and spreads whole
// blocks over threads with at::parallel_for.
#include "codec.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>

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

const cpu::Kernels& best_kernels() {
  static const cpu::Kernels kernels = kernels_for(best_isa());
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

int64_t quantize_with(const cpu::Kernels& k, const void* x, InputType type, int64_t n, int64_t block, int8_t* q,
                      float* scales, std::optional<uint32_t> seed) {
  std::atomic<int64_t> bad{0};
  const int64_t esize = element_size(type);
  for_block_ranges(n, block, [&](int64_t start, int64_t len, int64_t b0) {
    const void* xs = static_cast<const char*>(x) + start * esize;
    bad += k.quantize(xs, type, len, block, q + start, scales + b0, seed.has_value(), seed.value_or(0), start);
  });
  return bad.load();
}

void dequantize_with(const cpu::Kernels& k, const int8_t* q, const float* scales, int64_t n, int64_t block,
                     void* y, InputType out_type) {
  const int64_t esize = element_size(out_type);
  for_block_ranges(n, block, [&](int64_t start, int64_t len, int64_t b0) {
    k.dequantize(q + start, scales + b0, len, block, static_cast<char*>(y) + start * esize, out_type);
  });
}

void dequantize_add_with(const cpu::Kernels& k, float* acc, const int8_t* q, const float* scales, int64_t n,
                         int64_t block) {
  for_block_ranges(n, block, [&](int64_t start, int64_t len, int64_t b0) {
    k.dequantize_add(acc + start, q + start, scales + b0, len, block);
  });
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
  // AVX-512 first: measured faster than AVX2 on this codec (benchmarks/RESULTS.md).
  static const Isa best = isa_supported(Isa::kAvx512) ? Isa::kAvx512
                          : isa_supported(Isa::kAvx2) ? Isa::kAvx2
                                                      : Isa::kScalar;
  return best;
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

// ---- multithreaded whole buffers ----

int64_t quantize(const void* x, InputType type, int64_t n, int64_t block, int8_t* q, float* scales,
                 std::optional<uint32_t> seed) {
  return quantize_with(best_kernels(), x, type, n, block, q, scales, seed);
}

void dequantize(const int8_t* q, const float* scales, int64_t n, int64_t block, float* y) {
  dequantize_with(best_kernels(), q, scales, n, block, y, InputType::kFloat32);
}

void dequantize_as(const int8_t* q, const float* scales, int64_t n, int64_t block, void* y, InputType out_type) {
  dequantize_with(best_kernels(), q, scales, n, block, y, out_type);
}

void dequantize_add(float* acc, const int8_t* q, const float* scales, int64_t n, int64_t block) {
  dequantize_add_with(best_kernels(), acc, q, scales, n, block);
}

int64_t quantize(Isa isa, const void* x, InputType type, int64_t n, int64_t block, int8_t* q, float* scales,
                 std::optional<uint32_t> seed) {
  return quantize_with(kernels_for(isa), x, type, n, block, q, scales, seed);
}

void dequantize_as(Isa isa, const int8_t* q, const float* scales, int64_t n, int64_t block, void* y,
                   InputType out_type) {
  dequantize_with(kernels_for(isa), q, scales, n, block, y, out_type);
}

void dequantize_add(Isa isa, float* acc, const int8_t* q, const float* scales, int64_t n, int64_t block) {
  dequantize_add_with(kernels_for(isa), acc, q, scales, n, block);
}

}  // namespace prime::codec
