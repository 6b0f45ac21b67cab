// The transport over TCP links to every peer, each of one or more streams.
//
// Threads: one sender per outgoing stream, one receiver per incoming stream, and a
// watcher on the outgoing streams' reverse direction (where a peer reports its failure
// or close). A frame for a peer goes on the link's stream with the least still to
// deliver (its queue and what its socket holds unacknowledged), so a stream that TCP
// slows down takes fewer frames; frames carry their number on the link, and the receiver
// takes them in that order from whichever stream brought them.
//
// Every frame is sealed (AES-256-GCM tag, tcp/frame.h) by the thread that writes it
// and opened by the thread that reads it, under the stream's session keys: the
// sender, receiver and watcher threads do the cryptography, beside the worker.
//
// Failure: any thread that fails records the first failure and wakes everyone;
// the owner (the ring's worker) then calls shutdown(), which tells every peer
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
#include "tcp/tuning.h"
#include "transport.h"

namespace prime::ring {

struct TransportOptions {
  int rank = 0;
  Millis timeout{60000};
  double max_rate = 0;  // bytes/s over all outgoing streams; <= 0 unlimited
  bool encrypt = false;  // payloads encrypted (else authenticated only)
  uint64_t job = 0;
  uint32_t max_payload = 0;        // longest data payload a peer may announce
  int64_t corrupt_after_bytes = -1;  // tests only: flip one bit of the payload byte at this offset (after sealing)
  bool tune = true;  // the user chose neither streams nor buffers: learn() adapts them
  // Restart BBR on a stream before a collective its minimum-RTT window would expire in
  // (begin_collective()): no ProbeRTT inside collectives (tcp/tuning.h).
  bool restart_bbr = true;
};

// What this rank knows of its link to one peer (the outgoing direction).
struct LinkReport {
  int peer = -1;
  int streams = 0;              // opened
  int wanted = 0;               // used by a collective that sends on this link alone (fewer when it shares the uplink)
  int sndbuf = 0;              // per stream, as the kernel grants it (doubled SO_SNDBUF, or autotuned)
  double handshake_rtt_s = -1;  // the round trip measured while the link formed
  double rtt_s = -1;            // TCP's windowed minimum over the streams, once data flowed
  double rate = 0;              // bytes/s delivered over the last collective that measured it, 0 before
  double limited_share = 0;     // share of that time the streams waited on a buffer or window
  double needed_inflight = 0;   // bytes the link must keep in flight (rate x rtt, with headroom)
  uint64_t bytes_sent = 0;      // payload and frame bytes, since the link formed
  std::vector<uint64_t> stream_bytes;  // the same, per stream
  int64_t changes = 0;          // changes of buffers or streams used since the link formed
  // A long link (one stream cannot fill it): the uplink rate the collectives that sent on
  // it alone showed (peak_rate; the highest seen, bytes/s), and the rate the last
  // collective paced the link's writes at (bytes/s; 0: not paced).
  double uplink_rate = 0;
  double pacing_rate = 0;
  double inflight_cap = 0;   // bytes its streams may hold unacknowledged, together, when paced (0: any)
  uint64_t retransmits = 0;  // segments its streams sent again, since the link formed
  bool paced = false;        // it lost packets to its own queue on a long path: its writes are paced (pace())
  // The last collective's highest round trip of the link: at each sample, the lowest
  // smoothed round trip of its streams with data in flight (a queue on the path delays
  // them all; one stream's stall, a timeout, is not the path's).
  double peak_srtt_s = 0;
  // The last collective's highest delivery rate: its streams' latest TCP samples, summed
  // (bytes/s; 10-30% above the path's rate on the delay line, never below it when busy).
  double peak_rate = 0;
  // ProbeRTT episodes seen on its BBR streams while they sent (since the link formed), and
  // how often it restarted BBR on one of them before a collective (begin_collective()).
  uint64_t probe_rtts = 0;
  uint64_t bbr_restarts = 0;
};

class TcpTransport : public Transport {
 public:
  // links[r]: the streams to and from rank r (empty for ranks without a link). `on_failure`
  // runs (on an I/O thread, no lock held) when a failure is first recorded.
  TcpTransport(TransportOptions options, std::vector<Link> links, std::shared_ptr<BufferPool> pool,
               std::function<void()> on_failure);
  ~TcpTransport() override;

