// CPU implementations of the prime::* codec ops (schemas in csrc/ops.cpp), and
// private ops that name the instruction set, so tests can hold every kernel
// variant this CPU runs against the reference. One body per op serves both
// formats: the overloads below pick the int8 (int8_t codes) or fp4 (uint8_t) kernels.
#include <torch/library.h>
#include <ATen/ops/empty.h>

#include <string>
#include <type_traits>
#include <vector>

#include "checks.h"
#include "codec.h"
#include "sparse.h"

namespace prime::codec {
namespace {

InputType output_type(at::ScalarType dtype) {
  check_output_dtype(dtype);
  return dtype == at::kFloat ? InputType::kFloat32 : dtype == at::kBFloat16 ? InputType::kBFloat16
                                                                            : InputType::kFloat16;
}

Isa parse_isa(const std::string& name) {
  for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512}) {
    if (name == isa_name(isa)) {
      TORCH_CHECK(isa_supported(isa), "this CPU cannot run the ", name, " codec kernels");
      return isa;
    }
  }
  TORCH_CHECK(false, "unknown instruction set '", name, "'; expected scalar, avx2 or avx512");
  return Isa::kScalar;
}

// ---- the kernels of one format; `isa` unset: the best ones for this CPU ----

int64_t encode(std::optional<Isa> isa, const void* x, InputType type, int64_t n, int64_t block, int8_t* q,
               float* scales, std::optional<uint32_t> seed) {
  return isa ? quantize(*isa, x, type, n, block, q, scales, seed) : quantize(x, type, n, block, q, scales, seed);
}
int64_t encode(std::optional<Isa> isa, const void* x, InputType type, int64_t n, int64_t block, uint8_t* q,
               float* scales, std::optional<uint32_t> seed) {
  return isa ? quantize_fp4(*isa, x, type, n, block, q, scales, seed)
             : quantize_fp4(x, type, n, block, q, scales, seed);
}
void decode(std::optional<Isa> isa, const int8_t* q, const float* scales, int64_t n, int64_t block, void* y,
            InputType out) {
  isa ? dequantize_as(*isa, q, scales, n, block, y, out) : dequantize_as(q, scales, n, block, y, out);
}
void decode(std::optional<Isa> isa, const uint8_t* q, const float* scales, int64_t n, int64_t block, void* y,
            InputType out) {
  isa ? dequantize_fp4_as(*isa, q, scales, n, block, y, out) : dequantize_fp4_as(q, scales, n, block, y, out);
}
void decode_add(std::optional<Isa> isa, float* acc, const int8_t* q, const float* scales, int64_t n, int64_t block) {
  isa ? dequantize_add(*isa, acc, q, scales, n, block) : dequantize_add(acc, q, scales, n, block);
}
void decode_add(std::optional<Isa> isa, float* acc, const uint8_t* q, const float* scales, int64_t n,
                int64_t block) {
  isa ? dequantize_add_fp4(*isa, acc, q, scales, n, block) : dequantize_add_fp4(acc, q, scales, n, block);
}

template <class Code>
constexpr bool kFp4 = std::is_same_v<Code, uint8_t>;

template <class Code>
std::tuple<at::Tensor, at::Tensor> quantize_impl(const at::Tensor& x, int64_t block_size, std::optional<int64_t> seed,
                                                 std::optional<Isa> isa) {
  check_block_size(block_size);
  const InputType type = input_type(x, kFp4<Code> ? "quantize_fp4" : "quantize_int8");
  const at::Tensor xc = x.contiguous();  // row-major order; a copy only when x is strided
  const int64_t n = xc.numel();
  at::Tensor q = at::empty({kFp4<Code> ? fp4_bytes(n) : n}, x.options().dtype(kFp4<Code> ? at::kByte : at::kChar));
  at::Tensor scales = at::empty({num_blocks(n, block_size)}, x.options().dtype(at::kFloat));
  encode(isa, xc.data_ptr(), type, n, block_size, q.data_ptr<Code>(), scales.data_ptr<float>(), seed_of(seed));
  return {q, scales};
}

