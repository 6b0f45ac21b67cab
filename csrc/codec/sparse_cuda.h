// The sparse top-k format (sparse.h; docs/wire-format-sparse.md) on raw CUDA device memory, for the
// ring's GPU wire codec (csrc/ring/wire_codec_cuda.cu). The torch ops of sparse_cuda.cu wrap the
// same launchers, so the ring's bytes are the ops' bytes (and the CPU kernels', bit for bit).
//
// Every launcher enqueues its kernels on `stream` and returns cudaGetLastError() after the
// launches: no host synchronization, no allocation.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace prime::codec::sparse::cuda {

// out[0, payload_bytes(n, chunk, k)) = the records of x[0, n) (fp32, device). *status becomes the
// largest EncodeStatus of any chunk (atomicMax: zero it first; chunks that are not kOk leave their
// records undefined). blocks_per_sm: 0 for the default. Throws std::invalid_argument when k needs
// more shared memory than the current device has.
cudaError_t encode(const float* x, int64_t n, int64_t chunk, int64_t k, uint8_t* out, int* status,
                   int64_t blocks_per_sm, cudaStream_t stream);

// kCheck: *bad = 1 when a record is malformed (sparse.h's well_formed), y untouched.
// kAdd: y += the values, nothing when *bad is set (after a kCheck of the same payload).
// kWrite: y = the values (0 elsewhere) and the check.
// kSubtract: y -= the values, unchecked: for payloads this process encoded (bad unused).
enum class DecodeMode { kCheck, kAdd, kWrite, kSubtract };
cudaError_t decode(DecodeMode mode, const uint8_t* payload, int64_t n, int64_t chunk, int64_t k, float* y, int* bad,
                   cudaStream_t stream);

// The owner's side of a selected average: dec holds decode(encode(avg)). With `keep`,
// dec[i] = (avg[i] - dec[i]) * divisor (what the selection dropped, in the contributions' units);
// with sums, sums[0] += the sum of (dec[i] - avg[i])^2 and sums[1] += the sum of avg[i]^2 in
// float64 (before dec is overwritten; the order of the additions is not fixed).
cudaError_t owner_dropped(const float* avg, float* dec, int64_t n, float divisor, bool keep, double* sums,
                          cudaStream_t stream);

}  // namespace prime::codec::sparse::cuda
