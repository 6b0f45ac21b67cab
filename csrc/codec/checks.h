// Argument checks shared by the CPU and CUDA op implementations, so both give
// the same messages (and the same as prime/ops.py). Both codecs: int8 (q int8, one
// value a byte) and fp4 (q uint8, two values a byte).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <string>

#include "codec.h"
#include "sparse.h"

namespace prime::codec {

// Integers go into messages as std::to_string text, not through the iostream
// that TORCH_CHECK formats with: with torch 2.11 (python 3.12, g++ 13) on the
// GPU machines, formatting an integer there segfaulted while raising, so every
// bad-argument error crashed the process instead of raising.
inline std::string num(int64_t v) { return std::to_string(v); }

inline void check_block_size(int64_t block_size) {
  TORCH_CHECK(valid_block_size(block_size), "block_size must be a power of two from ", num(kMinBlock), " to ",
              num(kMaxBlock), ", got ", num(block_size));
}

inline InputType input_type(const at::Tensor& x, const char* op = "quantize_int8") {
  switch (x.scalar_type()) {
    case at::kFloat:
      return InputType::kFloat32;
    case at::kBFloat16:
      return InputType::kBFloat16;
    case at::kHalf:
      return InputType::kFloat16;
    default:
      TORCH_CHECK(false, op, " expects a float32, bfloat16 or float16 tensor, got ", x.scalar_type(),
                  "; convert it first, e.g. x.float()");
  }
  return InputType::kFloat32;
}

// The scales of n values (q holds their codes; `source` names the op that made them).
inline void check_scales(const at::Tensor& scales, const at::Tensor& q, int64_t n, int64_t block_size,
                         const char* source) {
  TORCH_CHECK(scales.scalar_type() == at::kFloat, "scales must be a float32 tensor (from ", source, "), got ",
              scales.scalar_type());
  TORCH_CHECK(q.device() == scales.device(), "q is on ", q.device(), " but scales is on ", scales.device(),
              "; move both to one device");
  const int64_t expected = num_blocks(n, block_size);
  const bool int8 = q.scalar_type() == at::kChar;
  TORCH_CHECK(scales.numel() == expected, int8 ? "q has " : "the tensor has ", num(n), " elements, which at block_size ",
              num(block_size), " needs ", num(expected), " scales, but scales has ", num(scales.numel()),
              "; were they made with another block_size?");
}

inline void check_encoded(const at::Tensor& q, const at::Tensor& scales, int64_t block_size) {
  check_block_size(block_size);
  TORCH_CHECK(q.scalar_type() == at::kChar, "q must be an int8 tensor (from quantize_int8), got ", q.scalar_type());
  check_scales(scales, q, q.numel(), block_size, "quantize_int8");
}

inline void check_fp4_codes(const at::Tensor& q) {
  TORCH_CHECK(q.scalar_type() == at::kByte, "q must be a uint8 tensor (from quantize_fp4), got ", q.scalar_type());
}

// fp4: q holds the packed codes of numel values (two a byte).
inline void check_encoded_fp4(const at::Tensor& q, const at::Tensor& scales, int64_t numel, int64_t block_size) {
  check_block_size(block_size);
  TORCH_CHECK(numel >= 0, "numel must be a non-negative int, got ", num(numel));
  check_fp4_codes(q);
  TORCH_CHECK(q.numel() == fp4_bytes(numel), "q has ", num(q.numel()), " bytes, but ", num(numel),
              " fp4 values take ", num(fp4_bytes(numel)), " (two per byte); is numel the length of the tensor that "
              "was quantized?");
  check_scales(scales, q, numel, block_size, "quantize_fp4");
}

inline void check_accumulator(const at::Tensor& acc, const at::Tensor& q) {
  TORCH_CHECK(acc.scalar_type() == at::kFloat, "the accumulator must be float32, got ", acc.scalar_type());
  TORCH_CHECK(acc.device() == q.device(), "the accumulator is on ", acc.device(), " but q is on ", q.device(),
              "; move them to one device");
  if (q.scalar_type() == at::kByte) {  // fp4 codes
    TORCH_CHECK(fp4_bytes(acc.numel()) == q.numel(), "the accumulator has ", num(acc.numel()),
                " elements, whose fp4 codes take ", num(fp4_bytes(acc.numel())), " bytes, but q has ", num(q.numel()),
                "; they must match");
  } else {
    TORCH_CHECK(acc.numel() == q.numel(), "the accumulator has ", num(acc.numel()), " elements but q has ",
                num(q.numel()), "; they must match");
  }
  TORCH_CHECK(acc.is_contiguous(), "the accumulator must be contiguous (it is updated in place)");
}

// The argument checks of dequantize_add_fp4_ (the accumulator gives the number of values).
inline void check_fp4_accumulation(const at::Tensor& acc, const at::Tensor& q, const at::Tensor& scales,
                                   int64_t block_size) {
  check_block_size(block_size);
  check_fp4_codes(q);
  check_accumulator(acc, q);
  check_encoded_fp4(q, scales, acc.numel(), block_size);
}

inline void check_output_dtype(at::ScalarType dtype) {
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "dtype must be float32, bfloat16 or float16, got ", dtype);
}

inline std::optional<uint32_t> seed_of(std::optional<int64_t> seed) {
  if (!seed) return std::nullopt;
  return static_cast<uint32_t>(static_cast<uint64_t>(*seed) & 0xffffffffu);
}

// ---- the sparse top-k codec (sparse.h) ----

inline void check_sparse_settings(int64_t chunk, int64_t k) {
  TORCH_CHECK(sparse::valid_chunk(chunk), "sparse chunk must be a power of two from ", num(sparse::kMinChunk), " to ",
              num(sparse::kMaxChunk), ", got ", num(chunk));
  TORCH_CHECK(sparse::valid_keep(chunk, k), "sparse k (values kept per chunk of ", num(chunk), ") must be in [1, ",
              num(chunk), "], got ", num(k));
}

// decode_add_'s accumulator: updated in place, so a contiguous float32 tensor on the payload's device.
inline void check_sparse_accumulator(const at::Tensor& acc, const at::Tensor& payload) {
  TORCH_CHECK(acc.scalar_type() == at::kFloat && acc.is_contiguous(),
              "the accumulator must be a contiguous float32 tensor (it is updated in place), got ", acc.scalar_type());
  TORCH_CHECK(acc.device() == payload.device(), "the accumulator is on ", acc.device(), " but the payload is on ",
              payload.device(), "; move them to one device");
}

// The settings, and a payload's type and size for numel values (not what its records say).
inline void check_sparse_payload_size(const at::Tensor& payload, int64_t numel, int64_t chunk, int64_t k) {
  check_sparse_settings(chunk, k);
  TORCH_CHECK(numel >= 0, "numel must be a non-negative int, got ", num(numel));
  const int64_t want = sparse::payload_bytes(numel, chunk, k);
  TORCH_CHECK(payload.scalar_type() == at::kByte && payload.dim() == 1 && payload.numel() == want,
              "sparse decode: expected ", num(want), " bytes (uint8) for ", num(numel), " values, got ",
              num(payload.numel()), " (", payload.scalar_type(), ")");
}

}  // namespace prime::codec
