// The transport over k TCP streams to each neighbour.
//
// Threads: one sender per stream to the right, one receiver per stream from the
// left, and a watcher on the right streams' reverse direction (where the right
// neighbour reports its failure or close). Frame i goes on stream i mod k on both
// ends, so order is kept without sequence buffers.
//
// Every frame is sealed (AES-256-GCM tag, tcp/frame.h) by the thread that writes it
// and opened by the thread that reads it, under the stream's session keys: the
// sender, receiver and watcher threads do the cryptography, beside the worker.
//
// Failure: any thread that fails records the first failure and wakes everyone;
// the owner (the ring's worker) then calls shutdown(), which tells both neighbours
// why (an abort frame), closes every socket and joins every thread.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "rate_limiter.h"
#include "rendezvous.h"
#include "tcp/connection.h"
#include "tcp/socket.h"
#include "transport.h"

namespace prime::ring {

struct TransportOptions {
  int rank = 0;
  int left = 0;
  int right = 0;
  Millis timeout{60000};
  double max_rate = 0;  // bytes/s over all streams to the right; <= 0 unlimited
  bool encrypt = false;  // payloads encrypted (else authenticated only)
  uint64_t job = 0;
  uint32_t max_payload = 0;        // longest data payload a peer may announce
  int64_t corrupt_after_bytes = -1;  // tests only: flip one bit of the payload byte at this offset (after sealing)
};

class TcpTransport : public Transport {
 public:
  // `on_failure` runs (on an I/O thread, no lock held) when a failure is first recorded.
  TcpTransport(TransportOptions options, std::vector<Stream> right, std::vector<Stream> left,
               std::shared_ptr<BufferPool> pool, std::function<void()> on_failure);
  ~TcpTransport() override;

  void send(OutFrame frame) override;
  InFrame recv(const Context& where, WireCounters& counters) override;
  void flush(const Context& where) override;
  bool frame_ready() override;

  bool failed() const { return failed_.load(); }
  // The recorded failure as seen from `where`, if any.
  std::optional<ErrorInfo> failure(const Context& where) const;
  // Tells the neighbours (an abort or close frame carrying `origin` and `message`),
  // stops and joins every thread, closes the sockets. Idempotent.
  void shutdown(FrameKind kind, int origin, const std::string& message);

 private:
  struct Failure {
    ErrorKind kind;
    int peer;
    std::string cause;
    int origin = -1;
    std::string origin_message;
  };
  struct SendStream {
    SendStream(Socket s, const SessionKeys& keys, bool encrypt)
        : socket(std::move(s)), sealer(keys.client_to_server, encrypt), reports(keys.server_to_client, encrypt) {}
    Socket socket;
    FrameSealer sealer;   // our frames to the right (sender thread, then shutdown)
    FrameOpener reports;  // the right neighbour's abort / close frame (watcher thread)
    ByteBuffer scratch;   // ciphertext of one piece, when encrypting
    std::deque<OutFrame> queue;
    bool busy = false;       // a frame is being written
    bool mid_frame = false;  // stopped inside a frame: no control frame may follow
    std::thread thread;
  };
  struct RecvStream {
    RecvStream(Socket s, const SessionKeys& keys, bool encrypt)
        : socket(std::move(s)), opener(keys.client_to_server, encrypt), reports(keys.server_to_client, encrypt) {}
    Socket socket;
    FrameOpener opener;   // the left neighbour's frames (receiver thread)
    FrameSealer reports;  // our abort / close frame to the left (shutdown)
    std::deque<InFrame> queue;
    bool ended = false;  // EOF after the peer's close frame
    size_t queued_bytes = 0;
    std::atomic<int64_t> progress_ns{0};
    std::thread thread;
  };

  // Every thread runs one of these loops through guarded(), which turns an unexpected
  // exception into the ring's failure (an exception leaving a thread is std::terminate).
  void guarded(void (TcpTransport::*loop)(int), int j);
  void sender_loop(int j);
  void receiver_loop(int j);
  void watcher_loop(int unused);
  // Stops and joins every thread without telling the neighbours (constructor failure,
  // or a shutdown() that could not run). Safe to call twice.
  void stop_and_join() noexcept;
  void write_frame(SendStream& s, OutFrame& f);
  InFrame read_frame(const Socket& socket, FrameOpener& opener, const IoLimits& limits, uint32_t max_data_payload,
                     int expected_rank);
  void record(Failure f);
  void record_lost(Failure f);  // record() after a short grace for a better-informed report
  ErrorInfo error_from(const Failure& f, const Context& where) const;
  ErrorInfo local_error(ErrorKind kind, int peer, std::string cause, const Context& where) const;
  void send_control(const Socket& s, FrameSealer& sealer, FrameKind kind, int origin, const std::string& message);

  const TransportOptions opt_;
  const int k_;
  std::shared_ptr<BufferPool> pool_;
  std::function<void()> on_failure_;
  RateLimiter limiter_;
  std::atomic<bool> stop_{false};
  std::atomic<bool> failed_{false};
  std::atomic<int64_t> payload_bytes_sent_{0};  // for the corruption hook
  bool shut_down_ = false;
  std::mutex shutdown_mu_;

  mutable std::mutex fail_mu_;
  std::optional<Failure> failure_;
  std::atomic<bool> left_closed_{false};
  std::atomic<bool> right_closed_{false};

  std::mutex send_mu_;
  std::condition_variable send_cv_;   // new frames, stop
  std::condition_variable sent_cv_;   // a frame left (flush waits on it)
  std::vector<std::unique_ptr<SendStream>> send_;
  uint64_t next_send_ = 0;
  std::atomic<int64_t> send_progress_ns_{0};

  std::mutex recv_mu_;
  std::condition_variable recv_cv_;
  std::vector<std::unique_ptr<RecvStream>> recv_;
  uint64_t next_recv_ = 0;

  std::thread watcher_;
};

}  // namespace prime::ring
