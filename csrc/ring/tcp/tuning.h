// Sizing a link to its bandwidth-delay product within the host's limits.
//
// One TCP stream keeps at most about two thirds of its send buffer in flight (the rest
// is the kernel's bookkeeping: measured 2.76 MB of a 4 MiB buffer, 5.56 MB of 8 MiB),
// and its send buffer grows by autotuning only to net.ipv4.tcp_wmem's maximum (4 MiB
// on many hosts: 222 Mbit/s at 100 ms RTT), or, set with SO_SNDBUF, to twice
// net.core.wmem_max. A link whose bandwidth-delay product exceeds that gets a larger
// buffer, and then more streams. Nothing here needs privileges.
#pragma once

#include <cstdint>

#include "socket.h"

namespace prime::ring {

// The host's TCP send-buffer limits (read once, from /proc/sys of this network namespace).
struct SocketLimits {
  int64_t wmem_max = 208 << 10;        // net.core.wmem_max: the most SO_SNDBUF may ask for
  int64_t tcp_wmem_max = 4 << 20;      // net.ipv4.tcp_wmem[2]: where autotuning stops
  static SocketLimits of_host();
  // Bytes one stream keeps in flight with autotuning, and with the largest SO_SNDBUF.
  double autotuned_inflight() const;
  double max_inflight() const;
  // Bytes one stream keeps in flight with a send buffer of `sndbuf` bytes (as granted), or
  // (sndbuf 0) as far as autotuning goes.
  double inflight_of(int64_t sndbuf) const;
};

// How a link is set up: its streams and each stream's SO_SNDBUF (0: autotuning).
struct LinkPlan {
  int streams = 1;
  int sndbuf = 0;
  double needed_inflight = 0;  // bytes the link must keep in flight to fill its path
};

// The link rate assumed while nothing is known (no max_rate, nothing measured yet):
// a link starts with the streams 1 Gbit/s needs at its round trip, and opens enough for
// kPoolLinkRate, so that it can use more when collectives show it waiting on its
// buffers (TcpTransport::learn). 8 streams fill 1 Gbit/s up to ~350 ms, 2.5 Gbit/s up to
// ~140 ms.
constexpr double kAssumedLinkRate = 1e9 / 8;  // bytes/s
constexpr double kPoolLinkRate = 2.5e9 / 8;   // bytes/s
constexpr int kMaxAutoStreams = 8;
// In-flight headroom over the bandwidth-delay product (queueing, pacing gain).
constexpr double kInflightHeadroom = 1.25;

// The SO_SNDBUF a stream needs to keep `inflight` bytes in flight: 0 when autotuning
// reaches it, else as much as it takes, at most net.core.wmem_max.
int sndbuf_for(double inflight, const SocketLimits& limits);

// The plan for a link of `rtt_s` and `rate` bytes/s: enough in flight for rate x rtt (with
// headroom), in as few streams as the limits allow, at most kMaxAutoStreams.
LinkPlan plan_link(double rtt_s, double rate, const SocketLimits& limits);

// How many of a link's `opened` streams it starts with to keep `inflight` bytes in
// flight: as many as autotuning's window would need, not as few as the largest buffers
// allow. A loss halves one stream's window, so the more streams carry a link the less
// its rate drops (measured on the delay line, 4 ranks x 256 MiB int8 at RTT 100 ms and
// 1 Gbit/s: 6 streams 1.09-1.11 s, 3 streams with twice the buffer 1.19-1.39 s;
// docs/ring.md, "Links").
int start_streams_for(double inflight, int opened, const SocketLimits& limits);

// A long link that lost packets to its own queue (lost_to_own_queue) writes into its
// streams' sockets, together, at most at this multiple of its share of the uplink rate it
// measured (TcpTransport::pace).
// Congestion control alone (BBR) let each of six streams pace at 4-5x its share after
// the gap between two collectives: a collective's first chunk left at over 3x the path's
// rate, overflowed a drop-tail queue of one bandwidth-delay product, and its tail came a
// round trip late (delay line, 4 ranks x 256 MiB int8, 1 Gbit/s, RTT 100 ms; docs/ring.md,
// "Links"). The headroom leaves congestion control room to probe above the estimate, so
// a link faster than it showed still raises its estimate collective by collective; 2.0
// let the tails come late again.
constexpr double kPacingHeadroom = 1.6;
// ... and its streams hold at most this multiple of that share times the link's minimum
// round trip unacknowledged, together (TcpTransport::wait_inflight). Pacing alone spreads
// the bursts, but eight BBR streams each keep twice their estimate of their share in
// flight (estimates that read high), more than the path and a drop-tail queue of one
// bandwidth-delay product hold: with the cap the same links ran 5-10% faster at RTT 50 and
// 100 ms (delay line, 4 ranks x 256 MiB int8, 1 Gbit/s; 1.25x and 2.0x gained less;
// benchmarks/RESULTS.md).
constexpr double kPacedInflight = 1.5;
// The bytes a paced link may write at once (the pacer's bucket).
constexpr double kPacerBurst = 1 << 20;
// A link whose smoothed round trip rose above this multiple of its minimum filled a queue.
constexpr double kQueuedRtt = 1.5;

// Whether a link lost packets to its own queue: it retransmitted while its round trip
// showed a queue (peak smoothed RTT over kQueuedRtt times the minimum). Random loss on an
// empty path is not that, and pacing cannot prevent it.
bool lost_to_own_queue(uint64_t retransmits, double peak_srtt_s, double min_rtt_s);

// SO_SNDBUF (not FORCE: the host's limit holds); the kernel doubles it.
void set_send_buffer(const Socket& s, int bytes);

// What the kernel knows of a stream (TCP_INFO). Times in seconds, counters cumulative.
struct TcpStats {
  double rtt_s = 0;       // smoothed
  double min_rtt_s = 0;   // windowed minimum
  double busy_s = 0;      // time with data in flight
  double sndbuf_limited_s = 0;  // of that, limited by the send buffer
  double rwnd_limited_s = 0;    // limited by the receiver's window
  uint64_t bytes_acked = 0;
  // The kernel's latest delivery-rate sample (bytes/s): delivered over the longer of the
  // send and the acknowledgement intervals of about a round trip, so acknowledgements
  // that arrive in a burst do not inflate it; 0 when unknown.
  double delivery_rate = 0;
  uint64_t retransmits = 0;  // segments sent again (lost, or presumed lost)
  uint32_t in_flight = 0;    // segments sent and not acknowledged yet
  int sndbuf = 0;  // the socket's current send buffer (SO_SNDBUF as read back)
};
bool read_tcp_stats(const Socket& s, TcpStats* out);

// BBR (Linux's tcp_bbr) keeps the lowest round trip it saw in a window of 10 s. When the
// window expires while a stream sends, the stream enters ProbeRTT: its congestion window
// falls to 4 packets until what it has in flight drains, for at least 200 ms and a round
// trip, and the frames in its socket wait. The link's streams, which took their minimum
// at the same moments, do it together. A stream that restarts from idle after the window
// expired refreshes its minimum without ProbeRTT instead, so collectives minutes apart
// never see one; back-to-back collectives, or one long one, do (measured on the delay
// line, 4 ranks x 256 MiB int8, 1 Gbit/s, RTT 100-200 ms: 3-6 of a link's 8 streams at a
// window of 4 for 0.4-0.9 s, each link every ~11 s; docs/ring.md, "Links").
constexpr int64_t kBbrMinRttWindowNs = 10'000'000'000;

// Restarts BBR on the stream (TCP_CONGESTION to another algorithm the host allows, then
// back): its minimum-RTT window starts again now, and its bandwidth estimate is learned
// again (startup). False when the stream does not run BBR, or the host refused (nothing
// changed then).
bool restart_bbr(const Socket& s);

// Whether the stream's congestion control is BBR (TCP_CONGESTION).
bool runs_bbr(const Socket& s);

// Whether a stream that runs BBR is in ProbeRTT now (TCP_CC_INFO: a window gain of 1,
// which no other BBR state has).
bool in_probe_rtt(const Socket& s);

// Bytes written to the stream that its peer has not acknowledged yet (SIOCOUTQ).
int64_t unacked_bytes(const Socket& s);

}  // namespace prime::ring
