// The sparse top-k format (sparse.h; docs/wire-format-sparse.md) on CUDA tensors: the torch ops
// prime::sparse_encode, sparse_decode and sparse_decode_add_ for the CUDA dispatch key, with the
// bytes and values of the CPU kernels (sparse_cpu.cpp) bit for bit. setup.py compiles this file
// only in CUDA builds.
//
// Encode: one warp per chunk, the chunk's values read twice from global memory:
//  1. A bound. Each lane keeps G running maxima of its own values (lane l, slot j holds the values
//     i with i % 32 = l and (i / 32) % G = j): 32 G >= k groups that hold values, so the smallest
//     of their maxima, L, has at least k values at or above it and the k-th largest is >= L.
//  2. The candidates. The values above L, and of those equal to L the lowest positions, are
//     written to shared memory in position order (ballots): about 7% of a chunk of student-t
//     values at k / C = 1/64, at most `cap`. When more than cap values exceed L (a chunk whose
//     large values sit in few groups), L becomes the k-th largest itself, searched bit by bit
//     over the whole chunk (rare).
//  3. The selection on the candidates only: the k-th largest bit by bit from the top (warp-wide
//     counts), stopping early once a count equals keep; the kept values in position order; the
//     upper half of the kept the same way. The float64 means are the format's ordered sums, one
//     lane adding left to right, as the CPU does.
//  4. The record: lo and hi, the positions' bit stream and the codes, a byte per lane.
// Decode: one warp per record. decode_add_ checks every record (ascending positions inside the
// chunk) in a first kernel and adds in a second, which writes nothing when the first found a
// fault; the op then raises, the accumulator as it was.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>
#include <torch/types.h>

#include <algorithm>
#include <cstdint>

#include "checks.h"
#include "sparse.h"

namespace prime::codec::sparse {
namespace {

constexpr int32_t kAbs = 0x7fffffff;
constexpr int32_t kInf = 0x7f800000;
constexpr unsigned kAll = 0xffffffffu;
constexpr int kMaxWarps = 4;        // warps per block, each a chunk at a time
constexpr int kCandidatesPerKept = 8;  // cap = min(chunk, the power of two >= 8 k)

__device__ __forceinline__ int warp_sum(int v) {
#if __CUDA_ARCH__ >= 800
  return __reduce_add_sync(kAll, v);
#else
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kAll, v, o);
  return v;
#endif
}
__device__ __forceinline__ int32_t warp_max(int32_t v) {
#if __CUDA_ARCH__ >= 800
  return __reduce_max_sync(kAll, v);
#else
  for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(kAll, v, o));
  return v;
#endif
}
__device__ __forceinline__ int32_t warp_min(int32_t v) {
#if __CUDA_ARCH__ >= 800
  return __reduce_min_sync(kAll, v);
#else
  for (int o = 16; o > 0; o >>= 1) v = min(v, __shfl_xor_sync(kAll, v, o));
  return v;
#endif
}

// sparse.h's chunk_keep, on the device: the values kept of a chunk of len values.
__device__ __forceinline__ int keep_of(int len, int chunk, int k) {
  return static_cast<int>((int64_t(len) * k + chunk - 1) / chunk);
}

__host__ __device__ constexpr size_t align16(size_t b) { return (b + 15) & ~size_t{15}; }

// A warp's shared memory: the candidates (fp32 bits, positions), the kept (fp32 bits, positions,
// codes; the codes first hold the upper-half flags), and the split between the levels.
struct WarpScratch {
  uint32_t* cand_bits;
  uint16_t* cand_pos;
  uint32_t* kept_bits;
  uint16_t* kept_pos;
  uint8_t* kept_code;
  double* mid;
};

__host__ __device__ constexpr size_t warp_scratch_bytes(int cap, int k) {
  return align16(size_t(cap) * 4) + align16(size_t(cap) * 2) + align16(size_t(k) * 4) + align16(size_t(k) * 2) +
         align16(size_t(k)) + 16;
}

__device__ WarpScratch scratch_at(unsigned char* p, int cap, int k) {
  WarpScratch s;
  s.cand_bits = reinterpret_cast<uint32_t*>(p);
  p += align16(size_t(cap) * 4);
  s.cand_pos = reinterpret_cast<uint16_t*>(p);
  p += align16(size_t(cap) * 2);
  s.kept_bits = reinterpret_cast<uint32_t*>(p);
  p += align16(size_t(k) * 4);
  s.kept_pos = reinterpret_cast<uint16_t*>(p);
  p += align16(size_t(k) * 2);
  s.kept_code = p;
  p += align16(size_t(k));
  s.mid = reinterpret_cast<double*>(p);
  return s;
}