  void send(int peer, OutFrame frame) override;
  InFrame recv(int peer, const Context& where, WireCounters& counters) override;
  void flush(const Context& where) override;
  bool frame_ready(int peer) override;

  bool failed() const { return failed_.load(); }
  // The recorded failure as seen from `where`, if any.
  std::optional<ErrorInfo> failure(const Context& where) const;
  // Tells every peer (an abort or close frame carrying `origin` and `message`), stops
  // and joins every thread, closes the sockets. Idempotent.
  void shutdown(FrameKind kind, int origin, const std::string& message);

  // Before a collective (the worker): it sends on `concurrent` links at once (1 for the
  // ring, N-1 for the direct schedule), which share this rank's uplink: each link then
  // uses its wanted streams divided among them. BBR streams whose minimum-RTT window
  // could run out within the collective (1.5x as long as the last one) are restarted
  // first, while idle: their window then covers the collective (tcp/tuning.h).
  void begin_collective(int concurrent);
  // Between collectives (the worker): reads what TCP measured on every link that carried
  // enough since the last call (round trip, delivery rate, time limited by buffers); a
  // link that waited on its buffers grows them, then uses more of its streams.
  void learn();
  std::vector<LinkReport> link_reports() const;

 private:
  struct Failure {
    ErrorKind kind;
    int peer;
    std::string cause;
    int origin = -1;
    std::string origin_message;
  };
  struct SendStream {
    SendStream(int peer, int index, Socket s, const SessionKeys& keys, bool encrypt)
        : peer(peer),
          index(index),
          socket(std::move(s)),
          sealer(keys.client_to_server, encrypt),
          reports(keys.server_to_client, encrypt) {}
    const int peer;
    const int index;
    Socket socket;
    FrameSealer sealer;   // our frames to the peer (sender thread, then shutdown)
    FrameOpener reports;  // the peer's abort / close frame (watcher thread)
    ByteBuffer scratch;   // ciphertext of one piece, when encrypting
    std::deque<OutFrame> queue;
    size_t queued_bytes = 0;  // payloads in the queue and the one being written
    bool busy = false;       // a frame is being written
    bool mid_frame = false;  // stopped inside a frame: no control frame may follow
    TcpStats seen;           // learn(): the counters at the last call
    bool bbr = false;          // its congestion control is BBR (read once: the host's default)
    int64_t bbr_epoch_ns = 0;  // when the ring last restarted BBR on it (0: never)
    bool in_probe_rtt = false;  // at the last sample_rate()
    std::atomic<uint64_t> bytes{0};  // payload and frame bytes sent on this stream
    std::thread thread;
  };
  struct RecvStream {
    RecvStream(int peer, int index, Socket s, const SessionKeys& keys, bool encrypt)
        : peer(peer),
          index(index),
          socket(std::move(s)),
          opener(keys.client_to_server, encrypt),
          reports(keys.server_to_client, encrypt) {}
    const int peer;
    const int index;
    Socket socket;
    FrameOpener opener;   // the peer's frames (receiver thread)
    FrameSealer reports;  // our abort / close frame to the peer (shutdown)
    std::deque<InFrame> queue;
    bool ended = false;  // EOF after the peer's close frame
    size_t queued_bytes = 0;
    std::atomic<int64_t> progress_ns{0};
    std::thread thread;
  };
  struct OutLink {
    std::vector<SendStream*> streams;
    uint32_t next_frame = 0;  // under send_mu_
    size_t next_pick = 0;     // where the search for the least-loaded stream starts
    size_t active = 1;        // streams this collective uses (under send_mu_)
    size_t first = 0;         // the first of them: streams[(first + i) % span], i < active
    size_t span = 1;          // the streams the link wants (those it cycles through)
    int wanted = 1;           // streams it would use alone (the worker's)
    int concurrent = 1;       // links the current collective sends on at once
    // What the link's streams may write into their sockets, together (pace()): a long
    // link's share of its uplink rate with headroom; unlimited until measured.
    RateLimiter pacer{0, kPacerBurst};
    std::atomic<double> inflight_cap{0};  // pace(): what its streams may hold unacknowledged, together (0: any)
    double rtt_s = 0;         // measured while the link formed
    int64_t rate_ns = 0;      // sample_rate(): when it last read the streams' rates
    std::atomic<uint64_t> probe_rtts{0};  // sample_rate(): ProbeRTT episodes seen
    double peak_rate = 0;     // this collective's highest sum of its streams' delivery rates (bytes/s)
    double peak_srtt = 0;     // this collective's highest round trip of the link (s; LinkReport::peak_srtt_s)
    std::atomic<bool> closed{false};  // the peer closed the ring (a clean close)
    std::atomic<uint64_t> bytes{0};   // sent, since the link formed
    uint64_t bytes_at_learn = 0;
    LinkReport report;  // under report_mu_
  };
  struct InLink {
    std::vector<RecvStream*> streams;
    uint32_t next_frame = 0;  // under recv_mu_
    std::atomic<bool> closed{false};  // the peer closed the ring: EOF follows
  };

