#include "rate_limiter.h"

#include <algorithm>
#include <thread>

namespace prime::ring {

RateLimiter::RateLimiter(double bytes_per_second, double burst_bytes)
    : rate_(bytes_per_second), burst_(std::max(burst_bytes, 1.0)), tokens_(burst_), last_(Clock::now()) {}

bool RateLimiter::acquire(size_t n, const std::atomic<bool>* stop) {
  if (rate_ <= 0) return true;
  double wait_s;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const auto now = Clock::now();
    tokens_ = std::min(burst_, tokens_ + rate_ * std::chrono::duration<double>(now - last_).count());
    last_ = now;
    tokens_ -= static_cast<double>(n);
    wait_s = tokens_ < 0 ? -tokens_ / rate_ : 0.0;
  }
  const auto until = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(wait_s));
  while (Clock::now() < until) {
    if (stop && stop->load(std::memory_order_relaxed)) return false;
    std::this_thread::sleep_for(std::min<Clock::duration>(until - Clock::now(), Millis(50)));
  }
  return true;
}

}  // namespace prime::ring
