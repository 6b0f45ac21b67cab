// The timers of one all-reduce, in seconds: the one place to add one. Each X(name, description)
// below becomes
//   a double field of WorkStats (work.h), and of ScheduleTimes (schedule.h) when the schedule
//     measures it;
//   a key of prime._C._Work.stats() and an entry of prime._C._ring_timers() (bindings.cpp);
//   a float field of prime.comm.WorkStats (default 0.0, the description in its metadata);
//   a key of the trainer's metrics line when non-zero (prime.sync.work_stats, which also says
//     which few are recorded always or under another name).
// A timer of the schedule is copied into WorkStats as it is (ring.cpp); one measured around the
// schedule is set by hand in Ring::execute.
//
// PRIME_RING_TIMERS's order is the order of prime.comm.WorkStats's timer fields and of the keys of
// the metrics line. prime/comm/ring.py reads this file when prime._C is not built (stand-in rings
// still build a WorkStats): keep each timer on a line of its own, its description one plain string
// literal, and the groups in the order PRIME_RING_TIMERS lists them.
#pragma once

// Host time of the schedule and its wire codec (ScheduleTimes).
#define PRIME_RING_SCHEDULE_HOST_TIMERS(X)                                                          \
  X(quantize_s, "codec quantize (the int8 error measurement, when on, included)")                   \
  X(reduce_s, "dequantize(-add), widening, sums, rounding, copies (on the GPU: issuing that work)") \
  X(wait_s, "blocked on the wire (receives and the final flush)")

// Measured around the schedule, each set by hand in Ring::execute (ring.cpp): auth_s from the
// transport's nanosecond counter, stage_s as the caller measured it before queueing (bindings.cpp,
// AllReduceJob::stage_s), the others by Ring::execute itself.
#define PRIME_RING_WORK_TIMERS(X)                                                                   \
  X(auth_s, "sealing and opening frames (AES-GCM) on the transport's threads; overlaps the rest")   \
  X(stage_s, "before queueing: the copy of a CUDA (or strided) tensor into staging")                \
  X(commit_s, "writing what was left of the result after every check passed, copy_back_s included") \
  X(copy_back_s, "the staged result copied into the caller's tensor (host-to-device for CUDA)")     \
  X(queue_s, "from submission until the worker started it")                                         \
  X(total_s, "from start to completion, queue time excluded")

// CUDA tensors reduced on their GPU only (wire_codec_cuda.cu; ScheduleTimes). GPU time from CUDA
// events, which overlaps the host's work, then host time of the worker.
#define PRIME_RING_SCHEDULE_GPU_TIMERS(X)                                                 \
  X(gpu_codec_s, "GPU time of the codec kernels: quantize, dequantize-add, sums, checks") \
  X(h2d_s, "GPU time of the received payloads' copies, pinned staging -> device")         \
  X(d2h_s, "GPU time of the copies of payloads to send, device -> pinned staging")        \
  X(staging_s, "host time copying received payloads into pinned staging")                 \
  X(gpu_wait_s, "host time blocked until the GPU produced a payload to send")

// The fields of ScheduleTimes.
#define PRIME_RING_SCHEDULE_TIMERS(X) PRIME_RING_SCHEDULE_HOST_TIMERS(X) PRIME_RING_SCHEDULE_GPU_TIMERS(X)

// Every timer: the fields of WorkStats.
#define PRIME_RING_TIMERS(X)                                                                     \
  PRIME_RING_SCHEDULE_HOST_TIMERS(X) PRIME_RING_WORK_TIMERS(X) PRIME_RING_SCHEDULE_GPU_TIMERS(X)

// X for a struct's field: `double name = 0;`.
#define PRIME_RING_TIMER_FIELD(name, description) double name = 0;

namespace prime::ring {

struct TimerInfo {
  const char* name;
  const char* description;
};

// Every timer's name and description, in PRIME_RING_TIMERS's order (prime._C._ring_timers()).
inline constexpr TimerInfo kTimers[] = {
#define PRIME_RING_TIMER_INFO(name, description) {#name, description},
    PRIME_RING_TIMERS(PRIME_RING_TIMER_INFO)
#undef PRIME_RING_TIMER_INFO
};

}  // namespace prime::ring
