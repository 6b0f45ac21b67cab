// The sparse top-k format (sparse.h; docs/wire-format-sparse.md) on CUDA tensors: the torch ops
// prime::sparse_encode, sparse_decode and sparse_decode_add_ for the CUDA dispatch key, with the
// bytes and values of the CPU kernels (sparse_cpu.cpp) bit for bit. setup.py compiles this file
// only in CUDA builds.
//
// Encode: one warp per chunk, the chunk's values read twice from global memory:
//  1. A bound. Each lane keeps G running maxima of its own runs of 4 values (slot j: the runs u of
//     each batch with u % G = j): 32 G >= k groups that hold values, so the smallest of their
//     maxima, L, has at least k values at or above it and the k-th largest is >= L.
//  2. The candidates. The values above L, and of those equal to L the lowest positions, are
//     written to shared memory in position order (one scan of the lanes' counts): about 7% of a
//     chunk of student-t values at k / C = 1/64, at most `cap`. When more than cap values exceed
//     L (a chunk whose large values sit in few groups), L becomes the k-th largest itself,
//     searched bit by bit over the whole chunk (rare).
//  3. The selection on the candidates only: the k-th largest bit by bit from the top (warp-wide
//     counts), stopping early once a count equals keep; the kept values in position order; the
//     upper half of the kept the same way. The float64 means are the format's sums in position
//     order: on every lane where every partial sum is exact (any order gives the same bits),
//     else one lane adding left to right, as the CPU does.
//  4. The record: lo and hi, the positions (upper parts in unary through a bitmap in shared memory, then the
//     lower bits) and the codes, a byte per lane.
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
#include <mutex>
#include <vector>

#include "checks.h"
#include "sparse.h"
#include "sparse_cuda.h"

