// The handle of one asynchronous all-reduce: completion, error, statistics.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <optional>

#include "deadline.h"
#include "errors.h"
#include "timers.h"

namespace prime::ring {

struct WorkStats {
  int64_t seq = -1;
  int64_t n = 0;
  uint64_t bytes_sent = 0;      // on the wire, frame headers included
  uint64_t bytes_received = 0;  // likewise
  uint64_t frames_sent = 0;
  uint64_t frames_received = 0;
  // Every timer of timers.h (PRIME_RING_TIMERS, which says what each counts), in seconds: the
  // schedule's copied from ScheduleTimes, the others measured around it (Ring::execute).
  PRIME_RING_TIMERS(PRIME_RING_TIMER_FIELD)
  bool direct = false;  // the direct (two-hop) schedule ran, not the ring
  bool gpu = false;     // a CUDA tensor reduced on its GPU (the GPU timers count only then)
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
