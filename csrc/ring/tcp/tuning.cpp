#include "tuning.h"

#include <linux/sockios.h>
#include <linux/inet_diag.h>
#include <linux/tcp.h>
#include <netinet/in.h>
#include <sys/ioctl.h>
#include <sys/socket.h>

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>

namespace prime::ring {
namespace {

// What share of a send buffer a stream keeps in flight (measured, see tuning.h).
constexpr double kInflightShare = 0.66;

// The last number in a /proc file ("4096 16384 4194304" -> 4194304). Plain read(2) and
// strtoll: a build with a newer compiler than the host's libstdc++ crashed inside
// iostream's number parsing (its locale facets come from two library versions).
int64_t read_last_number(const char* path, int64_t fallback) {
  const int fd = ::open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return fallback;
  char text[128];
  const ssize_t n = ::read(fd, text, sizeof(text) - 1);
  ::close(fd);
  if (n <= 0) return fallback;
  text[n] = '\0';
  int64_t last = -1;
  for (char* p = text; *p != '\0';) {
    char* end = nullptr;
    const long long v = std::strtoll(p, &end, 10);
    if (end == p) {
      ++p;
      continue;
    }
    last = v;
    p = end;
  }
  return last > 0 ? last : fallback;
}

}  // namespace

SocketLimits SocketLimits::of_host() {
  SocketLimits l;
  l.wmem_max = read_last_number("/proc/sys/net/core/wmem_max", l.wmem_max);
  l.tcp_wmem_max = read_last_number("/proc/sys/net/ipv4/tcp_wmem", l.tcp_wmem_max);
  return l;
}

double SocketLimits::autotuned_inflight() const { return kInflightShare * static_cast<double>(tcp_wmem_max); }

double SocketLimits::max_inflight() const {
  return kInflightShare * static_cast<double>(std::max(tcp_wmem_max, 2 * wmem_max));
}

double SocketLimits::inflight_of(int64_t sndbuf) const {
  return kInflightShare * static_cast<double>(sndbuf > 0 ? sndbuf : tcp_wmem_max);
}

int sndbuf_for(double inflight, const SocketLimits& limits) {
  if (inflight <= limits.autotuned_inflight()) return 0;
  // SO_SNDBUF asks for half of what the kernel then grants.
  const double ask = std::ceil(inflight / kInflightShare / 2);
  return static_cast<int>(std::min<double>(ask, static_cast<double>(limits.wmem_max)));
}

LinkPlan plan_link(double rtt_s, double rate, const SocketLimits& limits) {
  LinkPlan p;
  p.needed_inflight = kInflightHeadroom * std::max(0.0, rate) * std::max(0.0, rtt_s);
  if (p.needed_inflight <= limits.autotuned_inflight()) return p;  // one autotuned stream fills it
  p.streams = static_cast<int>(std::clamp(std::ceil(p.needed_inflight / limits.max_inflight()), 1.0,
                                          static_cast<double>(kMaxAutoStreams)));
  p.sndbuf = sndbuf_for(p.needed_inflight / p.streams, limits);
  return p;
}

int start_streams_for(double inflight, int opened, const SocketLimits& limits) {
  const double per_stream = std::max(1.0, limits.autotuned_inflight());
  const double wanted = std::ceil(std::max(0.0, inflight) / per_stream);
  return static_cast<int>(std::clamp(wanted, 1.0, static_cast<double>(std::max(1, opened))));
}

bool lost_to_own_queue(uint64_t retransmits, double peak_srtt_s, double min_rtt_s) {
  return retransmits > 0 && min_rtt_s > 0 && peak_srtt_s > kQueuedRtt * min_rtt_s;
}

void set_send_buffer(const Socket& s, int bytes) {
  if (bytes > 0) ::setsockopt(s.fd(), SOL_SOCKET, SO_SNDBUF, &bytes, sizeof(bytes));
}

bool read_tcp_stats(const Socket& s, TcpStats* out) {
  tcp_info info{};
  socklen_t len = sizeof(info);
  if (s.fd() < 0 || ::getsockopt(s.fd(), IPPROTO_TCP, TCP_INFO, &info, &len) != 0) return false;
  out->rtt_s = info.tcpi_rtt * 1e-6;
  out->min_rtt_s = info.tcpi_min_rtt * 1e-6;
  out->busy_s = static_cast<double>(info.tcpi_busy_time) * 1e-6;
  out->sndbuf_limited_s = static_cast<double>(info.tcpi_sndbuf_limited) * 1e-6;
  out->rwnd_limited_s = static_cast<double>(info.tcpi_rwnd_limited) * 1e-6;
  out->bytes_acked = info.tcpi_bytes_acked;
  out->delivery_rate = static_cast<double>(info.tcpi_delivery_rate);
  out->retransmits = info.tcpi_total_retrans;
  out->in_flight = info.tcpi_unacked;
  int buf = 0;
  socklen_t blen = sizeof(buf);
  if (::getsockopt(s.fd(), SOL_SOCKET, SO_SNDBUF, &buf, &blen) == 0) out->sndbuf = buf;
  return true;
}

namespace {

constexpr char kBbr[] = "bbr";

bool set_congestion_control(const Socket& s, const char* name) {
  return ::setsockopt(s.fd(), IPPROTO_TCP, TCP_CONGESTION, name, static_cast<socklen_t>(std::strlen(name))) == 0;
}

}  // namespace

bool runs_bbr(const Socket& s) {
  char name[16] = {};  // TCP_CA_NAME_MAX
  socklen_t len = sizeof(name);
  if (s.fd() < 0 || ::getsockopt(s.fd(), IPPROTO_TCP, TCP_CONGESTION, name, &len) != 0) return false;
  return std::strncmp(name, kBbr, sizeof(name)) == 0;
}

bool restart_bbr(const Socket& s) {
  if (!runs_bbr(s)) return false;
  // Setting the algorithm a socket already runs does nothing: it goes through another
  // (reno is always built in; cubic where the host does not allow reno), then back. The
  // socket runs BBR because it is the host's default, which is always allowed.
  for (const char* other : {"reno", "cubic"}) {
    if (set_congestion_control(s, other)) return set_congestion_control(s, kBbr);
  }
  return false;
}

bool in_probe_rtt(const Socket& s) {
  tcp_cc_info info{};
  socklen_t len = sizeof(info);
  if (s.fd() < 0 || ::getsockopt(s.fd(), IPPROTO_TCP, TCP_CC_INFO, &info, &len) != 0 || len < sizeof(info.bbr)) {
    return false;
  }
  constexpr uint32_t kUnitGain = 256;  // BBR_UNIT: gains are fixed point, 8 fractional bits
  return info.bbr.bbr_cwnd_gain == kUnitGain;
}

int64_t unacked_bytes(const Socket& s) {
  int v = 0;
  if (s.fd() < 0 || ::ioctl(s.fd(), SIOCOUTQ, &v) != 0) return 0;
  return v;
}

}  // namespace prime::ring
