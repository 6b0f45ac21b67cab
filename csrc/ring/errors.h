// The ring's error type. Messages follow gloo's habit: they name this rank, the
// peer, the step and the cause, e.g.
//   "rank 3: timed out after 30000 ms waiting for recv from rank 2
//    (reduce-scatter step 1, segment 5) in all_reduce #17"
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace prime::ring {

enum class ErrorKind : int {
  kTimeout = 0,         // a wait passed its deadline without progress
  kConnectionLost = 1,  // EOF, reset, or a failed send
  kCorruptFrame = 2,    // bad magic, header or payload checksum, absurd length
  kProtocol = 3,        // unexpected frame: ranks disagree on the collective sequence or arguments
  kPeerFailed = 4,      // another rank failed and told us (abort frame)
  kNonFinite = 5,       // NaN/Inf in some rank's input or in the sum: nothing was written
  kHandshake = 6,       // rendezvous refused: authentication or configuration mismatch
  kClosed = 7,          // the ring was closed (here or by a neighbour)
  kInternal = 8,        // a bug or an allocation failure
};

const char* kind_name(ErrorKind kind);

enum class Phase : int { kNone = 0, kReduceScatter = 1, kAllGather = 2, kRendezvous = 3 };

const char* phase_name(Phase phase);

// Where the failing rank was when it failed.
struct Context {
  int64_t seq = -1;  // collective sequence number, -1 outside a collective
  Phase phase = Phase::kNone;
  int step = -1;
  int segment = -1;
};

struct ErrorInfo {
  ErrorKind kind = ErrorKind::kInternal;
  int rank = -1;    // the rank raising
  int peer = -1;    // the neighbour involved, -1 if none
  int origin = -1;  // the rank where the failure started
  Context where;
  std::string cause;  // what happened, without the context
  std::string origin_message;  // kPeerFailed: the message of the origin rank
  uint64_t nonfinite_ranks = 0;  // kNonFinite: bit r set when rank r's input held NaN/Inf
  bool overflow = false;         // kNonFinite: inputs finite but the sum was not

  std::string message() const;
};

class CommError : public std::runtime_error {
 public:
  explicit CommError(ErrorInfo info);
  const ErrorInfo& info() const { return info_; }

 private:
  ErrorInfo info_;
};

std::string describe(const Context& where);  // "(reduce-scatter step 1, segment 5) in all_reduce #17"
std::vector<int> ranks_of_mask(uint64_t mask);

}  // namespace prime::ring
