// The handle of one asynchronous all-reduce: completion, error, statistics.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <optional>

#include "deadline.h"
#include "errors.h"

namespace prime::ring {

struct WorkStats {
  int64_t seq = -1;
  int64_t n = 0;
  uint64_t bytes_sent = 0;      // on the wire, frame headers included
  uint64_t bytes_received = 0;  // likewise
  uint64_t frames_sent = 0;
  uint64_t frames_received = 0;
  double quantize_s = 0;  // codec quantize
  double reduce_s = 0;    // dequantize(-add), sums, conversions, copies
  double wait_s = 0;      // blocked on the wire
  double commit_s = 0;    // writing the result, copy_back_s included
  double stage_s = 0;     // before queueing: the device-to-host (or strided) copy into staging
  double copy_back_s = 0; // the staged result copied into the caller's tensor (host-to-device for CUDA)
  double queue_s = 0;     // from submission until the worker started it
  double total_s = 0;     // from start to completion (queue time excluded)
  double auth_s = 0;      // sealing and opening frames (AES-GCM) on the I/O threads; overlaps the rest
  bool direct = false;    // the direct (two-hop) schedule ran, not the ring
  // CUDA tensors reduced on their GPU (gpu true; ScheduleTimes says what each counts):
  bool gpu = false;
  double gpu_codec_s = 0;  // GPU time of the codec kernels
  double h2d_s = 0;        // GPU time of the host-to-device payload copies
  double d2h_s = 0;        // GPU time of the device-to-host payload copies
  double staging_s = 0;    // host time copying received payloads into pinned staging
  double gpu_wait_s = 0;   // host time blocked until the GPU produced a payload to send
  // The int8 quantization error this rank measured while it encoded (ScheduleTimes; the
  // fields of prime.sync.QUANT_ERROR_FIELDS). Only when quant_measured: codec int8 with
  // world size > 1 (the exact codec quantizes nothing, nor does a ring of one) and
  // RingOptions::measure_quant_error; the bindings give None otherwise, never a 0 that
  // was not measured.
  bool quant_measured = false;
  double quant_err_sq = 0;  // sum over every block quantized of ||dequantize(quantize(x)) - x||^2
  double quant_in_sq = 0;   // and of ||x||^2
};

class Work {
 public:
  explicit Work(int64_t seq) : seq_(seq) {}
  int64_t seq() const { return seq_; }
  // Waits up to `timeout` (negative: without limit). Returns whether the work completed.
  bool wait_for(Millis timeout);
  bool completed() const;
  std::optional<ErrorInfo> error() const;
  WorkStats stats() const;
  void finish(std::optional<ErrorInfo> error, const WorkStats& stats);

 private:
  const int64_t seq_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::optional<ErrorInfo> error_;
  WorkStats stats_;
};

}  // namespace prime::ring
