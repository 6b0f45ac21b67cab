// Python bindings of the ring: prime._C._Ring and prime._C._Work, wrapped by
// prime/comm/ring.py. The only ring file that sees torch: it turns tensors into
// staging buffers (a contiguous CPU view, a host copy of strided tensors, and for
// CUDA tensors either the device memory itself, reduced on the GPU, or a pinned host
// copy) and a commit callback that copies the result back.
// pybind11 keeps its own types hidden while this extension is built with default
// visibility; GCC then warns on every bound class. Harmless for a single module.
#pragma GCC diagnostic ignored "-Wattributes"

// ATen and torch's pybind11 casters of tensors, not <torch/extension.h> (the C++ frontend too), which
// more than doubles this file's compile time.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/utils/pybind.h>

#include "../codec/checks.h"
#include "../codec/sparse.h"
#include "crypto/crc32c.h"
#include "crypto/libcrypto.h"
#include "crypto/sha256.h"
#include "ring.h"
#include "timers.h"
#include "wire_codec.h"
#ifdef PRIME_WITH_CUDA
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "wire_codec_cuda.h"
#endif

namespace prime {
namespace {

namespace py = pybind11;
using ring::AllReduceJob;
using ring::CommError;
using ring::ErrorInfo;
using ring::Ring;
using ring::RingOptions;
using ring::Work;

py::dict info_to_dict(const ErrorInfo& e) {
  py::dict d;
  d["kind"] = ring::kind_name(e.kind);
  d["message"] = e.message();
  d["rank"] = e.rank;
  d["peer"] = e.peer;
  d["origin"] = e.origin;
  d["seq"] = e.where.seq;
  d["phase"] = ring::phase_name(e.where.phase);
  d["step"] = e.where.step;
  d["segment"] = e.where.segment;
  d["cause"] = e.cause;
  d["origin_message"] = e.origin_message;
  py::list ranks;
  for (int r : ring::ranks_of_mask(e.nonfinite_ranks)) ranks.append(r);
  d["nonfinite_ranks"] = ranks;
  d["overflow"] = e.overflow;
  return d;
}

py::dict stats_to_dict(const ring::WorkStats& s) {
  py::dict d;
  d["seq"] = s.seq;
  d["numel"] = s.n;
  d["bytes_sent"] = s.bytes_sent;
  d["bytes_received"] = s.bytes_received;
  d["frames_sent"] = s.frames_sent;
  d["frames_received"] = s.frames_received;
#define PRIME_RING_TIMER_TO_DICT(name, description) d[#name] = s.name;
  PRIME_RING_TIMERS(PRIME_RING_TIMER_TO_DICT)
#undef PRIME_RING_TIMER_TO_DICT
  d["schedule"] = s.direct ? "direct" : "ring";
  d["gpu"] = s.gpu;
  // None unless measured (codec int8, world size > 1, the ring's quant_error on): never a 0 nobody measured.
  d["quant_err_sq"] = s.quant_measured ? py::object(py::float_(s.quant_err_sq)) : py::object(py::none());
  d["quant_in_sq"] = s.quant_measured ? py::object(py::float_(s.quant_in_sq)) : py::object(py::none());
  return d;
}

// The arguments of all_reduce were checked by prime.comm.Ring.all_reduce, which gives
// the user-facing messages; here they are only translated (an unknown value is a
// caller bypassing that check). The block size keeps the codec's own check
// (codec/checks.h): it guards the codec's memory accesses.
ring::DType dtype_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return ring::DType::kFloat32;
    case at::kBFloat16: return ring::DType::kBFloat16;
    case at::kHalf: return ring::DType::kFloat16;
    default:
      TORCH_CHECK_TYPE(false, "all_reduce expects a float32, bfloat16 or float16 tensor, got ", t.scalar_type());
  }
}

