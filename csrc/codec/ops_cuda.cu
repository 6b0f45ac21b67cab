// CUDA implementations of the prime::* codec ops, int8 and fp4 (schemas in
// csrc/ops.cpp); the kernels are in codec_cuda.cu. setup.py compiles this file only in CUDA builds.
// Same argument checks and messages as the CPU ops (checks.h). No host sync:
// everything is enqueued on the current stream.
#include <c10/cuda/CUDAStream.h>  // (not ATen/cuda/CUDAContext.h: it needs the cuBLAS/cuSPARSE headers)
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>
#include <torch/types.h>

#include "checks.h"
#include "codec.h"
#include "codec_cuda.h"

namespace prime::codec {
namespace {

InputType output_type(at::ScalarType dtype) {
  check_output_dtype(dtype);
  return dtype == at::kFloat ? InputType::kFloat32 : dtype == at::kBFloat16 ? InputType::kBFloat16
                                                                            : InputType::kFloat16;
}

void check_on_cuda(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), name, " is on ", t.device(), " but the other arguments are on a CUDA device");
}

std::tuple<at::Tensor, at::Tensor> quantize_int8_cuda(const at::Tensor& x, int64_t block_size,
                                                       std::optional<int64_t> seed) {
  check_block_size(block_size);
  const InputType type = input_type(x);
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor xc = x.contiguous();  // row-major order; a copy only when x is strided
  const int64_t n = xc.numel();
  at::Tensor q = at::empty({n}, x.options().dtype(at::kChar));
  at::Tensor scales = at::empty({num_blocks(n, block_size)}, x.options().dtype(at::kFloat));
  cuda::quantize(xc.data_ptr(), type, n, block_size, q.data_ptr<int8_t>(), scales.data_ptr<float>(), seed_of(seed),
                 c10::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {q, scales};
}

at::Tensor dequantize_int8_cuda(const at::Tensor& q, const at::Tensor& scales, int64_t block_size,
                                at::ScalarType dtype) {
  check_encoded(q, scales, block_size);
  const InputType out = output_type(dtype);
  check_on_cuda(q, "q");
  const c10::cuda::CUDAGuard guard(q.device());
  const at::Tensor qc = q.contiguous();
  const at::Tensor sc = scales.contiguous();
  at::Tensor y = at::empty({qc.numel()}, q.options().dtype(dtype));
  cuda::dequantize(qc.data_ptr<int8_t>(), sc.data_ptr<float>(), qc.numel(), block_size, y.data_ptr(), out,
                   c10::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return y;
}

void dequantize_add_int8_cuda(at::Tensor& acc, const at::Tensor& q, const at::Tensor& scales, int64_t block_size) {
  check_encoded(q, scales, block_size);
  check_accumulator(acc, q);
  check_on_cuda(q, "q");
  const c10::cuda::CUDAGuard guard(q.device());
  const at::Tensor qc = q.contiguous();
  const at::Tensor sc = scales.contiguous();
  cuda::dequantize_add(acc.data_ptr<float>(), qc.data_ptr<int8_t>(), sc.data_ptr<float>(), qc.numel(), block_size,
                       c10::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

std::tuple<at::Tensor, at::Tensor> quantize_fp4_cuda(const at::Tensor& x, int64_t block_size,
                                                      std::optional<int64_t> seed) {
  check_block_size(block_size);
  const InputType type = input_type(x, "quantize_fp4");
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor xc = x.contiguous();
  const int64_t n = xc.numel();
  at::Tensor q = at::empty({fp4_bytes(n)}, x.options().dtype(at::kByte));
  at::Tensor scales = at::empty({num_blocks(n, block_size)}, x.options().dtype(at::kFloat));
  cuda::quantize_fp4(xc.data_ptr(), type, n, block_size, q.data_ptr<uint8_t>(), scales.data_ptr<float>(),
                     seed_of(seed), c10::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {q, scales};
}

at::Tensor dequantize_fp4_cuda(const at::Tensor& q, const at::Tensor& scales, int64_t numel, int64_t block_size,
                               at::ScalarType dtype) {
  check_encoded_fp4(q, scales, numel, block_size);
  const InputType out = output_type(dtype);
  check_on_cuda(q, "q");
  const c10::cuda::CUDAGuard guard(q.device());
  const at::Tensor qc = q.contiguous();
  const at::Tensor sc = scales.contiguous();
  at::Tensor y = at::empty({numel}, q.options().dtype(dtype));
  cuda::dequantize_fp4(qc.data_ptr<uint8_t>(), sc.data_ptr<float>(), numel, block_size, y.data_ptr(), out,
                       c10::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return y;
}

void dequantize_add_fp4_cuda(at::Tensor& acc, const at::Tensor& q, const at::Tensor& scales, int64_t block_size) {
  check_fp4_accumulation(acc, q, scales, block_size);
  check_on_cuda(q, "q");
  const c10::cuda::CUDAGuard guard(q.device());
  const at::Tensor qc = q.contiguous();
  const at::Tensor sc = scales.contiguous();
  cuda::dequantize_add_fp4(acc.data_ptr<float>(), qc.data_ptr<uint8_t>(), sc.data_ptr<float>(), acc.numel(),
                           block_size, c10::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

TORCH_LIBRARY_IMPL(prime, CUDA, m) {
  m.impl("quantize_int8", &quantize_int8_cuda);
  m.impl("dequantize_int8", &dequantize_int8_cuda);
  m.impl("dequantize_add_int8_", &dequantize_add_int8_cuda);
  m.impl("quantize_fp4", &quantize_fp4_cuda);
  m.impl("dequantize_fp4", &dequantize_fp4_cuda);
  m.impl("dequantize_add_fp4_", &dequantize_add_fp4_cuda);
}

}  // namespace prime::codec