// n: the values q encodes.
template <class Code>
at::Tensor dequantize_impl(const at::Tensor& q, const at::Tensor& scales, int64_t n, int64_t block_size,
                           at::ScalarType dtype, std::optional<Isa> isa) {
  const InputType out = output_type(dtype);
  const at::Tensor qc = q.contiguous();
  const at::Tensor sc = scales.contiguous();
  at::Tensor y = at::empty({n}, q.options().dtype(dtype));
  decode(isa, qc.data_ptr<Code>(), sc.data_ptr<float>(), n, block_size, y.data_ptr(), out);
  return y;
}

template <class Code>
void dequantize_add_impl(at::Tensor& acc, const at::Tensor& q, const at::Tensor& scales, int64_t block_size,
                         std::optional<Isa> isa) {
  const at::Tensor qc = q.contiguous();
  const at::Tensor sc = scales.contiguous();
  decode_add(isa, acc.data_ptr<float>(), qc.data_ptr<Code>(), sc.data_ptr<float>(), acc.numel(), block_size);
}

// ---- the ops: checks, then the kernels ----

std::tuple<at::Tensor, at::Tensor> quantize_int8_cpu(const at::Tensor& x, int64_t block_size,
                                                      std::optional<int64_t> seed) {
  return quantize_impl<int8_t>(x, block_size, seed, std::nullopt);
}

at::Tensor dequantize_int8_for(const at::Tensor& q, const at::Tensor& scales, int64_t block_size,
                               at::ScalarType dtype, std::optional<Isa> isa) {
  check_encoded(q, scales, block_size);
  return dequantize_impl<int8_t>(q, scales, q.numel(), block_size, dtype, isa);
}

void dequantize_add_int8_for(at::Tensor& acc, const at::Tensor& q, const at::Tensor& scales, int64_t block_size,
                             std::optional<Isa> isa) {
  check_encoded(q, scales, block_size);
  check_accumulator(acc, q);
  dequantize_add_impl<int8_t>(acc, q, scales, block_size, isa);
}

std::tuple<at::Tensor, at::Tensor> quantize_fp4_cpu(const at::Tensor& x, int64_t block_size,
                                                     std::optional<int64_t> seed) {
  return quantize_impl<uint8_t>(x, block_size, seed, std::nullopt);
}

at::Tensor dequantize_fp4_for(const at::Tensor& q, const at::Tensor& scales, int64_t numel, int64_t block_size,
                              at::ScalarType dtype, std::optional<Isa> isa) {
  check_encoded_fp4(q, scales, numel, block_size);
  return dequantize_impl<uint8_t>(q, scales, numel, block_size, dtype, isa);
}

void dequantize_add_fp4_for(at::Tensor& acc, const at::Tensor& q, const at::Tensor& scales, int64_t block_size,
                            std::optional<Isa> isa) {
  check_fp4_accumulation(acc, q, scales, block_size);
  dequantize_add_impl<uint8_t>(acc, q, scales, block_size, isa);
}

// The round-trip error sums the ring reports (codec.h quantize_error_sq): [err, ref].
template <class Code>
std::vector<double> error_sums(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales, int64_t block_size,
                               Isa isa) {
  const InputType type = input_type(x);
  const at::Tensor xc = x.contiguous(), qc = q.contiguous(), sc = scales.contiguous();
  double err = 0, ref = 0;
  if constexpr (kFp4<Code>) {
    quantize_error_sq_fp4(isa, xc.data_ptr(), type, qc.data_ptr<uint8_t>(), sc.data_ptr<float>(), xc.numel(),
                          block_size, &err, &ref);
  } else {
    quantize_error_sq(isa, xc.data_ptr(), type, qc.data_ptr<int8_t>(), sc.data_ptr<float>(), xc.numel(), block_size,
                      &err, &ref);
  }
  return {err, ref};
}