ring::AllReduceSpec spec_of(const at::Tensor& tensor, const std::string& op, const std::string& codec,
                            int64_t block_size, const std::string& schedule = "ring", int64_t keep = 0,
                            int64_t keep_average = 0) {
  TORCH_CHECK(schedule == "ring" || schedule == "direct", "internal: schedule '", schedule,
              "' reached the ring unchecked (prime.comm.Ring.all_reduce chooses it)");
  TORCH_CHECK((op == "sum" || op == "avg") && (codec == "int8" || codec == "fp4" || codec == "topk" || codec == "none"),
              "internal: op '", op, "' / codec '", codec,
              "' reached the ring unchecked (prime.comm.Ring.all_reduce checks them)");
  ring::AllReduceSpec spec;
  if (codec == "topk") {
    if (keep_average == 0) keep_average = keep;
    TORCH_CHECK(codec::sparse::valid_chunk(block_size) && codec::sparse::valid_keep(block_size, keep) &&
                    codec::sparse::valid_keep(block_size, keep_average),
                "internal: topk chunk ", std::to_string(block_size), " / k ", std::to_string(keep), " / k of the average ",
                std::to_string(keep_average), " reached the ring unchecked");
    TORCH_CHECK(tensor.scalar_type() == at::kFloat, "the topk codec takes float32 tensors, got ",
                tensor.scalar_type());
    spec.keep = keep;
    spec.keep_average = keep_average;
  } else {
    codec::check_block_size(block_size);
  }
  spec.dtype = dtype_of(tensor);
  spec.op = op == "sum" ? ring::ReduceOp::kSum : ring::ReduceOp::kAvg;
  spec.codec = codec == "int8"   ? ring::CodecKind::kInt8
               : codec == "fp4"  ? ring::CodecKind::kFp4
               : codec == "topk" ? ring::CodecKind::kTopk
                                 : ring::CodecKind::kNone;
  spec.block = block_size;
  spec.n = tensor.numel();
  spec.schedule = schedule == "direct" ? ring::Schedule::kDirect : ring::Schedule::kRing;
  return spec;
}

// What a queued collective keeps alive until it finishes.
struct Staging {
  at::Tensor target;  // the caller's tensor
  at::Tensor input;   // contiguous CPU values read by the ring
  at::Tensor output;  // contiguous CPU values the ring writes; copied into target on success
  at::Tensor residual;  // topk: where the owner adds what its selection of a sum dropped
};

#ifdef PRIME_WITH_CUDA
// A CUDA tensor reduced on its GPU (wire_codec_cuda.h): the ring reads and writes device
// memory on its own stream, after an event recorded on the caller's current stream.
void stage_on_device(AllReduceJob& job, Staging& staging, const std::shared_ptr<ring::CudaContext>& context) {
  const at::Tensor& t = staging.target;
  TORCH_CHECK(t.is_cuda() && t.device().index() == context->device(), "internal: a tensor on ", t.device().str(),
              " with the ring's CUDA context of device ", std::to_string(context->device()));
  const int64_t n = t.numel();
  const c10::cuda::CUDAGuard guard(t.device());
  py::gil_scoped_release no_gil;
  const auto s0 = std::chrono::steady_clock::now();
  if (t.is_contiguous()) {
    staging.input = t.view({n});
    job.direct = t.data_ptr();
  } else {
    staging.input = t.reshape({n}).contiguous();  // a device copy, on the caller's stream
    staging.output = at::empty({n}, t.options());
  }
  auto cuda = std::make_shared<ring::CudaJob>();
  cuda->context = context;
  cuda->pageable_upload = context->pageable_upload();
  C10_CUDA_CHECK(cudaEventCreateWithFlags(&cuda->input_ready, cudaEventDisableTiming));
  C10_CUDA_CHECK(cudaEventRecord(cuda->input_ready, c10::cuda::getCurrentCUDAStream(t.device().index()).stream()));
  job.spec.cuda = std::move(cuda);
  job.stage_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - s0).count();
}
#endif