__device__ __forceinline__ int32_t magnitude(uint32_t bits) { return static_cast<int32_t>(bits & kAbs); }

// Step 1: {L, the largest magnitude} of the chunk's len values (L = 0, no bound, when fewer than keep
// groups hold values).
template <int G>
__device__ int2 bound(const float* __restrict__ xc, int len, int keep, int lane) {
  int32_t gm[G];
#pragma unroll
  for (int j = 0; j < G; ++j) gm[j] = -1;
#pragma unroll 4
  for (int base = 0; base < len; base += 32 * G) {
#pragma unroll
    for (int j = 0; j < G; ++j) {
      const int i = base + j * 32 + lane;
      gm[j] = max(gm[j], i < len ? magnitude(__float_as_uint(xc[i])) : -1);
    }
  }
  int32_t hi = -1, low = kAbs;
  int groups = 0;
#pragma unroll
  for (int j = 0; j < G; ++j) {
    hi = max(hi, gm[j]);
    if (gm[j] >= 0) {
      low = min(low, gm[j]);
      ++groups;
    }
  }
  hi = warp_max(hi);
  low = warp_min(low);
  return make_int2(warp_sum(groups) >= keep ? low : 0, hi);
}

// Step 2: writes to the candidates, in position order, the values above low and the first `room`
// equal to low, those that fall in the first cap slots; returns {how many above, how many equal}.
__device__ int2 compact(const float* __restrict__ xc, int len, int32_t low, int room, int cap, WarpScratch s,
                        int lane) {
  const unsigned before = (1u << lane) - 1;
  int above = 0, equal = 0;
#pragma unroll 4
  for (int base = 0; base < len; base += 32) {
    const int i = base + lane;
    const uint32_t bits = i < len ? __float_as_uint(xc[i]) : 0u;
    const int32_t m = i < len ? magnitude(bits) : -1;
    const unsigned gt = __ballot_sync(kAll, m > low), eq = __ballot_sync(kAll, m == low);
    const int g = above + __popc(gt & before), q = equal + __popc(eq & before);
    const int slot = g + min(q, room);
    if ((m > low || (m == low && q < room)) && slot < cap) {
      s.cand_bits[slot] = bits;
      s.cand_pos[slot] = static_cast<uint16_t>(i);
    }
    above += __popc(gt);
    equal += __popc(eq);
  }
  return make_int2(above, equal);
}

// A threshold t of the keep largest magnitudes of load(0 .. count): the keep-th largest, or one with
// exactly keep magnitudes >= t (the same selection, found earlier). lo is a bound with c_lo >= keep
// magnitudes at or above it, hi the largest magnitude: the bits those decide cost no count.
template <class Load>
__device__ int32_t kth_largest(Load load, int count, int keep, int32_t lo, int c_lo, int32_t hi, int lane) {
  if (c_lo == keep) return lo;
  int32_t t = 0;
  for (int b = 30; b >= 0; --b) {
    const int32_t cand = t | (1 << b);
    if (cand <= lo) {
      t = cand;
      continue;
    }
    if (cand > hi) continue;
    int local = 0;
    for (int i = lane; i < count; i += 32) local += magnitude(load(i)) >= cand;
    const int total = warp_sum(local);
    if (total >= keep) {
      t = cand;
      if (total == keep) break;
    }
  }
  return t;
}

// Calls take(index, slot) for the keep values of load(0 .. count) ranked highest by (magnitude desc,
// index asc), t from kth_largest; slots follow indices.
template <class Load, class Take>
__device__ void top(Load load, int count, int keep, int32_t t, int lane, Take take) {
  const unsigned before = (1u << lane) - 1;
  int local = 0;
  for (int i = lane; i < count; i += 32) local += magnitude(load(i)) > t;
  const int ties = keep - warp_sum(local);
  int taken = 0, equal = 0;
  for (int base = 0; base < count; base += 32) {
    const int i = base + lane;
    const int32_t m = i < count ? magnitude(load(i)) : -1;
    const unsigned eq = __ballot_sync(kAll, m == t);
    const bool in = m > t || (m == t && equal + __popc(eq & before) < ties);
    const unsigned ins = __ballot_sync(kAll, in);
    if (in) take(i, taken + __popc(ins & before));
    taken += __popc(ins);
    equal += __popc(eq);
  }
}

__device__ __forceinline__ uint32_t bf16_of_mean(double m) {  // to fp32, then to bf16, each to nearest even
  const uint32_t b = __float_as_uint(static_cast<float>(m));
  return (b + 0x7fffu + ((b >> 16) & 1u)) >> 16;
}

