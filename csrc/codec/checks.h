// Argument checks shared by the CPU and CUDA op implementations, so both give
// the same messages (and the same as prime/ops.py).
#pragma once

#include <torch/types.h>

#include <string>

#include "codec.h"

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

inline InputType input_type(const at::Tensor& x) {
  switch (x.scalar_type()) {
    case at::kFloat:
      return InputType::kFloat32;
    case at::kBFloat16:
      return InputType::kBFloat16;
    case at::kHalf:
      return InputType::kFloat16;
    default:
      TORCH_CHECK(false, "quantize_int8 expects a float32, bfloat16 or float16 tensor, got ", x.scalar_type(),
                  "; convert it first, e.g. x.float()");
  }
  return InputType::kFloat32;
}

inline void check_encoded(const at::Tensor& q, const at::Tensor& scales, int64_t block_size) {
  check_block_size(block_size);
  TORCH_CHECK(q.scalar_type() == at::kChar, "q must be an int8 tensor (from quantize_int8), got ", q.scalar_type());
  TORCH_CHECK(scales.scalar_type() == at::kFloat, "scales must be a float32 tensor (from quantize_int8), got ",
              scales.scalar_type());
  TORCH_CHECK(q.device() == scales.device(), "q is on ", q.device(), " but scales is on ", scales.device(),
              "; move both to one device");
  const int64_t expected = num_blocks(q.numel(), block_size);
  TORCH_CHECK(scales.numel() == expected, "q has ", num(q.numel()), " elements, which at block_size ",
              num(block_size), " needs ", num(expected), " scales, but scales has ", num(scales.numel()),
              "; were they made with another block_size?");
}

inline void check_accumulator(const at::Tensor& acc, const at::Tensor& q) {
  TORCH_CHECK(acc.scalar_type() == at::kFloat, "the accumulator must be float32, got ", acc.scalar_type());
  TORCH_CHECK(acc.device() == q.device(), "the accumulator is on ", acc.device(), " but q is on ", q.device(),
              "; move them to one device");
  TORCH_CHECK(acc.numel() == q.numel(), "the accumulator has ", num(acc.numel()), " elements but q has ",
              num(q.numel()), "; they must match");
  TORCH_CHECK(acc.is_contiguous(), "the accumulator must be contiguous (it is updated in place)");
}

inline void check_output_dtype(at::ScalarType dtype) {
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "dtype must be float32, bfloat16 or float16, got ", dtype);
}

inline std::optional<uint32_t> seed_of(std::optional<int64_t> seed) {
  if (!seed) return std::nullopt;
  return static_cast<uint32_t>(static_cast<uint64_t>(*seed) & 0xffffffffu);
}

}  // namespace prime::codec