std::shared_ptr<Work> submit(Ring& ring, const at::Tensor& tensor, const std::string& op, const std::string& codec,
                             int64_t block_size, const py::object& cuda_context, const std::string& schedule,
                             int64_t keep, const std::optional<at::Tensor>& residual, int64_t keep_average,
                             bool residual_scratch) {
  AllReduceJob job;
  job.spec = spec_of(tensor, op, codec, block_size, schedule, keep, keep_average);
  TORCH_CHECK(tensor.device().is_cpu() || tensor.device().is_cuda(), "all_reduce supports CPU and CUDA tensors, got ",
              tensor.device().str());

  auto staging = std::make_shared<Staging>();
  staging->target = tensor.detach();
  if (residual) {
    TORCH_CHECK(codec == "topk", "internal: a residual for codec '", codec, "'");
    const at::Tensor& r = *residual;
    // On the tensor's GPU when the ring reduces it there, else in host memory.
    const bool on_device = !cuda_context.is_none();
    TORCH_CHECK((on_device ? r.device() == tensor.device() : r.device().is_cpu()) && r.scalar_type() == at::kFloat &&
                    r.is_contiguous() && r.numel() == tensor.numel(),
                "the residual must be a contiguous float32 tensor of the tensor's ", std::to_string(tensor.numel()),
                " values on ", on_device ? tensor.device().str() : std::string("the CPU"));
    staging->residual = r.detach();
    job.spec.residual = staging->residual.data_ptr<float>();
    job.spec.residual_scratch = residual_scratch;
  }
  const int64_t n = tensor.numel();
  if (!cuda_context.is_none()) {
#ifdef PRIME_WITH_CUDA
    stage_on_device(job, *staging, cuda_context.cast<std::shared_ptr<ring::CudaContext>>());
    job.spec.input = staging->input.data_ptr();
    job.spec.output = staging->output.defined() ? staging->output.data_ptr() : nullptr;
    job.commit = [s = staging.get()]() {
      at::NoGradGuard no_grad;
      const c10::cuda::CUDAGuard guard(s->target.device());
      s->target.copy_(s->output.view(s->target.sizes()));
      c10::cuda::getCurrentCUDAStream(s->target.device().index()).synchronize();  // done when wait() returns
    };
    job.keep_alive = staging;
    return ring.all_reduce(std::move(job));
#else
    TORCH_CHECK(false, "internal: a CUDA context in a build without CUDA");
#endif
  }
  {
    py::gil_scoped_release no_gil;  // a device-to-host copy can take a while
    const auto s0 = std::chrono::steady_clock::now();
    const bool cuda = tensor.is_cuda();
    auto host = tensor.options().device(at::kCPU).pinned_memory(cuda);
    if (!cuda && tensor.is_contiguous()) {
      staging->input = staging->target.view({n});  // read in place, never written
    } else {
      // CUDA: staged through pinned host memory (the codec then runs on the CPU; GPU
      // codec kernels could quantize on the device instead). Strided: a dense copy.
      staging->input = at::empty({n}, host);
      staging->input.copy_(staging->target.reshape({n}));
    }
    if (!cuda && tensor.is_contiguous()) {
      // The ring decodes the result straight into the tensor once every check passed.
      job.direct = staging->target.data_ptr();
      job.spec.early_output = job.direct;
    } else {
      staging->output = at::empty({n}, host);
    }
    job.stage_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - s0).count();
  }
  job.spec.input = staging->input.data_ptr();
  // (An empty tensor's data pointer may be null: test the staging tensor, not `direct`.)
  job.spec.output = staging->output.defined() ? staging->output.data_ptr() : nullptr;
  job.commit = [s = staging.get()]() {
    at::NoGradGuard no_grad;
    s->target.copy_(s->output.view(s->target.sizes()));
  };
  job.keep_alive = staging;
  return ring.all_reduce(std::move(job));
}

}  // namespace

