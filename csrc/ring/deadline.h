// Deadlines of blocking waits. Every wait in the ring has one.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>

namespace prime::ring {

using Clock = std::chrono::steady_clock;
using Millis = std::chrono::milliseconds;

// A point in time after which a wait gives up.
struct Deadline {
  Clock::time_point at = Clock::time_point::max();

  static Deadline after(Millis d) { return Deadline{Clock::now() + d}; }
  static Deadline never() { return Deadline{}; }
  bool expired() const { return Clock::now() >= at; }
  // Milliseconds left, clamped to [0, cap]: a timeout argument for poll().
  int poll_ms(int cap) const {
    if (at == Clock::time_point::max()) return cap;
    const auto left = std::chrono::duration_cast<Millis>(at - Clock::now()).count() + 1;
    return static_cast<int>(std::clamp<int64_t>(left, 0, cap));
  }
  Deadline sooner(Deadline other) const { return Deadline{std::min(at, other.at)}; }
};

inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
}

inline double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

}  // namespace prime::ring
