// Token bucket in bytes per second, shared by the streams of one link: it lets
// tests and benchmarks emulate a slow uplink on hosts without tc.
#pragma once

#include <atomic>
#include <cstddef>
#include <mutex>

#include "deadline.h"

namespace prime::ring {

class RateLimiter {
 public:
  // rate <= 0: unlimited. The bucket holds `burst` bytes; acquire() may run it into
  // debt, and the caller then sleeps the debt off, so streams share the rate fairly.
  RateLimiter(double bytes_per_second, double burst_bytes);
  bool limited() const { return rate_.load(std::memory_order_relaxed) > 0; }
  double rate() const { return rate_.load(std::memory_order_relaxed); }  // bytes/s; <= 0: unlimited
  // A new rate (<= 0: unlimited) for what is acquired from now on.
  void set_rate(double bytes_per_second);
  // Blocks until `n` bytes may be sent; returns false when `stop` was set meanwhile.
  bool acquire(size_t n, const std::atomic<bool>* stop);

 private:
  std::atomic<double> rate_;
  const double burst_;
  std::mutex mu_;
  double tokens_;
  Clock::time_point last_;
};

}  // namespace prime::ring
