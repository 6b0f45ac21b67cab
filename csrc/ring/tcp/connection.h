// Blocking-with-deadline I/O on a connected, non-blocking TCP socket, and the
// client side of connection setup. Every call returns or throws IoError by its
// deadline; a stop flag (checked every kPollSliceMs) lets the ring interrupt it.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

#include "../deadline.h"
#include "socket.h"

namespace prime::ring {

// poll() never sleeps longer than this, so stop flags are seen promptly.
constexpr int kPollSliceMs = 100;

struct IoLimits {
  Deadline deadline = Deadline::never();  // absolute limit
  Millis idle{0};                         // >0: give up after this long without a byte moving
  const std::atomic<bool>* stop = nullptr;
  std::atomic<int64_t>* progress_ns = nullptr;  // set to now_ns() whenever bytes move
};

// `more`: more bytes of the same message follow at once (MSG_MORE): the kernel holds a
// partial segment back for them instead of sending a small packet now.
void send_all(const Socket& s, const void* data, size_t n, const IoLimits& limits, bool more = false);
void recv_all(const Socket& s, void* data, size_t n, const IoLimits& limits);

// Waits until the socket is readable (data or EOF). Returns false at the deadline / stop.
bool wait_readable(const Socket& s, const IoLimits& limits);

// TCP_NODELAY (frames are written whole; Nagle would only add latency), and,
// when buffer_bytes > 0, fixed send/receive buffers of that size. Left at 0 the
// kernel autotunes them (up to net.ipv4.tcp_wmem/tcp_rmem), which beats a fixed
// size capped by net.core.wmem_max on most hosts: see docs/ring.md.
void configure_stream(const Socket& s, int buffer_bytes);

// Connects to host:port, retrying refused connections until the deadline. *rtt_s (when
// not null): how long the successful attempt took, one round trip (SYN, SYN-ACK).
Socket connect_to(const std::string& host, int port, Deadline deadline, double* rtt_s = nullptr);

}  // namespace prime::ring
