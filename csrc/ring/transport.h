// What the schedules need from the network: send a frame to a peer, receive the next
// frame from a peer, each bounded by the ring's timeout. Frames between two ranks
// arrive in the order they were sent. The TCP implementation is tcp_transport.h.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>

#include "buffer_pool.h"
#include "errors.h"
#include "tcp/frame.h"

namespace prime::ring {

// Bytes and frames on the wire for one collective, counted by the transport as it
// writes and reads them (headers and tags included).
struct WireCounters {
  std::atomic<uint64_t> bytes_sent{0};
  std::atomic<uint64_t> bytes_received{0};
  std::atomic<uint64_t> frames_sent{0};
  std::atomic<uint64_t> frames_received{0};
  // Time the I/O threads spent sealing (sender) and opening (receiver) this collective's
  // frames: AES-GCM over every payload byte, on the host, overlapping the rest.
  std::atomic<uint64_t> auth_ns{0};
};

struct OutFrame {
  FrameHeader header;  // payload_len, frame_no and the encryption flag are filled in by the transport
  const char* data = nullptr;
  size_t size = 0;
  // Owns `data` when it is not memory the collective keeps alive until flush().
  std::shared_ptr<const ByteBuffer> owner;
  std::shared_ptr<WireCounters> counters;
  uint64_t auth_ns = 0;  // time spent sealing it (the sender thread's)
};

struct InFrame {
  FrameHeader header;
  Buffer payload;  // never null; authenticated (and decrypted) on arrival
  uint64_t auth_ns = 0;  // time spent opening it
};

class Transport {
 public:
  virtual ~Transport() = default;
  // Queues a frame for `peer` and returns at once (a peer's frames leave in order).
  virtual void send(int peer, OutFrame frame) = 0;
  // The next frame from `peer`. Throws CommError (with `where` as context) when nothing
  // arrives for the timeout, or when the ring failed.
  virtual InFrame recv(int peer, const Context& where, WireCounters& counters) = 0;
  // Blocks until every queued frame has been handed to the network. Throws like recv.
  virtual void flush(const Context& where) = 0;
  // True when the next recv(peer) would return without blocking (its frame is queued).
  virtual bool frame_ready(int peer) { return true; }
};

}  // namespace prime::ring