  // Every thread runs one of these loops through guarded(), which turns an unexpected
  // exception into the ring's failure (an exception leaving a thread is std::terminate).
  void guarded(void (TcpTransport::*loop)(int), int j);
  void sender_loop(int j);
  void receiver_loop(int j);
  void watcher_loop(int unused);
  // Stops and joins every thread without telling the peers (constructor failure, or a
  // shutdown() that could not run). Safe to call twice.
  void stop_and_join() noexcept;
  void write_frame(SendStream& s, OutFrame& f);
  // Before a paced link's streams write `len` more bytes: waits until what they hold
  // unacknowledged (SIOCOUTQ, summed) leaves room for them under the link's inflight_cap.
  void wait_inflight(OutLink& link, size_t len);
  SendStream& pick_stream(OutLink& link);  // send_mu_ held
  // Paces what a long link's streams write, together, at kPacingHeadroom times the
  // link's share of the uplink rate it measured, and caps what they hold unacknowledged
  // at kPacedInflight times that share's bandwidth-delay product; nothing before a
  // measurement. send_mu_ held.
  void pace(OutLink& link);
  // Reads the link's delivery rate (its streams' latest samples, summed) while a
  // collective sends, keeping the highest: the rate the path carried while the link was
  // busy, where bytes over the whole collective would count its waits on the ring's other
  // links too. Counts the ProbeRTT episodes of its BBR streams. send_mu_ held.
  void sample_rate(OutLink& link);
  // begin_collective(), send_mu_ held: restarts BBR on the streams whose minimum-RTT
  // window could run out before a collective that begins at `now` ends.
  void restart_bbr_where_due(int64_t now);
  InFrame read_frame(const Socket& socket, FrameOpener& opener, const IoLimits& limits, uint32_t max_data_payload,
                     int expected_rank);
  void record(Failure f);
  void record_lost(Failure f);  // record() after a short grace for a better-informed report
  ErrorInfo error_from(const Failure& f, const Context& where) const;
  ErrorInfo local_error(ErrorKind kind, int peer, std::string cause, const Context& where) const;
  void send_control(const Socket& s, FrameSealer& sealer, FrameKind kind, int origin, const std::string& message);

  const TransportOptions opt_;
  std::shared_ptr<BufferPool> pool_;
  std::function<void()> on_failure_;
  const SocketLimits limits_;
  RateLimiter limiter_;
  std::atomic<bool> stop_{false};
  std::atomic<bool> failed_{false};
  std::atomic<int64_t> payload_bytes_sent_{0};  // for the corruption hook
  bool shut_down_ = false;
  std::mutex shutdown_mu_;

  mutable std::mutex fail_mu_;
  std::optional<Failure> failure_;

  // Indexed by peer rank (null: no link); the streams themselves live in send_ / recv_.
  std::vector<std::unique_ptr<OutLink>> out_;
  std::vector<std::unique_ptr<InLink>> in_;
  mutable std::mutex report_mu_;

  std::mutex send_mu_;
  std::condition_variable send_cv_;   // new frames, stop
  std::condition_variable sent_cv_;   // a frame left (flush waits on it)
  std::vector<std::unique_ptr<SendStream>> send_;
  std::atomic<int64_t> send_progress_ns_{0};
  // The worker's (begin_collective(), learn()): when the last collective began and ended.
  int64_t collective_start_ns_ = 0;
  int64_t collective_end_ns_ = 0;

  std::mutex recv_mu_;
  std::condition_variable recv_cv_;
  std::vector<std::unique_ptr<RecvStream>> recv_;

  std::thread watcher_;
};

}  // namespace prime::ring
