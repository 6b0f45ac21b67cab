#include "errors.h"
#include "str_builder.h"


namespace prime::ring {

const char* kind_name(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::kTimeout: return "timeout";
    case ErrorKind::kConnectionLost: return "connection_lost";
    case ErrorKind::kCorruptFrame: return "corrupt_frame";
    case ErrorKind::kProtocol: return "protocol";
    case ErrorKind::kPeerFailed: return "peer_failed";
    case ErrorKind::kNonFinite: return "non_finite";
    case ErrorKind::kHandshake: return "handshake";
    case ErrorKind::kClosed: return "closed";
    case ErrorKind::kInternal: return "internal";
  }
  return "unknown";
}

const char* phase_name(Phase phase) {
  switch (phase) {
    case Phase::kNone: return "none";
    case Phase::kReduceScatter: return "reduce-scatter";
    case Phase::kAllGather: return "all-gather";
    case Phase::kRendezvous: return "rendezvous";
  }
  return "unknown";
}

std::string describe(const Context& where) {
  StrBuilder s;
  if (where.phase == Phase::kReduceScatter || where.phase == Phase::kAllGather) {
    s << "(" << phase_name(where.phase) << " step " << where.step;
    if (where.segment >= 0) s << ", segment " << where.segment;
    s << ") ";
  } else if (where.phase == Phase::kRendezvous) {
    s << "during rendezvous";
    return s.str();
  }
  if (where.seq >= 0) {
    s << "in all_reduce #" << where.seq;
  } else {
    s << "between collectives";
  }
  return s.str();
}

std::vector<int> ranks_of_mask(uint64_t mask) {
  std::vector<int> out;
  for (int r = 0; r < 64; ++r) {
    if (mask & (uint64_t{1} << r)) out.push_back(r);
  }
  return out;
}

std::string ErrorInfo::message() const {
  StrBuilder s;
  s << "rank " << rank << ": ";
  if (kind == ErrorKind::kPeerFailed) {
    s << describe(where) << " aborted because rank " << origin << " failed";
    if (peer >= 0 && peer != origin) s << " (reported through rank " << peer << ")";
    s << ": " << origin_message;
    return s.str();
  }
  s << cause;
  const std::string ctx = describe(where);
  if (!ctx.empty()) s << " " << ctx;
  return s.str();
}

CommError::CommError(ErrorInfo info) : std::runtime_error(info.message()), info_(std::move(info)) {}

}  // namespace prime::ring
