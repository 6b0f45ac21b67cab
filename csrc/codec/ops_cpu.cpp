// CPU implementations of the prime::* codec ops (schemas in csrc/ops.cpp).
#include <torch/library.h>
#include <torch/types.h>

#include "checks.h"
#include "codec.h"

namespace prime::codec {
namespace {

std::tuple<at::Tensor, at::Tensor> quantize_int8_cpu(const at::Tensor& x, int64_t block_size,
                                                      std::optional<int64_t> seed) {
  check_block_size(block_size);
  const InputType type = input_type(x);
  const at::Tensor xc = x.contiguous();  // row-major order; a copy only when x is strided
  const int64_t n = xc.numel();
  at::Tensor q = at::empty({n}, x.options().dtype(at::kChar));
  at::Tensor scales = at::empty({num_blocks(n, block_size)}, x.options().dtype(at::kFloat));
  quantize(xc.data_ptr(), type, n, block_size, q.data_ptr<int8_t>(), scales.data_ptr<float>(), seed_of(seed));
  return {q, scales};
}

at::Tensor dequantize_int8_cpu(const at::Tensor& q, const at::Tensor& scales, int64_t block_size,
                               at::ScalarType dtype) {
  check_encoded(q, scales, block_size);
  check_output_dtype(dtype);
  const at::Tensor qc = q.contiguous();
  const at::Tensor sc = scales.contiguous();
  at::Tensor y = at::empty({qc.numel()}, q.options().dtype(at::kFloat));
  dequantize(qc.data_ptr<int8_t>(), sc.data_ptr<float>(), qc.numel(), block_size, y.data_ptr<float>());
  return dtype == at::kFloat ? y : y.to(dtype);
}

void dequantize_add_int8_cpu(at::Tensor& acc, const at::Tensor& q, const at::Tensor& scales, int64_t block_size) {
  check_encoded(q, scales, block_size);
  check_accumulator(acc, q);
  const at::Tensor qc = q.contiguous();
  const at::Tensor sc = scales.contiguous();
  dequantize_add(acc.data_ptr<float>(), qc.data_ptr<int8_t>(), sc.data_ptr<float>(), qc.numel(), block_size);
}

}  // namespace

TORCH_LIBRARY_IMPL(prime, CPU, m) {
  m.impl("quantize_int8", &quantize_int8_cpu);
  m.impl("dequantize_int8", &dequantize_int8_cpu);
  m.impl("dequantize_add_int8_", &dequantize_add_int8_cpu);
}

}  // namespace prime::codec