template <int G>
__global__ void __launch_bounds__(kMaxWarps * 32)
    encode_kernel(const float* __restrict__ x, int64_t n, int chunk, int k, int bits, int64_t record, int cap,
                  int64_t chunks, uint8_t* __restrict__ out, int* __restrict__ status) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const WarpScratch s = scratch_at(smem + warp * warp_scratch_bytes(cap, k), cap, k);
  for (int64_t c = int64_t(blockIdx.x) * warps + warp; c < chunks; c += int64_t(gridDim.x) * warps) {
    const float* xc = x + c * chunk;
    const int len = static_cast<int>(min(int64_t(chunk), n - c * chunk));
    const int keep = keep_of(len, chunk, k);
    const int2 b = bound<G>(xc, len, keep, lane);
    int32_t low = b.x;
    const int32_t hi = b.y;
    int2 n_at = compact(xc, len, low, cap, cap, s, lane);
    if (n_at.x > cap) {
      low = kth_largest([&](int i) { return __float_as_uint(xc[i]); }, len, keep, low, n_at.x + n_at.y, hi, lane);
      n_at = compact(xc, len, low, cap, cap, s, lane);
    }
    if (n_at.x + n_at.y > cap) compact(xc, len, low, cap - n_at.x, cap, s, lane);  // ties at L take what is left
    const int count = n_at.x + min(n_at.y, cap - n_at.x);
    __syncwarp();

    auto cand = [&](int i) { return s.cand_bits[i]; };
    top(cand, count, keep, kth_largest(cand, count, keep, low, count, hi, lane), lane, [&](int i, int slot) {
      s.kept_bits[slot] = s.cand_bits[i];
      s.kept_pos[slot] = s.cand_pos[i];
    });
    __syncwarp();
    auto kept = [&](int i) { return s.kept_bits[i]; };
    int32_t smallest = kAbs;
    for (int j = lane; j < keep; j += 32) smallest = min(smallest, magnitude(s.kept_bits[j]));
    smallest = warp_min(smallest);
    const int upper = (keep + 1) / 2;
    for (int j = lane; j < keep; j += 32) s.kept_code[j] = 0;
    __syncwarp();
    top(kept, keep, upper, kth_largest(kept, keep, upper, smallest, keep, hi, lane), lane,
        [&](int i, int) { s.kept_code[i] = 1; });
    __syncwarp();

    uint8_t* rec = out + c * record;
    if (lane == 0) {  // the format's float64 sums, left to right
      double s_hi = 0, s_lo = 0;
      for (int j = 0; j < keep; ++j) {
        const double v = static_cast<double>(__uint_as_float(s.kept_bits[j] & kAbs));
        if (s.kept_code[j]) {
          s_hi += v;
        } else {
          s_lo += v;
        }
      }
      const double c_hi = s_hi / static_cast<double>(upper);
      const double c_lo = keep > upper ? s_lo / static_cast<double>(keep - upper) : c_hi;
      const double mid = (c_lo + c_hi) / 2;
      double sum_hi = 0, sum_lo = 0;
      int n_hi = 0;
      for (int j = 0; j < keep; ++j) {
        const double v = static_cast<double>(__uint_as_float(s.kept_bits[j] & kAbs));
        if (v >= mid) {
          sum_hi += v;
          ++n_hi;
        } else {
          sum_lo += v;
        }
      }
      const uint32_t h = bf16_of_mean(sum_hi / static_cast<double>(n_hi));
      const uint32_t l = keep > n_hi ? bf16_of_mean(sum_lo / static_cast<double>(keep - n_hi)) : h;
      *s.mid = mid;
      rec[0] = static_cast<uint8_t>(l);
      rec[1] = static_cast<uint8_t>(l >> 8);
      rec[2] = static_cast<uint8_t>(h);
      rec[3] = static_cast<uint8_t>(h >> 8);
      status[c] = hi >= kInf ? int(EncodeStatus::kNonFinite)
                             : (h & 0x7fffu) >= 0x7f80u ? int(EncodeStatus::kOverflow) : int(EncodeStatus::kOk);
    }
    __syncwarp();
    const double mid = *s.mid;
    for (int j = lane; j < keep; j += 32) {
      const uint32_t v = s.kept_bits[j];
      const unsigned level = static_cast<double>(__uint_as_float(v & kAbs)) >= mid;
      const unsigned negative = __uint_as_float(v) < 0.f;  // -0 codes as positive
      s.kept_code[j] = static_cast<uint8_t>(level | (negative << 1));
    }
    __syncwarp();
    const int pbytes = (keep * bits + 7) / 8;
    for (int q = lane; q < pbytes; q += 32) {  // byte q: bits [8q, 8q + 8) of the positions' stream
      uint32_t byte = 0;
      for (int j = q * 8 / bits; j < keep && j * bits < q * 8 + 8; ++j) {
        const int shift = j * bits - q * 8;
        const uint32_t p = s.kept_pos[j];
        byte |= (shift >= 0 ? p << shift : p >> -shift) & 0xffu;
      }
      rec[4 + q] = static_cast<uint8_t>(byte);
    }
    for (int q = lane; q < (keep + 3) / 4; q += 32) {  // byte q: the codes of kept values 4q .. 4q + 3
      uint32_t byte = 0;
      for (int t = 0; t < 4 && 4 * q + t < keep; ++t) byte |= uint32_t(s.kept_code[4 * q + t]) << (2 * t);
      rec[4 + pbytes + q] = static_cast<uint8_t>(byte);
    }
    __syncwarp();  // the scratch is the next chunk's
  }
}