namespace prime::codec::sparse {
namespace {

constexpr int32_t kAbs = 0x7fffffff;
constexpr int32_t kInf = 0x7f800000;
constexpr unsigned kAll = 0xffffffffu;
constexpr int kMaxWarps = 4;        // warps per block, each a chunk at a time
constexpr int kCandidatesPerKept = 8;  // cap = min(chunk, the power of two >= max(8 k, 64))

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
// sparse.h's lower_bits: the largest b with keep 2^b <= chunk.
__device__ __forceinline__ int lower_bits_of(int keep, int chunk) {
  int b = 0;
  while ((keep << (b + 1)) <= chunk) ++b;
  return b;
}

__host__ __device__ constexpr size_t align16(size_t b) { return (b + 15) & ~size_t{15}; }

// A warp's shared memory: the candidates (fp32 bits, positions) and the kept (fp32 bits, positions,
// codes; the codes first hold the upper-half flags).
struct WarpScratch {
  uint32_t* cand_bits;
  uint16_t* cand_pos;
  uint32_t* kept_bits;
  uint16_t* kept_pos;
  uint8_t* kept_code;
};

__host__ __device__ constexpr size_t warp_scratch_bytes(int cap, int k) {
  return align16(size_t(cap) * 4) + align16(size_t(cap) * 2) + align16(size_t(k) * 4) + align16(size_t(k) * 2) +
         align16(size_t(k));
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
  return s;
}

__device__ __forceinline__ int32_t magnitude(uint32_t bits) { return static_cast<int32_t>(bits & kAbs); }

// Loads, then work: each lane loads kBatch runs of 4 values (16 bytes each) before it needs the first, so a
// chunk of 4096 costs two round trips to memory per pass (a ballot after every load would wait one for every
// 32 values). Value base + 128 u + 4 lane + c sits in v[u][c]; bits 0 past the chunk's end.
constexpr int kBatch = 4;

template <int B>
__device__ __forceinline__ void load_batch(const float* __restrict__ xc, int len, int base, int lane, bool aligned,
                                           uint32_t (&v)[B][4]) {
#pragma unroll
  for (int u = 0; u < B; ++u) {
    const int i = base + u * 128 + lane * 4;
    if (aligned && i + 3 < len) {
      const float4 f = *reinterpret_cast<const float4*>(xc + i);
      v[u][0] = __float_as_uint(f.x);
      v[u][1] = __float_as_uint(f.y);
      v[u][2] = __float_as_uint(f.z);
      v[u][3] = __float_as_uint(f.w);
    } else {
#pragma unroll
      for (int c = 0; c < 4; ++c) v[u][c] = i + c < len ? __float_as_uint(xc[i + c]) : 0u;
    }
  }
}

// Step 1: {L, the largest magnitude} of the chunk's len values (L = 0, no bound, when fewer than keep
// groups hold values). Lane l's slot j gathers the runs u of each batch with u % G = j.
template <int G>
__device__ int2 bound(const float* __restrict__ xc, int len, int keep, int lane, bool aligned) {
  constexpr int B = G > kBatch ? G : kBatch;
  int32_t gm[G];
#pragma unroll
  for (int j = 0; j < G; ++j) gm[j] = -1;
  for (int base = 0; base < len; base += 128 * B) {
    uint32_t v[B][4];
    load_batch(xc, len, base, lane, aligned, v);
#pragma unroll
    for (int u = 0; u < B; ++u) {
      const int i = base + u * 128 + lane * 4;
#pragma unroll
      for (int c = 0; c < 4; ++c) gm[u % G] = max(gm[u % G], i + c < len ? magnitude(v[u][c]) : -1);
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
// equal to low, those that fall in the first cap slots; returns {how many above, how many equal}. Each lane
// takes 16 consecutive values of every 512, so position order is lane order: one scan of the lanes' counts
// places every lane's candidates.
__device__ int2 compact(const float* __restrict__ xc, int len, int32_t low, int room, int cap, WarpScratch s,
                        int lane, bool aligned) {
  int above = 0, equal = 0;
  for (int base = 0; base < len; base += 512) {
    const int i0 = base + 16 * lane;
    uint32_t v[16];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int i = i0 + 4 * u;
      if (aligned && i + 3 < len) {
        const float4 f = *reinterpret_cast<const float4*>(xc + i);
        v[4 * u] = __float_as_uint(f.x);
        v[4 * u + 1] = __float_as_uint(f.y);
        v[4 * u + 2] = __float_as_uint(f.z);
        v[4 * u + 3] = __float_as_uint(f.w);
      } else {
#pragma unroll
        for (int c = 0; c < 4; ++c) v[4 * u + c] = i + c < len ? __float_as_uint(xc[i + c]) : 0u;
      }
    }
    unsigned gt = 0, eq = 0;  // bit c: value i0 + c is above low, equal to low
#pragma unroll
    for (int c = 0; c < 16; ++c) {
      const int32_t m = i0 + c < len ? magnitude(v[c]) : -1;
      gt |= unsigned(m > low) << c;
      eq |= unsigned(m == low) << c;
    }
    const int mine = __popc(gt) | (__popc(eq) << 16);  // at most 512 each
    int upto = mine;  // this lane's and the lower lanes'
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int t = __shfl_up_sync(kAll, upto, o);
      if (lane >= o) upto += t;
    }
    const int all = __shfl_sync(kAll, upto, 31), before = upto - mine;
    for (unsigned left = gt | eq; left != 0; left &= left - 1) {  // this lane's candidates, in position order
      const int c = __ffs(left) - 1;
      const unsigned lower = (1u << c) - 1;
      const int g = above + (before & 0xffff) + __popc(gt & lower);
      const int q = equal + (before >> 16) + __popc(eq & lower);
      const int slot = g + min(q, room);
      if ((((gt >> c) & 1u) || q < room) && slot < cap) {
        s.cand_bits[slot] = __float_as_uint(xc[i0 + c]);  // (in L1: just read)
        s.cand_pos[slot] = static_cast<uint16_t>(i0 + c);
      }
    }
    above += all & 0xffff;
    equal += all >> 16;
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

__device__ __forceinline__ double warp_sum(double v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kAll, v, o);
  return v;
}

// {sum of the kept magnitudes j with side(j), sum of the others}, float64 in ascending position order as the
// format fixes. When every kept magnitude is a multiple of the smallest nonzero one's ulp and keep of the
// largest stay below 2^53 of those ulps (`exact`), every partial sum is exact and any order gives the same
// bits: the lanes add their share and the warp adds those. Otherwise one lane adds left to right.
template <class Side>
__device__ double2 ordered_sums(const uint32_t* kept, int keep, bool exact, int lane, Side side) {
  double a = 0, b = 0;
  if (exact) {
    for (int j = lane; j < keep; j += 32) {
      const double v = static_cast<double>(__uint_as_float(kept[j] & kAbs));
      if (side(j, v)) {
        a += v;
      } else {
        b += v;
      }
    }
    return make_double2(warp_sum(a), warp_sum(b));
  }
  if (lane == 0) {
    for (int j = 0; j < keep; ++j) {
      const double v = static_cast<double>(__uint_as_float(kept[j] & kAbs));
      if (side(j, v)) {
        a += v;
      } else {
        b += v;
      }
    }
  }
  return make_double2(__shfl_sync(kAll, a, 0), __shfl_sync(kAll, b, 0));
}

__device__ __forceinline__ uint32_t bf16_of_mean(double m) {  // to fp32, then to bf16, each to nearest even
  const uint32_t b = __float_as_uint(static_cast<float>(m));
  return (b + 0x7fffu + ((b >> 16) & 1u)) >> 16;
}

template <int G>
__global__ void __launch_bounds__(kMaxWarps * 32)
    encode_kernel(const float* __restrict__ x, bool aligned, int64_t n, int chunk, int k, int log2_keep,
                  int64_t record, int cap, int64_t chunks, uint8_t* __restrict__ out, int* __restrict__ status) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const WarpScratch s = scratch_at(smem + warp * warp_scratch_bytes(cap, k), cap, k);
  for (int64_t c = int64_t(blockIdx.x) * warps + warp; c < chunks; c += int64_t(gridDim.x) * warps) {
    const float* xc = x + c * chunk;
    const int len = static_cast<int>(min(int64_t(chunk), n - c * chunk));
    const int keep = keep_of(len, chunk, k);
    const int2 b = bound<G>(xc, len, keep, lane, aligned);
    int32_t low = b.x;
    const int32_t hi = b.y;
    int2 n_at = compact(xc, len, low, cap, cap, s, lane, aligned);
    if (n_at.x > cap) {
      low = kth_largest([&](int i) { return __float_as_uint(xc[i]); }, len, keep, low, n_at.x + n_at.y, hi, lane);
      __syncwarp();  // another pass writes the same slots from other lanes
      n_at = compact(xc, len, low, cap, cap, s, lane, aligned);
    }
    if (n_at.x + n_at.y > cap) {  // ties at L take what is left
      __syncwarp();
      compact(xc, len, low, cap - n_at.x, cap, s, lane, aligned);
    }
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

    // the two levels: the means of the upper half and of the rest split the kept; lo and hi are the means of
    // each side of that split (the format's float64 sums)
    int32_t top_mag = 0, small = kInf;
    for (int j = lane; j < keep; j += 32) {
      const int32_t m = magnitude(s.kept_bits[j]);
      top_mag = max(top_mag, m);
      if (m > 0) small = min(small, m);
    }
    top_mag = warp_max(top_mag);
    small = warp_min(small);
    const bool exact = top_mag == 0 || (top_mag >> 23) - max(small >> 23, 1) <= 29 - log2_keep;
    const double2 halves = ordered_sums(s.kept_bits, keep, exact, lane, [&](int j, double) { return s.kept_code[j] != 0; });
    const double c_hi = halves.x / static_cast<double>(upper);
    const double c_lo = keep > upper ? halves.y / static_cast<double>(keep - upper) : c_hi;
    const double mid = (c_lo + c_hi) / 2;
    int n_hi = 0;
    for (int j = lane; j < keep; j += 32) n_hi += static_cast<double>(__uint_as_float(s.kept_bits[j] & kAbs)) >= mid;
    n_hi = warp_sum(n_hi);
    const double2 sides = ordered_sums(s.kept_bits, keep, exact, lane, [&](int, double v) { return v >= mid; });
    const uint32_t h = bf16_of_mean(sides.x / static_cast<double>(n_hi));
    const uint32_t l = keep > n_hi ? bf16_of_mean(sides.y / static_cast<double>(keep - n_hi)) : h;
    uint8_t* rec = out + c * record;
    if (lane < 4) rec[lane] = static_cast<uint8_t>((lane < 2 ? l : h) >> (8 * (lane & 1)));
    const int st = hi >= kInf ? int(EncodeStatus::kNonFinite)
                              : (h & 0x7fffu) >= 0x7f80u ? int(EncodeStatus::kOverflow) : int(EncodeStatus::kOk);
    if (lane == 0 && st != 0) atomicMax(status, st);
    __syncwarp();  // every lane has read the upper-half flags
    for (int j = lane; j < keep; j += 32) {
      const uint32_t v = s.kept_bits[j];
      const unsigned level = static_cast<double>(__uint_as_float(v & kAbs)) >= mid;
      const unsigned negative = __uint_as_float(v) < 0.f;  // -0 codes as positive
      s.kept_code[j] = static_cast<uint8_t>(level | (negative << 1));
    }
    __syncwarp();
    // the positions: upper parts in unary (bit (p_j >> lb) + j set, through a bitmap in the candidates'
    // words, free now), then the lower lb bits of each, packed
    const int lb = lower_bits_of(keep, chunk);
    const int ubytes = (keep + (chunk >> lb) + 7) / 8, lbytes = (keep * lb + 7) / 8;
    uint32_t* unary = s.cand_bits;
    for (int w = lane; w < (ubytes + 3) / 4; w += 32) unary[w] = 0;
    __syncwarp();
    for (int j = lane; j < keep; j += 32) {
      const int bit = (s.kept_pos[j] >> lb) + j;
      atomicOr(&unary[bit >> 5], 1u << (bit & 31));
    }
    __syncwarp();
    for (int q = lane; q < ubytes; q += 32) rec[4 + q] = static_cast<uint8_t>(unary[q >> 2] >> (8 * (q & 3)));
    const uint32_t mask = (1u << lb) - 1;
    for (int q = lane; q < lbytes; q += 32) {  // byte q: bits [8q, 8q + 8) of the lower parts' stream
      uint32_t byte = 0;
      for (int j = q * 8 / lb; j < keep && j * lb < q * 8 + 8; ++j) {
        const int shift = j * lb - q * 8;
        const uint32_t p = s.kept_pos[j] & mask;
        byte |= (shift >= 0 ? p << shift : p >> -shift) & 0xffu;
      }
      rec[4 + ubytes + q] = static_cast<uint8_t>(byte);
    }
    for (int q = lane; q < (keep + 3) / 4; q += 32) {  // byte q: the codes of kept values 4q .. 4q + 3
      uint32_t byte = 0;
      for (int t = 0; t < 4 && 4 * q + t < keep; ++t) byte |= uint32_t(s.kept_code[4 * q + t]) << (2 * t);
      rec[4 + ubytes + lbytes + q] = static_cast<uint8_t>(byte);
    }
    __syncwarp();  // the scratch is the next chunk's
  }
}

enum class Decode { kCheck, kAdd, kWrite, kSubtract };

// b bits at bit offset j b of a stream of `bytes` bytes, LSB first (b <= 12).
__device__ __forceinline__ int bits_at(const uint8_t* stream, int j, int b, int bytes) {
  const int bit = j * b, byte = bit >> 3;
  uint32_t w = 0;
  for (int t = 0; t < 3 && byte + t < bytes; ++t) w |= uint32_t(stream[byte + t]) << (8 * t);
  return static_cast<int>((w >> (bit & 7)) & ((1u << b) - 1));
}

// kCheck: *bad = 1 when a record's unary area does not hold exactly keep set bits or its positions do not
// ascend inside the chunk. kAdd: y += the values (nothing when *bad). kWrite: y = the values, 0 elsewhere, and
// the check. kSubtract: y -= the values, unchecked (a payload this process encoded). Each lane takes a byte of
// the unary area in turn: the set bits before it (a warp scan of the bytes' counts) number its positions.
template <Decode kMode>
__global__ void decode_kernel(const uint8_t* __restrict__ payload, int64_t n, int chunk, int k, int64_t record,
                              int64_t chunks, float* __restrict__ y, int* __restrict__ bad) {
  if (kMode == Decode::kAdd && *bad) return;
  const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  for (int64_t c = int64_t(blockIdx.x) * warps + (threadIdx.x >> 5); c < chunks; c += int64_t(gridDim.x) * warps) {
    const int len = static_cast<int>(min(int64_t(chunk), n - c * chunk));
    const int keep = keep_of(len, chunk, k);
    const int lb = lower_bits_of(keep, chunk);
    const int ubytes = (keep + (chunk >> lb) + 7) / 8, lbytes = (keep * lb + 7) / 8;
    const uint8_t* rec = payload + c * record;
    const uint8_t* unary = rec + 4;
    const uint8_t* lower = unary + ubytes;
    const uint8_t* codes = lower + lbytes;
    float* yc = y + c * chunk;
    if (kMode == Decode::kWrite) {
      for (int i = lane; i < len; i += 32) yc[i] = 0.f;
      __syncwarp();
    }
    const float lo = __uint_as_float(uint32_t(rec[0] | (rec[1] << 8)) << 16);
    const float hi = __uint_as_float(uint32_t(rec[2] | (rec[3] << 8)) << 16);
    bool fault = false;
    int before = 0;  // set bits in the bytes of earlier rounds
    for (int q0 = 0; q0 < ubytes; q0 += 32) {
      const int q = q0 + lane;
      const uint32_t byte = q < ubytes ? unary[q] : 0u;
      const int count = __popc(byte);
      int inclusive = count;
      for (int o = 1; o < 32; o <<= 1) {
        const int t = __shfl_up_sync(kAll, inclusive, o);
        if (lane >= o) inclusive += t;
      }
      int j = before + inclusive - count;
      for (uint32_t rest = byte; rest != 0; rest &= rest - 1, ++j) {
        const int t = __ffs(rest) - 1;
        if (j >= keep) {
          fault = true;
          break;
        }
        const int low = lb ? bits_at(lower, j, lb, lbytes) : 0;
        const int p = ((q * 8 + t - j) << lb) | low;
        if (kMode == Decode::kCheck || kMode == Decode::kWrite) {
          // equal upper parts (the bit before is set too) must have ascending lower parts
          const bool same = j > 0 && (t > 0 ? (byte >> (t - 1)) & 1u : q > 0 && (unary[q - 1] >> 7) & 1u);
          fault |= p >= len || (same && low <= bits_at(lower, j - 1, lb, lbytes));
        }
        if (kMode != Decode::kCheck && p < len) {
          const unsigned code = (codes[j / 4] >> (2 * (j % 4))) & 3u;
          const float mag = (code & 1u) ? hi : lo;
          const float v = (code & 2u) ? -mag : mag;
          yc[p] = kMode == Decode::kAdd ? yc[p] + v : kMode == Decode::kSubtract ? yc[p] - v : v;
        }
      }
      before += __shfl_sync(kAll, inclusive, 31);
    }
    fault |= before != keep;
    if ((kMode == Decode::kCheck || kMode == Decode::kWrite) && fault) atomicOr(bad, 1);
  }
}

struct DeviceLimits {
  int smem_optin = 0;  // shared memory a block may ask for
  int sms = 0;
};

DeviceLimits limits_of(int device) {  // asked once per device
  static std::mutex mutex;
  static std::vector<DeviceLimits> known;
  const std::lock_guard<std::mutex> lock(mutex);
  if (device >= static_cast<int>(known.size())) known.resize(device + 1);
  DeviceLimits& d = known[device];
  if (d.sms == 0) {
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&d.smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&d.sms, cudaDevAttrMultiProcessorCount, device));
  }
  return d;
}

unsigned grid_for(int64_t chunks, int warps) {  // blocks take chunks in turn past 2^20 blocks
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>((chunks + warps - 1) / warps, int64_t{1} << 20)));
}

}  // namespace

