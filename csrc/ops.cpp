// Op schemas of the prime library and the entry point of the module prime._C.
// Implementations register themselves per dispatch key: codec/ops_cpu.cpp (CPU),
// codec/ops_cuda.cu (CUDA); fake kernels live in prime/_fake.py.
#include <pybind11/pybind11.h>
#include <torch/library.h>

namespace prime {
void init_ring_bindings(pybind11::module_& m);  // ring/bindings.cpp
}

TORCH_LIBRARY(prime, m) {
  m.def("quantize_int8(Tensor x, int block_size, int? seed=None) -> (Tensor q, Tensor scales)");
  m.def("dequantize_int8(Tensor q, Tensor scales, int block_size, ScalarType dtype) -> Tensor");
  m.def("dequantize_add_int8_(Tensor(a!) acc, Tensor q, Tensor scales, int block_size) -> ()");
  m.def("quantize_fp4(Tensor x, int block_size, int? seed=None) -> (Tensor q, Tensor scales)");
  m.def("dequantize_fp4(Tensor q, Tensor scales, int numel, int block_size, ScalarType dtype) -> Tensor");
  m.def("dequantize_add_fp4_(Tensor(a!) acc, Tensor q, Tensor scales, int block_size) -> ()");
  m.def("sparse_encode(Tensor x, int chunk, int k) -> Tensor");
  m.def("sparse_decode(Tensor payload, int numel, int chunk, int k) -> Tensor");
  m.def("sparse_decode_add_(Tensor(a!) acc, Tensor payload, int chunk, int k) -> ()");
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "prime compiled core: int8 and fp4 block codec ops, the sparse top-k codec (torch.ops.prime.*) and the TCP ring";
  m.def("has_cuda", []() {
#ifdef PRIME_WITH_CUDA
    return true;
#else
    return false;
#endif
  });
  prime::init_ring_bindings(m);
}