enum class Decode { kCheck, kAdd, kWrite };

__device__ __forceinline__ int position_at(const uint8_t* rec, int j, int bits, int pbytes) {
  const int bit = j * bits, byte = bit >> 3;
  uint32_t w = 0;
  for (int t = 0; t < 3 && byte + t < pbytes; ++t) w |= uint32_t(rec[4 + byte + t]) << (8 * t);
  return static_cast<int>((w >> (bit & 7)) & ((1u << bits) - 1));
}

// kCheck: *bad = 1 when a record's positions do not ascend inside its chunk. kAdd: y += the values
// (nothing when *bad). kWrite: y = the values, 0 elsewhere, and the check.
template <Decode kMode>
__global__ void decode_kernel(const uint8_t* __restrict__ payload, int64_t n, int chunk, int k, int bits,
                              int64_t record, int64_t chunks, float* __restrict__ y, int* __restrict__ bad) {
  if (kMode == Decode::kAdd && *bad) return;
  const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  for (int64_t c = int64_t(blockIdx.x) * warps + (threadIdx.x >> 5); c < chunks; c += int64_t(gridDim.x) * warps) {
    const int len = static_cast<int>(min(int64_t(chunk), n - c * chunk));
    const int keep = keep_of(len, chunk, k);
    const int pbytes = (keep * bits + 7) / 8;
    const uint8_t* rec = payload + c * record;
    float* yc = y + c * chunk;
    if (kMode == Decode::kWrite) {
      for (int i = lane; i < len; i += 32) yc[i] = 0.f;
      __syncwarp();
    }
    const float lo = __uint_as_float(uint32_t(rec[0] | (rec[1] << 8)) << 16);
    const float hi = __uint_as_float(uint32_t(rec[2] | (rec[3] << 8)) << 16);
    bool fault = false;
    for (int j = lane; j < keep; j += 32) {
      const int p = position_at(rec, j, bits, pbytes);
      if (kMode != Decode::kAdd) fault |= p >= len || (j > 0 && p <= position_at(rec, j - 1, bits, pbytes));
      if (kMode != Decode::kCheck && p < len) {
        const unsigned code = (rec[4 + pbytes + j / 4] >> (2 * (j % 4))) & 3u;
        const float mag = (code & 1u) ? hi : lo;
        const float v = (code & 2u) ? -mag : mag;
        yc[p] = kMode == Decode::kAdd ? yc[p] + v : v;
      }
    }
    if (kMode != Decode::kAdd && fault) atomicOr(bad, 1);
  }
}

unsigned grid_for(int64_t chunks, int warps) {  // blocks take chunks in turn past 2^20 blocks
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>((chunks + warps - 1) / warps, int64_t{1} << 20)));
}