std::vector<std::string> cpu_codec_isas() {
  std::vector<std::string> out;
  for (Isa isa : {Isa::kAvx512, Isa::kAvx2, Isa::kScalar}) {
    if (isa_supported(isa)) out.emplace_back(isa_name(isa));
  }
  return out;
}

// ---- the sparse top-k codec (sparse.h) ----

void check_sparse_payload(const at::Tensor& payload, int64_t numel, int64_t chunk, int64_t k) {
  check_sparse_payload_size(payload, numel, chunk, k);
  TORCH_CHECK(payload.is_contiguous(), "sparse decode: the payload must be contiguous");
  TORCH_CHECK(sparse::well_formed(payload.data_ptr<uint8_t>(), numel, chunk, k),
              "sparse decode: the positions of a chunk are not ascending inside it");
}

at::Tensor sparse_encode_cpu(const at::Tensor& x, int64_t chunk, int64_t k) {
  check_sparse_settings(chunk, k);
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 1, "sparse encode takes a flat float32 tensor, got ",
              x.scalar_type(), " of ", num(x.dim()), " dimensions");
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty({sparse::payload_bytes(xc.numel(), chunk, k)}, x.options().dtype(at::kByte));
  const sparse::EncodeStatus s = sparse::encode(xc.data_ptr<float>(), xc.numel(), chunk, k, out.data_ptr<uint8_t>());
  TORCH_CHECK(s != sparse::EncodeStatus::kNonFinite, "sparse encode: the tensor holds non-finite values");
  TORCH_CHECK(s != sparse::EncodeStatus::kOverflow, "sparse encode: a chunk's magnitude overflows bf16");
  return out;
}

at::Tensor sparse_decode_cpu(const at::Tensor& payload, int64_t numel, int64_t chunk, int64_t k) {
  check_sparse_payload(payload, numel, chunk, k);
  at::Tensor y = at::empty({numel}, payload.options().dtype(at::kFloat));
  sparse::decode(payload.data_ptr<uint8_t>(), numel, chunk, k, y.data_ptr<float>());
  return y;
}

void sparse_decode_add_cpu(at::Tensor& acc, const at::Tensor& payload, int64_t chunk, int64_t k) {
  check_sparse_accumulator(acc, payload);
  check_sparse_payload(payload, acc.numel(), chunk, k);
  sparse::decode_add(payload.data_ptr<uint8_t>(), acc.numel(), chunk, k, acc.data_ptr<float>());
}

}  // namespace

TORCH_LIBRARY_IMPL(prime, CPU, m) {
  m.impl("quantize_int8", &quantize_int8_cpu);
  m.impl("sparse_encode", &sparse_encode_cpu);
  m.impl("sparse_decode", &sparse_decode_cpu);
  m.impl("sparse_decode_add_", &sparse_decode_add_cpu);
  m.impl("dequantize_int8", [](const at::Tensor& q, const at::Tensor& scales, int64_t block_size,
                               at::ScalarType dtype) { return dequantize_int8_for(q, scales, block_size, dtype, {}); });
  m.impl("dequantize_add_int8_", [](at::Tensor& acc, const at::Tensor& q, const at::Tensor& scales,
                                    int64_t block_size) { dequantize_add_int8_for(acc, q, scales, block_size, {}); });
  m.impl("quantize_fp4", &quantize_fp4_cpu);
  m.impl("dequantize_fp4", [](const at::Tensor& q, const at::Tensor& scales, int64_t numel, int64_t block_size,
                              at::ScalarType dtype) {
    return dequantize_fp4_for(q, scales, numel, block_size, dtype, {});
  });
  m.impl("dequantize_add_fp4_", [](at::Tensor& acc, const at::Tensor& q, const at::Tensor& scales,
                                   int64_t block_size) { dequantize_add_fp4_for(acc, q, scales, block_size, {}); });
}