cudaError_t cuda::encode(const float* x, int64_t n, int64_t chunk, int64_t k, uint8_t* out, int* status,
                         int64_t blocks_per_sm, cudaStream_t stream) {
  const int64_t chunks = (n + chunk - 1) / chunk;
  if (chunks == 0) return cudaSuccess;
  int device = 0;
  if (const cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return e;
  int64_t cap = 1;  // (at least 64: 32 groups leave at least 31 values above their bound)
  while (cap < std::max<int64_t>(kCandidatesPerKept * k, 64)) cap <<= 1;
  cap = std::min(cap, chunk);
  const size_t per_warp = warp_scratch_bytes(static_cast<int>(cap), static_cast<int>(k));
  const DeviceLimits limits = limits_of(device);
  const int warps = static_cast<int>(std::min<int64_t>(kMaxWarps, int64_t(limits.smem_optin) / int64_t(per_warp)));
  if (warps < 1) {
    throw std::invalid_argument("sparse encode: k = " + std::to_string(k) +
                                " needs more shared memory than this GPU has");
  }
  const size_t smem = per_warp * warps;
  unsigned blocks = grid_for(chunks, warps);
  if (blocks_per_sm > 0) blocks = static_cast<unsigned>(std::min<int64_t>(blocks, int64_t(limits.sms) * blocks_per_sm));
  const int64_t record = record_bytes(k, chunk);
  int log2_k = 0;
  while ((int64_t{1} << log2_k) < k) ++log2_k;
  auto launch = [&](auto kernel) {
    if (smem > 48 * 1024) {
      if (const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
          e != cudaSuccess) {
        return e;
      }
    }
    const bool aligned = reinterpret_cast<uintptr_t>(x) % 16 == 0;  // then every chunk is (4 chunk bytes apart)
    kernel<<<blocks, warps * 32, smem, stream>>>(x, aligned, n, int(chunk), int(k), log2_k, record, int(cap), chunks,
                                                 out, status);
    return cudaGetLastError();
  };
  if (k <= 32) return launch(encode_kernel<1>);
  if (k <= 64) return launch(encode_kernel<2>);
  if (k <= 128) return launch(encode_kernel<4>);
  return launch(encode_kernel<8>);  // k > 256: fewer groups than k, no bound (then cap = chunk)
}

cudaError_t cuda::decode(cuda::DecodeMode mode, const uint8_t* payload, int64_t n, int64_t chunk, int64_t k, float* y,
                         int* bad, cudaStream_t stream) {
  const int64_t chunks = (n + chunk - 1) / chunk;
  if (chunks == 0) return cudaSuccess;
  const unsigned grid = grid_for(chunks, 4);
  const int64_t record = record_bytes(k, chunk);
  switch (mode) {
    case cuda::DecodeMode::kCheck:
      decode_kernel<Decode::kCheck><<<grid, 128, 0, stream>>>(payload, n, int(chunk), int(k), record, chunks, y, bad);
      break;
    case cuda::DecodeMode::kAdd:
      decode_kernel<Decode::kAdd><<<grid, 128, 0, stream>>>(payload, n, int(chunk), int(k), record, chunks, y, bad);
      break;
    case cuda::DecodeMode::kWrite:
      decode_kernel<Decode::kWrite><<<grid, 128, 0, stream>>>(payload, n, int(chunk), int(k), record, chunks, y, bad);
      break;
    case cuda::DecodeMode::kSubtract:
      decode_kernel<Decode::kSubtract><<<grid, 128, 0, stream>>>(payload, n, int(chunk), int(k), record, chunks, y,
                                                                  bad);
      break;
  }
  return cudaGetLastError();
}

namespace {

// dec[i] = (avg[i] - dec[i]) * divisor when `keep`; sums[0] += sum of (dec[i] - avg[i])^2 and sums[1] += sum of
// avg[i]^2 in float64 when sums is set (one atomic add per block each).
__global__ void owner_dropped_kernel(const float* __restrict__ avg, float* __restrict__ dec, int64_t n, float divisor,
                                     bool keep, double* __restrict__ sums) {
  double err = 0, ref = 0;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float a = avg[i], d = dec[i];
    if (sums) {
      const double e = static_cast<double>(d) - static_cast<double>(a);
      err += e * e;
      ref += static_cast<double>(a) * static_cast<double>(a);
    }
    if (keep) dec[i] = __fmul_rn(__fsub_rn(a, d), divisor);
  }
  if (!sums) return;
  __shared__ double part[2][8];
  for (int o = 16; o > 0; o >>= 1) {
    err += __shfl_xor_sync(kAll, err, o);
    ref += __shfl_xor_sync(kAll, ref, o);
  }
  const int warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  if ((threadIdx.x & 31) == 0) {
    part[0][warp] = err;
    part[1][warp] = ref;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < warps; ++w) {
      part[0][0] += part[0][w];
      part[1][0] += part[1][w];
    }
    atomicAdd(&sums[0], part[0][0]);
    atomicAdd(&sums[1], part[1][0]);
  }
}

}  // namespace

