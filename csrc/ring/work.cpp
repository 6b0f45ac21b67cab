#include "work.h"

namespace prime::ring {

bool Work::wait_for(Millis timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  if (timeout.count() < 0) {
    cv_.wait(lock, [&] { return done_; });
    return true;
  }
  return cv_.wait_for(lock, timeout, [&] { return done_; });
}

bool Work::completed() const {
  std::lock_guard<std::mutex> lock(mu_);
  return done_;
}

std::optional<ErrorInfo> Work::error() const {
  std::lock_guard<std::mutex> lock(mu_);
  return error_;
}

WorkStats Work::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

void Work::finish(std::optional<ErrorInfo> error, const WorkStats& stats) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    error_ = std::move(error);
    stats_ = stats;
    done_ = true;
  }
  cv_.notify_all();
}

}  // namespace prime::ring