// Private, for tests and benchmarks: the CPU kernels of one named instruction set.
TORCH_LIBRARY_FRAGMENT(prime, m) {
  m.def("_cpu_codec_isas() -> str[]", &cpu_codec_isas);  // supported here, widest first
  m.def("_cpu_codec_plan() -> str", &cpu_kernel_plan);  // the kernels the public ops use, in words
  m.def("_quantize_int8_isa(Tensor x, int block_size, int? seed, str isa) -> (Tensor q, Tensor scales)");
  m.def("_dequantize_int8_isa(Tensor q, Tensor scales, int block_size, ScalarType dtype, str isa) -> Tensor");
  m.def("_dequantize_add_int8_isa_(Tensor(a!) acc, Tensor q, Tensor scales, int block_size, str isa) -> ()");
  m.def("_quantize_fp4_isa(Tensor x, int block_size, int? seed, str isa) -> (Tensor q, Tensor scales)");
  m.def("_dequantize_fp4_isa(Tensor q, Tensor scales, int numel, int block_size, ScalarType dtype, str isa) -> Tensor");
  m.def("_dequantize_add_fp4_isa_(Tensor(a!) acc, Tensor q, Tensor scales, int block_size, str isa) -> ()");
  // The round-trip error sums the ring reports (codec.h quantize_error_sq): [err, ref].
  m.def("_quantize_error_sq_isa(Tensor x, Tensor q, Tensor scales, int block_size, str isa) -> float[]");
  m.def("_quantize_error_sq_fp4_isa(Tensor x, Tensor q, Tensor scales, int block_size, str isa) -> float[]");
}

TORCH_LIBRARY_IMPL(prime, CPU, m) {
  m.impl("_quantize_int8_isa", [](const at::Tensor& x, int64_t block_size, std::optional<int64_t> seed,
                                  const std::string& isa) { return quantize_impl<int8_t>(x, block_size, seed, parse_isa(isa)); });
  m.impl("_dequantize_int8_isa", [](const at::Tensor& q, const at::Tensor& scales, int64_t block_size,
                                    at::ScalarType dtype, const std::string& isa) {
    return dequantize_int8_for(q, scales, block_size, dtype, parse_isa(isa));
  });
  m.impl("_dequantize_add_int8_isa_", [](at::Tensor& acc, const at::Tensor& q, const at::Tensor& scales,
                                         int64_t block_size, const std::string& isa) {
    dequantize_add_int8_for(acc, q, scales, block_size, parse_isa(isa));
  });
  m.impl("_quantize_fp4_isa", [](const at::Tensor& x, int64_t block_size, std::optional<int64_t> seed,
                                 const std::string& isa) {
    return quantize_impl<uint8_t>(x, block_size, seed, parse_isa(isa));
  });
  m.impl("_dequantize_fp4_isa", [](const at::Tensor& q, const at::Tensor& scales, int64_t numel, int64_t block_size,
                                   at::ScalarType dtype, const std::string& isa) {
    return dequantize_fp4_for(q, scales, numel, block_size, dtype, parse_isa(isa));
  });
  m.impl("_dequantize_add_fp4_isa_", [](at::Tensor& acc, const at::Tensor& q, const at::Tensor& scales,
                                        int64_t block_size, const std::string& isa) {
    dequantize_add_fp4_for(acc, q, scales, block_size, parse_isa(isa));
  });
  m.impl("_quantize_error_sq_isa", [](const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales,
                                      int64_t block_size, const std::string& isa) {
    check_encoded(q, scales, block_size);
    TORCH_CHECK(x.numel() == q.numel(), "x and q differ in length");
    return error_sums<int8_t>(x, q, scales, block_size, parse_isa(isa));
  });
  m.impl("_quantize_error_sq_fp4_isa", [](const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales,
                                          int64_t block_size, const std::string& isa) {
    check_encoded_fp4(q, scales, x.numel(), block_size);
    return error_sums<uint8_t>(x, q, scales, block_size, parse_isa(isa));
  });
}

}  // namespace prime::codec