void init_ring_bindings(py::module_& m) {
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const CommError& e) {
      py::object error = py::module_::import("prime.comm.errors").attr("error_from_info")(info_to_dict(e.info()));
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(error.ptr())), error.ptr());
    }
  });

  py::class_<Work, std::shared_ptr<Work>>(m, "_Work", "Handle of one queued all-reduce (see prime.comm.Work).")
      .def_property_readonly("seq", &Work::seq)
      .def(
          "wait",
          [](Work& w, double timeout_s) {
            py::gil_scoped_release no_gil;
            return w.wait_for(ring::Millis(timeout_s < 0 ? -1 : static_cast<int64_t>(timeout_s * 1000)));
          },
          py::arg("timeout_s"), "Waits up to timeout_s seconds (negative: forever); returns completion.")
      .def("is_completed", &Work::completed)
      .def(
          "error",
          [](const Work& w) -> py::object {
            auto e = w.error();
            if (!e) return py::none();
            return info_to_dict(*e);
          },
          "None, or a dict describing the failure.")
      .def("stats", [](const Work& w) { return stats_to_dict(w.stats()); });

  m.def(
      "_ring_timers",
      []() {
        py::list out;
        for (const auto& t : ring::kTimers) out.append(py::make_tuple(t.name, t.description));
        return out;
      },
      "[(name, description)] of every timer of a Work's stats(), in seconds, in their order "
      "(csrc/ring/timers.h; prime.comm.WorkStats's timer fields).");

  py::class_<Ring, std::shared_ptr<Ring>>(m, "_Ring", "One rank's end of the TCP ring (see prime.comm.Ring).")
      .def(py::init([](int rank, int world_size, const std::string& job_id, py::bytes secret, double timeout_s, double rendezvous_timeout_s,
                       int streams, double max_rate, bool encrypt, int64_t segment_elems,
                       const std::string& bind_addr, int socket_buffer_bytes, int64_t corrupt_after_bytes,
                       bool measure_quant_error, bool restart_bbr) {
             RingOptions o;
             o.rank = rank;
             o.world_size = world_size;
             o.job_id = job_id;
             o.secret = std::string(secret);
             o.timeout_ms = static_cast<int64_t>(timeout_s * 1000);
             o.rendezvous_timeout_ms = static_cast<int64_t>(rendezvous_timeout_s * 1000);
             o.streams = streams;
             o.max_rate = max_rate;
             o.encrypt = encrypt;
             o.segment_elems = segment_elems;
             o.bind_addr = bind_addr;
             o.socket_buffer_bytes = socket_buffer_bytes;
             o.corrupt_after_bytes = corrupt_after_bytes;
             o.measure_quant_error = measure_quant_error;
             o.restart_bbr = restart_bbr;
             py::gil_scoped_release no_gil;
             return std::make_shared<Ring>(std::move(o));
           }),
           py::arg("rank"), py::arg("world_size"), py::arg("job_id"), py::arg("secret"), py::arg("timeout_s"),
           py::arg("rendezvous_timeout_s"), py::arg("streams"), py::arg("max_rate"), py::arg("encrypt"), py::arg("segment_elems"),
           py::arg("bind_addr"), py::arg("socket_buffer_bytes"), py::arg("corrupt_after_bytes"),
           py::arg("measure_quant_error") = true, py::arg("restart_bbr") = true)
      .def_property_readonly("port", &Ring::port)
      .def(
          "connect",
          [](Ring& r, const std::vector<std::pair<std::string, int>>& addresses) {
            std::vector<ring::Address> a;
            for (const auto& [host, port] : addresses) a.push_back(ring::Address{host, port});
            py::gil_scoped_release no_gil;
            r.connect(a);
          },
          py::arg("addresses"), "Forms the links to every rank: addresses[r] = (host, port) of rank r.")
      .def("set_order", &Ring::set_order, py::arg("order"))
      .def("order", &Ring::order)
      .def(
          "links",
          [](const Ring& r) {
            py::list out;
            for (const ring::LinkReport& l : r.links()) {
              py::dict d;
              d["peer"] = l.peer;
              d["streams"] = l.streams;
              d["wanted"] = l.wanted;
              d["sndbuf"] = l.sndbuf;
              d["handshake_rtt_s"] = l.handshake_rtt_s;
              d["rtt_s"] = l.rtt_s;
              d["rate"] = l.rate;
              d["limited_share"] = l.limited_share;
              d["needed_inflight"] = l.needed_inflight;
              d["bytes_sent"] = l.bytes_sent;
              d["stream_bytes"] = l.stream_bytes;
              d["changes"] = l.changes;
              d["uplink_rate"] = l.uplink_rate;
              d["pacing_rate"] = l.pacing_rate;
              d["retransmits"] = l.retransmits;
              d["paced"] = l.paced;
              d["inflight_cap"] = l.inflight_cap;
              d["probe_rtts"] = l.probe_rtts;
              d["bbr_restarts"] = l.bbr_restarts;
              d["peak_rate"] = l.peak_rate;
              d["peak_srtt_s"] = l.peak_srtt_s;
              out.append(d);
            }
            return out;
          },
          "What this rank knows of its outgoing links, one dict per peer.")
      .def("rejected_connections", &Ring::rejected_connections)
      .def("all_reduce", &submit, py::arg("tensor"), py::arg("op"), py::arg("codec"), py::arg("block_size"),
           py::arg("cuda_context") = py::none(), py::arg("schedule") = "ring", py::arg("keep") = 0,
           py::arg("residual") = py::none(), py::arg("keep_average") = 0, py::arg("residual_scratch") = false)
      .def("close", &Ring::close, py::call_guard<py::gil_scoped_release>());