cudaError_t cuda::owner_dropped(const float* avg, float* dec, int64_t n, float divisor, bool keep, double* sums,
                                cudaStream_t stream) {
  if (n == 0 || (!keep && !sums)) return cudaSuccess;
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>((n + 255) / 256, 4096));
  owner_dropped_kernel<<<grid, 256, 0, stream>>>(avg, dec, n, divisor, keep, sums);
  return cudaGetLastError();
}

namespace {

// blocks_per_sm: blocks resident at once per SM (0: one block per 4 chunks, as many as the GPU schedules). Each
// block's warps take chunks in turn.
at::Tensor encode_on_blocks(const at::Tensor& x, int64_t chunk, int64_t k, int64_t blocks_per_sm) {
  check_sparse_settings(chunk, k);
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 1, "sparse encode takes a flat float32 tensor, got ",
              x.scalar_type(), " of ", num(x.dim()), " dimensions");
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor xc = x.contiguous();
  const int64_t n = xc.numel();
  at::Tensor out = at::empty({payload_bytes(n, chunk, k)}, x.options().dtype(at::kByte));
  if (n == 0) return out;
  at::Tensor status = at::empty({1}, x.options().dtype(at::kInt));  // the worst EncodeStatus of any chunk
  const auto stream = c10::cuda::getCurrentCUDAStream();
  C10_CUDA_CHECK(cudaMemsetAsync(status.data_ptr<int>(), 0, sizeof(int), stream));
  try {
    C10_CUDA_CHECK(cuda::encode(xc.data_ptr<float>(), n, chunk, k, out.data_ptr<uint8_t>(), status.data_ptr<int>(),
                                blocks_per_sm, stream));
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK(false, e.what());
  }
  int worst = 0;  // (a copy to pageable memory returns once it is done)
  C10_CUDA_CHECK(cudaMemcpyAsync(&worst, status.data_ptr<int>(), sizeof(int), cudaMemcpyDeviceToHost, stream));
  TORCH_CHECK(worst != int(EncodeStatus::kNonFinite), "sparse encode: the tensor holds non-finite values");
  TORCH_CHECK(worst != int(EncodeStatus::kOverflow), "sparse encode: a chunk's magnitude overflows bf16");
  return out;
}

