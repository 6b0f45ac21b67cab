#include "rate_limiter.h"

#include <algorithm>
#include <thread>

namespace prime::ring {

RateLimiter::RateLimiter(double bytes_per_second, double burst_bytes)
    : rate_(bytes_per_second), burst_(std::max(burst_bytes, 1.0)), tokens_(burst_), last_(Clock::now()) {}

void RateLimiter::set_rate(double bytes_per_second) {
  std::lock_guard<std::mutex> lock(mu_);
  const auto now = Clock::now();
  const double rate = rate_.load(std::memory_order_relaxed);
  tokens_ = rate > 0 ? std::min(burst_, tokens_ + rate * std::chrono::duration<double>(now - last_).count()) : burst_;
  last_ = now;
  rate_.store(bytes_per_second, std::memory_order_relaxed);
}

bool RateLimiter::acquire(size_t n, const std::atomic<bool>* stop) {
  if (!limited()) return true;  // no lock on the unlimited path (every piece of every stream passes here)
  double wait_s;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const double rate = rate_.load(std::memory_order_relaxed);
    if (rate <= 0) return true;
    const auto now = Clock::now();
    tokens_ = std::min(burst_, tokens_ + rate * std::chrono::duration<double>(now - last_).count());
    last_ = now;
    tokens_ -= static_cast<double>(n);
    wait_s = tokens_ < 0 ? -tokens_ / rate : 0.0;
  }
  const auto until = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(wait_s));
  while (Clock::now() < until) {
    if (stop && stop->load(std::memory_order_relaxed)) return false;
    std::this_thread::sleep_for(std::min<Clock::duration>(until - Clock::now(), Millis(50)));
  }
  return true;
}

}  // namespace prime::ring
