// CPU implementations of the prime::* codec ops (schemas in csrc/ops.cpp), and
// three private ops that name the instruction set, so tests can hold every
// kernel variant this CPU runs against the reference.
#include <torch/library.h>
#include <torch/types.h>

#include <string>
#include <vector>

#include "checks.h"
#include "codec.h"

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

// `isa` unset: the best one for this CPU.
std::tuple<at::Tensor, at::Tensor> quantize_impl(const at::Tensor& x, int64_t block_size, std::optional<int64_t> seed,
                                                 std::optional<Isa> isa) {
  check_block_size(block_size);
  const InputType type = input_type(x);
  const at::Tensor xc = x.contiguous();  // row-major order; a copy only when x is strided
  const int64_t n = xc.numel();
  at::Tensor q = at::empty({n}, x.options().dtype(at::kChar));
  at::Tensor scales = at::empty({num_blocks(n, block_size)}, x.options().dtype(at::kFloat));
  if (isa) {
    quantize(*isa, xc.data_ptr(), type, n, block_size, q.data_ptr<int8_t>(), scales.data_ptr<float>(),
             seed_of(seed));
  } else {
    quantize(xc.data_ptr(), type, n, block_size, q.data_ptr<int8_t>(), scales.data_ptr<float>(), seed_of(seed));
  }
  return {q, scales};
}

at::Tensor dequantize_impl(const at::Tensor& q, const at::Tensor& scales, int64_t block_size, at::ScalarType dtype,
                           std::optional<Isa> isa) {
  check_encoded(q, scales, block_size);
  const InputType out = output_type(dtype);
  const at::Tensor qc = q.contiguous();
  const at::Tensor sc = scales.contiguous();
  at::Tensor y = at::empty({qc.numel()}, q.options().dtype(dtype));
  if (isa) {
    dequantize_as(*isa, qc.data_ptr<int8_t>(), sc.data_ptr<float>(), qc.numel(), block_size, y.data_ptr(), out);
  } else {
    dequantize_as(qc.data_ptr<int8_t>(), sc.data_ptr<float>(), qc.numel(), block_size, y.data_ptr(), out);
  }
  return y;
}

void dequantize_add_impl(at::Tensor& acc, const at::Tensor& q, const at::Tensor& scales, int64_t block_size,
                         std::optional<Isa> isa) {
  check_encoded(q, scales, block_size);
  check_accumulator(acc, q);
  const at::Tensor qc = q.contiguous();
  const at::Tensor sc = scales.contiguous();
  if (isa) {
    dequantize_add(*isa, acc.data_ptr<float>(), qc.data_ptr<int8_t>(), sc.data_ptr<float>(), qc.numel(),
                   block_size);
  } else {
    dequantize_add(acc.data_ptr<float>(), qc.data_ptr<int8_t>(), sc.data_ptr<float>(), qc.numel(), block_size);
  }
}

std::tuple<at::Tensor, at::Tensor> quantize_int8_cpu(const at::Tensor& x, int64_t block_size,
                                                      std::optional<int64_t> seed) {
  return quantize_impl(x, block_size, seed, std::nullopt);
}

at::Tensor dequantize_int8_cpu(const at::Tensor& q, const at::Tensor& scales, int64_t block_size,
                               at::ScalarType dtype) {
  return dequantize_impl(q, scales, block_size, dtype, std::nullopt);
}

void dequantize_add_int8_cpu(at::Tensor& acc, const at::Tensor& q, const at::Tensor& scales, int64_t block_size) {
  dequantize_add_impl(acc, q, scales, block_size, std::nullopt);
}

std::vector<std::string> cpu_codec_isas() {
  std::vector<std::string> out;
  for (Isa isa : {Isa::kAvx512, Isa::kAvx2, Isa::kScalar}) {
    if (isa_supported(isa)) out.emplace_back(isa_name(isa));
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(prime, CPU, m) {
  m.impl("quantize_int8", &quantize_int8_cpu);
  m.impl("dequantize_int8", &dequantize_int8_cpu);
  m.impl("dequantize_add_int8_", &dequantize_add_int8_cpu);
}

// Private, for tests and benchmarks: the CPU kernels of one named instruction set.
TORCH_LIBRARY_FRAGMENT(prime, m) {
  m.def("_cpu_codec_isas() -> str[]", &cpu_codec_isas);  // supported here, widest first
  m.def("_cpu_codec_plan() -> str", &cpu_kernel_plan);  // the kernels the public ops use, in words
  m.def("_quantize_int8_isa(Tensor x, int block_size, int? seed, str isa) -> (Tensor q, Tensor scales)");
  m.def("_dequantize_int8_isa(Tensor q, Tensor scales, int block_size, ScalarType dtype, str isa) -> Tensor");
  m.def("_dequantize_add_int8_isa_(Tensor(a!) acc, Tensor q, Tensor scales, int block_size, str isa) -> ()");
  // The int8 round-trip error sums the ring reports (codec.h quantize_error_sq): [err, ref].
  m.def("_quantize_error_sq_isa(Tensor x, Tensor q, Tensor scales, int block_size, str isa) -> float[]");
}

TORCH_LIBRARY_IMPL(prime, CPU, m) {
  m.impl("_quantize_int8_isa", [](const at::Tensor& x, int64_t block_size, std::optional<int64_t> seed,
                                  const std::string& isa) { return quantize_impl(x, block_size, seed, parse_isa(isa)); });
  m.impl("_dequantize_int8_isa", [](const at::Tensor& q, const at::Tensor& scales, int64_t block_size,
                                    at::ScalarType dtype, const std::string& isa) {
    return dequantize_impl(q, scales, block_size, dtype, parse_isa(isa));
  });
  m.impl("_dequantize_add_int8_isa_", [](at::Tensor& acc, const at::Tensor& q, const at::Tensor& scales,
                                         int64_t block_size, const std::string& isa) {
    dequantize_add_impl(acc, q, scales, block_size, parse_isa(isa));
  });
  m.impl("_quantize_error_sq_isa", [](const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales,
                                      int64_t block_size, const std::string& isa) {
    check_encoded(q, scales, block_size);
    const InputType type = input_type(x);
    TORCH_CHECK(x.numel() == q.numel(), "x and q differ in length");
    const at::Tensor xc = x.contiguous(), qc = q.contiguous(), sc = scales.contiguous();
    double err = 0, ref = 0;
    quantize_error_sq(parse_isa(isa), xc.data_ptr(), type, qc.data_ptr<int8_t>(), sc.data_ptr<float>(), xc.numel(),
                      block_size, &err, &ref);
    return std::vector<double>{err, ref};
  });
}

}  // namespace prime::codec