constexpr int64_t kBlocksPerSm = 0;  // H200, 256 MiB, k = 64: as many as it schedules (bench_sparse_speed.py --sweep)

at::Tensor sparse_encode_cuda(const at::Tensor& x, int64_t chunk, int64_t k) {
  return encode_on_blocks(x, chunk, k, kBlocksPerSm);
}

void launch_decode(cuda::DecodeMode mode, const at::Tensor& payload, int64_t n, int64_t chunk, int64_t k, float* y,
                   int* bad) {
  C10_CUDA_CHECK(cuda::decode(mode, payload.data_ptr<uint8_t>(), n, chunk, k, y, bad,
                              c10::cuda::getCurrentCUDAStream()));
}

constexpr const char* kMalformed = "sparse decode: the positions of a chunk are not ascending inside it";

at::Tensor sparse_decode_cuda(const at::Tensor& payload, int64_t numel, int64_t chunk, int64_t k) {
  check_sparse_payload_size(payload, numel, chunk, k);
  const c10::cuda::CUDAGuard guard(payload.device());
  const at::Tensor p = payload.contiguous();
  at::Tensor y = at::empty({numel}, payload.options().dtype(at::kFloat));
  at::Tensor bad = at::zeros({1}, payload.options().dtype(at::kInt));
  launch_decode(cuda::DecodeMode::kWrite, p, numel, chunk, k, y.data_ptr<float>(), bad.data_ptr<int>());
  TORCH_CHECK(bad.item<int>() == 0, kMalformed);
  return y;
}