#ifdef PRIME_WITH_CUDA
  py::class_<ring::CudaContext, std::shared_ptr<ring::CudaContext>>(
      m, "_CudaRingContext", "A ring's stream and staging on one GPU (csrc/ring/wire_codec_cuda.h).")
      .def(py::init<int>(), py::arg("device"))
      .def_property_readonly("device", &ring::CudaContext::device)
      .def_property_readonly("device_bytes", &ring::CudaContext::device_bytes)
      .def_property("pageable_upload", &ring::CudaContext::pageable_upload, &ring::CudaContext::set_pageable_upload);
  m.def(
      "_ring_cuda_kernel_times",
      [](int device, int64_t n, int64_t block, int iters) {
        std::vector<ring::KernelTiming> t;
        {
          py::gil_scoped_release no_gil;
          t = ring::time_kernels(device, n, block, iters);
        }
        py::list out;
        for (const auto& k : t) out.append(py::make_tuple(k.name, k.bytes, k.ms));
        return out;
      },
      py::arg("device"), py::arg("n"), py::arg("block"), py::arg("iters"),
      "[(name, bytes moved, [ms per run])] for each kernel and copy of the GPU wire codec "
      "(benchmarks/bench_ring_cuda_kernels.py).");
#endif
  m.attr("_ring_reduces_on_gpu") = py::bool_(
#ifdef PRIME_WITH_CUDA
      true
#else
      false
#endif
  );

  // Test hooks for the primitives (compared against hashlib / known vectors).
  m.def("_ring_crc32c", [](py::buffer b, bool portable) {
    const py::buffer_info info = b.request();  // no copy: also used to time the checksum
    const size_t n = static_cast<size_t>(info.size * info.itemsize);
    py::gil_scoped_release no_gil;
    return portable ? ring::crc32c_portable(info.ptr, n) : ring::crc32c(info.ptr, n);
  });
  m.def("_ring_crc32c_hardware", &ring::crc32c_uses_hardware);
  m.def("_ring_hmac_sha256", [](py::bytes key, py::bytes msg) {
    const std::string k(key), s(msg);
    const ring::Digest d = ring::hmac_sha256(k, s.data(), s.size());
    return py::bytes(reinterpret_cast<const char*>(d.data()), d.size());
  });
  m.def("_ring_sha256", [](py::bytes msg) {
    const std::string s(msg);
    const ring::Digest d = ring::sha256(s.data(), s.size());
    return py::bytes(reinterpret_cast<const char*>(d.data()), d.size());
  });
  m.def("_ring_hkdf_sha256", [](py::bytes ikm, py::bytes salt, py::bytes info, size_t length) {
    const std::string okm = ring::hkdf_sha256(std::string(ikm), std::string(salt), std::string(info), length);
    return py::bytes(okm);
  });
  m.def("_ring_libcrypto", []() {
    const auto& c = ring::crypto::libcrypto();
    return std::string(c.soname) + ": " + c.version_text(0);
  }, "Which libcrypto the ring loaded (raises if none can be loaded).");
  m.def("_ring_job_hash", &ring::job_hash);
  m.def("_ring_lost_to_own_queue", &ring::lost_to_own_queue, py::arg("retransmits"), py::arg("peak_srtt_s"),
        py::arg("min_rtt_s"));

  // Test hooks for the payload layout: the wire codec's bytes for one segment of a
  // contiguous CPU tensor (encode_input of reduce-scatter step 0, and encode_final of
  // the owner from fp32 values), and its decode. tests/test_golden.py holds them
  // against a layout built by hand from docs/wire-format.md.
  m.def("_ring_encode_input", [](const at::Tensor& x, const std::string& codec, int64_t block_size) {
    TORCH_CHECK(x.device().is_cpu() && x.is_contiguous(), "a contiguous CPU tensor");
    ring::AllReduceSpec spec = spec_of(x, "sum", codec, block_size);
    auto pool = ring::BufferPool::create(0);
    ring::ScheduleTimes times;
    bool finite = true;
    const ring::Payload p = ring::make_wire_codec(spec, *pool, times)->encode_input(x.data_ptr(), spec.n, &finite);
    return py::make_tuple(py::bytes(p.data, p.size), finite);
  });
  m.def("_ring_encode_final", [](const at::Tensor& sum, const std::string& dtype_name, const std::string& codec,
                                 int64_t block_size) {
    TORCH_CHECK(sum.device().is_cpu() && sum.is_contiguous() && sum.scalar_type() == at::kFloat,
                "a contiguous CPU float32 tensor");
    TORCH_CHECK_VALUE(dtype_name == "float32" || dtype_name == "bfloat16" || dtype_name == "float16",
                      "dtype_name must be float32, bfloat16 or float16, got ", dtype_name);
    const at::ScalarType dtype = dtype_name == "float32" ? at::kFloat : dtype_name == "bfloat16" ? at::kBFloat16 : at::kHalf;
    ring::AllReduceSpec spec = spec_of(at::empty({sum.numel()}, sum.options().dtype(dtype)), "sum", codec, block_size);
    auto pool = ring::BufferPool::create(0);
    ring::ScheduleTimes times;
    ring::Buffer acc = pool->acquire(static_cast<size_t>(spec.n) * 4);
    if (spec.n) std::memcpy(acc->data(), sum.data_ptr(), acc->size());
    bool finite = true;
    const ring::Payload p = ring::make_wire_codec(spec, *pool, times)->encode_final(acc, spec.n, &finite);
    return py::make_tuple(py::bytes(p.data, p.size), finite);
  });
  m.def("_ring_decode_final", [](py::bytes payload, at::Tensor out, const std::string& codec, int64_t block_size) {
    TORCH_CHECK(out.device().is_cpu() && out.is_contiguous(), "a contiguous CPU tensor");
    ring::AllReduceSpec spec = spec_of(out, "sum", codec, block_size);
    auto pool = ring::BufferPool::create(0);
    ring::ScheduleTimes times;
    auto wire = ring::make_wire_codec(spec, *pool, times);
    const std::string bytes(payload);
    TORCH_CHECK_VALUE(static_cast<int64_t>(bytes.size()) == wire->final_bytes(spec.n), "payload of ",
                      std::to_string(bytes.size()), " bytes, expected ", std::to_string(wire->final_bytes(spec.n)));
    std::vector<float> scratch(static_cast<size_t>(wire->scratch_floats(spec.n)));
    wire->decode_final(bytes.data(), spec.n, out.data_ptr(), scratch.empty() ? nullptr : scratch.data());
    return out;
  });

  // The codec at a global element offset: `first_index` is the flattened index of x[0]
  // (keys stochastic rounding), so tests reach indices >= 2^32 without a 16 GiB tensor.
  m.def(
      "_codec_quantize_at",
      [](const at::Tensor& x, int64_t block_size, int64_t seed, int64_t first_index, const std::string& codec) {
        codec::check_block_size(block_size);
        TORCH_CHECK(x.device().is_cpu() && x.is_contiguous(), "a contiguous CPU tensor");
        TORCH_CHECK_VALUE(first_index >= 0 && first_index % block_size == 0,
                          "first_index must be a multiple of block_size");
        TORCH_CHECK_VALUE(codec == "int8" || codec == "fp4", "codec must be int8 or fp4, got ", codec);
        const codec::InputType type = codec::input_type(x);
        const int64_t n = x.numel();
        const bool fp4 = codec == "fp4";
        at::Tensor q = at::empty({fp4 ? codec::fp4_bytes(n) : n}, x.options().dtype(fp4 ? at::kByte : at::kChar));
        at::Tensor scales = at::empty({codec::num_blocks(n, block_size)}, x.options().dtype(at::kFloat));
        if (fp4) {
          codec::quantize_fp4_range(x.data_ptr(), type, n, block_size, q.data_ptr<uint8_t>(), scales.data_ptr<float>(),
                                    codec::seed_of(seed), first_index);
        } else {
          codec::quantize_range(x.data_ptr(), type, n, block_size, q.data_ptr<int8_t>(), scales.data_ptr<float>(),
                                codec::seed_of(seed), first_index);
        }
        return py::make_tuple(q, scales);
      },
      py::arg("x"), py::arg("block_size"), py::arg("seed"), py::arg("first_index"), py::arg("codec") = "int8");
}

}  // namespace prime