at::Tensor sparse_encode_cuda(const at::Tensor& x, int64_t chunk, int64_t k) {
  check_sparse_settings(chunk, k);
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 1, "sparse encode takes a flat float32 tensor, got ",
              x.scalar_type(), " of ", num(x.dim()), " dimensions");
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor xc = x.contiguous();
  const int64_t n = xc.numel(), chunks = (n + chunk - 1) / chunk;
  at::Tensor out = at::empty({payload_bytes(n, chunk, k)}, x.options().dtype(at::kByte));
  if (chunks == 0) return out;
  at::Tensor status = at::empty({chunks}, x.options().dtype(at::kInt));
  int64_t cap = 1;
  while (cap < kCandidatesPerKept * k) cap <<= 1;
  cap = std::min(cap, chunk);
  const size_t per_warp = warp_scratch_bytes(static_cast<int>(cap), static_cast<int>(k));
  int optin = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, x.device().index()));
  const int warps = static_cast<int>(std::min<int64_t>(kMaxWarps, int64_t(optin) / int64_t(per_warp)));
  TORCH_CHECK(warps >= 1, "sparse encode: k = ", num(k), " needs more shared memory than this GPU has");
  const size_t smem = per_warp * warps;
  const int bits = position_bits(chunk);
  const int64_t record = record_bytes(k, bits);
  const auto stream = c10::cuda::getCurrentCUDAStream();
  auto launch = [&](auto kernel) {
    if (smem > 48 * 1024) {
      C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    }
    kernel<<<grid_for(chunks, warps), warps * 32, smem, stream>>>(xc.data_ptr<float>(), n, int(chunk), int(k), bits,
                                                                  record, int(cap), chunks, out.data_ptr<uint8_t>(),
                                                                  status.data_ptr<int>());
  };
  if (k <= 32) {
    launch(encode_kernel<1>);
  } else if (k <= 64) {
    launch(encode_kernel<2>);
  } else if (k <= 128) {
    launch(encode_kernel<4>);
  } else {
    launch(encode_kernel<8>);  // k > 256: fewer groups than k, no bound (then cap = chunk)
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const int worst = status.max().item<int>();
  TORCH_CHECK(worst != int(EncodeStatus::kNonFinite), "sparse encode: the tensor holds non-finite values");
  TORCH_CHECK(worst != int(EncodeStatus::kOverflow), "sparse encode: a chunk's magnitude overflows bf16");
  return out;
}

template <Decode kMode>
void launch_decode(const at::Tensor& payload, int64_t n, int64_t chunk, int64_t k, float* y, int* bad) {
  const int64_t chunks = (n + chunk - 1) / chunk;
  if (chunks == 0) return;
  const int bits = position_bits(chunk);
  decode_kernel<kMode><<<grid_for(chunks, 4), 128, 0, c10::cuda::getCurrentCUDAStream()>>>(
      payload.data_ptr<uint8_t>(), n, int(chunk), int(k), bits, record_bytes(k, bits), chunks, y, bad);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

constexpr const char* kMalformed = "sparse decode: the positions of a chunk are not ascending inside it";

at::Tensor sparse_decode_cuda(const at::Tensor& payload, int64_t numel, int64_t chunk, int64_t k) {
  check_sparse_payload_size(payload, numel, chunk, k);
  const c10::cuda::CUDAGuard guard(payload.device());
  const at::Tensor p = payload.contiguous();
  at::Tensor y = at::empty({numel}, payload.options().dtype(at::kFloat));
  at::Tensor bad = at::zeros({1}, payload.options().dtype(at::kInt));
  launch_decode<Decode::kWrite>(p, numel, chunk, k, y.data_ptr<float>(), bad.data_ptr<int>());
  TORCH_CHECK(bad.item<int>() == 0, kMalformed);
  return y;
}

void sparse_decode_add_cuda(at::Tensor& acc, const at::Tensor& payload, int64_t chunk, int64_t k) {
  TORCH_CHECK(acc.scalar_type() == at::kFloat && acc.is_contiguous(),
              "the accumulator must be a contiguous float32 tensor (it is updated in place), got ", acc.scalar_type());
  TORCH_CHECK(acc.device() == payload.device(), "the accumulator is on ", acc.device(), " but the payload is on ",
              payload.device(), "; move them to one device");
  check_sparse_payload_size(payload, acc.numel(), chunk, k);
  const c10::cuda::CUDAGuard guard(acc.device());
  const at::Tensor p = payload.contiguous();
  at::Tensor bad = at::zeros({1}, payload.options().dtype(at::kInt));
  launch_decode<Decode::kCheck>(p, acc.numel(), chunk, k, acc.data_ptr<float>(), bad.data_ptr<int>());
  launch_decode<Decode::kAdd>(p, acc.numel(), chunk, k, acc.data_ptr<float>(), bad.data_ptr<int>());
  TORCH_CHECK(bad.item<int>() == 0, kMalformed);
}

}  // namespace
}  // namespace prime::codec::sparse

TORCH_LIBRARY_IMPL(prime, CUDA, m) {
  m.impl("sparse_encode", &prime::codec::sparse::sparse_encode_cuda);
  m.impl("sparse_decode", &prime::codec::sparse::sparse_decode_cuda);
  m.impl("sparse_decode_add_", &prime::codec::sparse::sparse_decode_add_cuda);
}
