// One rank's end of the ring: its links (to every other rank), its background worker,
// its collectives (the ring schedule in the ring's order, or the direct one).
//
// all_reduce() only queues a job; a single worker thread runs the jobs in FIFO
// order (every rank must issue them in the same order, as with NCCL; the frame
// header's sequence number and descriptor check it). A job works on staging
// buffers and calls its `commit` (copy into the caller's tensor) only when every
// check passed, so a failed collective leaves the caller's tensor untouched.
//
// After a wire failure the ring is broken: the worker tells both neighbours (abort
// frames), closes every socket, fails the job and every later one. Build a new
// ring (new job id) with the survivors.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "rendezvous.h"
#include "schedule.h"
#include "tcp_transport.h"
#include "work.h"

namespace prime::ring {

struct RingOptions {
  int rank = 0;
  int world_size = 1;
  std::string job_id = "prime";
  std::string secret;
  int64_t timeout_ms = 60000;             // every wait of a collective
  int64_t rendezvous_timeout_ms = 60000;  // forming the links, from construction on
  int streams = 1;  // per link; 0: each link chooses from its round trip (tcp/tuning.h)
  double max_rate = 0;  // bytes/s of this rank's uplink (all its links); <= 0 unlimited
  bool encrypt = false;  // payloads encrypted; every frame is authenticated either way
  int64_t segment_elems = 1 << 18;
  std::string bind_addr = "127.0.0.1";
  int socket_buffer_bytes = 0;       // 0: kernel autotuning
  int64_t corrupt_after_bytes = -1;  // tests only (see TransportOptions)
  bool restart_bbr = true;           // see TransportOptions
  // The block codecs (int8, fp4) measure their own quantization error as they encode (WorkStats
  // quant_err_sq, quant_in_sq). Off: the pass is skipped and nothing is reported.
  bool measure_quant_error = true;
};

struct AllReduceJob {
  AllReduceSpec spec;
  // Where the result goes once every check passed: `direct` (the caller's tensor
  // itself, when it is a contiguous CPU tensor) or else spec.output, a staging
  // buffer that `commit` then copies into the caller's tensor.
  void* direct = nullptr;
  std::function<void()> commit;
  std::shared_ptr<void> keep_alive;   // tensors behind spec.input / spec.output
  std::vector<int> order;             // the ring's order when the job was issued (set by Ring)
  double stage_s = 0;                 // time the caller spent filling spec.input (reported in WorkStats)
};

uint64_t job_hash(const std::string& job_id, int world_size);

class Ring {
 public:
  explicit Ring(RingOptions options);  // validates, binds the listener (world_size > 1)
  ~Ring();
  Ring(const Ring&) = delete;
  Ring& operator=(const Ring&) = delete;

  int rank() const { return opt_.rank; }
  int world_size() const { return opt_.world_size; }
  int port() const;  // 0 when there is no listener
  // Forms the links (connect to every rank at addresses[r], accept every rank) and starts
  // the worker.
  void connect(const std::vector<Address>& addresses);
  // The ring schedule's order from now on: order[p] is the rank at position p, a
  // permutation of 0..N-1 every rank passes the same (agreed through the store).
  void set_order(std::vector<int> order);
  std::vector<int> order() const;
  // What this rank knows of its links (one report per peer; empty before connect()).
  std::vector<LinkReport> links() const;
  std::vector<std::string> rejected_connections() const;
  std::shared_ptr<Work> all_reduce(AllReduceJob job);
  // Joins every thread and closes every socket; queued jobs fail with kClosed. Safe to
  // call from any thread but the worker, also while connect() runs in another (which
  // then fails with kClosed). Never called by the worker itself (jobs hold no Ring).
  void close();

 private:
  struct Pending {
    AllReduceJob job;
    std::shared_ptr<Work> work;
    Clock::time_point submitted;
  };

  void worker_loop();
  void execute(Pending& p);
  // execute(), but an unexpected exception fails the job (and breaks the ring) instead
  // of leaving the worker thread: nothing a job does can end the process.
  void execute_guarded(Pending& p);
  void break_ring(const ErrorInfo& e);
  ErrorInfo broken_error(int64_t seq) const;

  const RingOptions opt_;
  const uint64_t job_;
  std::shared_ptr<BufferPool> pool_;
  std::unique_ptr<Rendezvous> rendezvous_;
  std::unique_ptr<TcpTransport> transport_;  // set in connect(), under lifecycle_mu_
  std::thread worker_;
  // Held by connect() from start to end and by close() for its teardown: threads are
  // started and joined under it, so a close() racing a connect() waits for it (after
  // interrupting its rendezvous) instead of returning while connect() goes on to start
  // a worker that nobody joins (whose std::thread would then end the process with
  // std::terminate when the Ring is destroyed).
  mutable std::mutex lifecycle_mu_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<int> order_;  // empty: rank order
  std::deque<Pending> queue_;
  int64_t next_seq_ = 0;
  bool running_ = false;  // the worker is inside a job
  bool closing_ = false;
  bool closed_ = false;
  bool connecting_ = false;
  bool connected_ = false;
  std::optional<ErrorInfo> broken_;
};

}  // namespace prime::ring