void sparse_decode_add_cuda(at::Tensor& acc, const at::Tensor& payload, int64_t chunk, int64_t k) {
  check_sparse_accumulator(acc, payload);
  check_sparse_payload_size(payload, acc.numel(), chunk, k);
  const c10::cuda::CUDAGuard guard(acc.device());
  const at::Tensor p = payload.contiguous();
  at::Tensor bad = at::zeros({1}, payload.options().dtype(at::kInt));
  launch_decode(cuda::DecodeMode::kCheck, p, acc.numel(), chunk, k, acc.data_ptr<float>(), bad.data_ptr<int>());
  launch_decode(cuda::DecodeMode::kAdd, p, acc.numel(), chunk, k, acc.data_ptr<float>(), bad.data_ptr<int>());
  TORCH_CHECK(bad.item<int>() == 0, kMalformed);
}

}  // namespace
}  // namespace prime::codec::sparse

// Private, for benchmarks: encode with another number of resident blocks per SM.
TORCH_LIBRARY_FRAGMENT(prime, m) {
  m.def("_sparse_encode_blocks(Tensor x, int chunk, int k, int blocks_per_sm) -> Tensor");
}

TORCH_LIBRARY_IMPL(prime, CUDA, m) {
  m.impl("_sparse_encode_blocks", &prime::codec::sparse::encode_on_blocks);
  m.impl("sparse_encode", &prime::codec::sparse::sparse_encode_cuda);
  m.impl("sparse_decode", &prime::codec::sparse::sparse_decode_cuda);
  m.impl("sparse_decode_add_", &prime::codec::sparse::sparse_decode_add_cuda);
}
