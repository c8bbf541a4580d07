// hsx_native.cc: the Python client's native receive path, the module hsx._native.
//
// grpcio hands every response message to Python as a bytes object: receiving
// and dropping a stream that way alone costs 1.41 CPU-ns per byte, 2.3 times
// all of hsx-dump --discard (bench/python_ab.py --floor, docs/BENCHMARKS.md).
// This module runs an Extract call with gRPC's C++ client and hsx's
// StreamAssembler (the checks hsx-dump runs; each chunk is checked, hashed
// and copied into the [T, L, H] sample 16 KiB at a time: fp8 rows dequantized
// to bf16 as they arrive (kAssembleDequantized), or with dequantize=False
// split into e4m3 values and float32 scales, the file's layout (kAssemble))
// with the GIL released, and hands the tensors to Python as writable buffers
// that numpy wraps without a copy. Requests, retries,
// concurrency and the Sample stay in hsx/client.py, which uses its own
// decoder when this module is not built (client/README.md, "Two receive
// paths").
//
// Guarantees: an outcome is "ok" only for a stream the assembler accepted
// whole (trailer included) whose values pass CheckSampleValues; "data_loss"
// names what was wrong; "rpc" carries the call's gRPC status unchanged, so
// that the Python side retries exactly what it retries for grpcio.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include <grpcpp/grpcpp.h>
#include <grpcpp/impl/client_unary_call.h>
#include <grpcpp/support/sync_stream.h>

#include "base/cli.h"
#include "format/encoding.h"
#include "format/fp8.h"
#include "format/sample_file.h"
#include "format/state_bytes_pool.h"
#include "format/stream_assembler.h"

namespace py = pybind11;

namespace hsx {
namespace {

// One tensor's bytes in the assembler's block, lent to numpy through the
// buffer protocol; `owner` keeps the block alive. Writable: the block is this
// sample's alone.
struct TensorBytes {
  std::shared_ptr<const void> owner;
  char* data = nullptr;
  size_t size = 0;
};

// What became of one stream (see the file comment).
struct Outcome {
  std::string kind = "ok";  // "ok" | "data_loss" | "rpc"
  int code = 0;             // the gRPC status code ("rpc")
  std::string message;
  std::vector<int> capture_ids;
  int64_t tokens = 0;
  int64_t hidden = 0;
  std::shared_ptr<TensorBytes> hidden_states;  // [tokens, layers, hidden]
  std::shared_ptr<TensorBytes> final_norm;     // [tokens, hidden], or none
  // fp8 not dequantized: the float32 scales, [tokens, layers] and [tokens]
  // (with the final norm); else none.
  std::shared_ptr<TensorBytes> hidden_scales;
  std::shared_ptr<TensorBytes> final_scales;
};

Outcome DataLoss(std::string message) {
  Outcome o;
  o.kind = "data_loss";
  o.message = std::move(message);
  return o;
}

// The block of `bytes` bytes that `piece` (one of the sample's pieces, or
// none) starts, which the sample owns.
std::shared_ptr<TensorBytes> Block(const SampleTensors& sample, const BytePiece* piece, int64_t bytes) {
  char* data = piece != nullptr ? const_cast<char*>(reinterpret_cast<const char*>(piece->data())) : nullptr;
  return std::make_shared<TensorBytes>(TensorBytes{sample.owner, data, static_cast<size_t>(bytes)});
}

// A verified sample's tensors as the assembler laid them out
// (stream_assembler.h): layer 0's first row starts the [T, L, H] block, the
// final norm's its block; fp8 rows as received have two pieces, the scale
// first, then the values; fp8 dequantized on arrival (kAssembleDequantized)
// is bf16 rows.
void HandOn(const SampleTensors& sample, bool dequantized, Outcome* o) {
  const bool raw_fp8 = sample.dtype == OutputDType::kFp8 && !dequantized;
  const int64_t layers = static_cast<int64_t>(sample.capture_ids.size());
  const int64_t row = sample.dtype != OutputDType::kFp8 ? sample.row_bytes() : sample.hidden * (raw_fp8 ? 1 : 2);
  const int64_t values = sample.tokens * row;
  const int64_t scales = sample.tokens * kFp8ScaleBytes;
  // Piece k of the first layer's or the final norm's first row (none without one).
  auto piece = [&sample, layers](bool final_norm, size_t k) -> const BytePiece* {
    if (final_norm ? !sample.has_final_norm() : layers == 0) return nullptr;
    const SampleTensor& tensor = final_norm ? sample.tensors.back() : sample.tensors.front();
    return tensor.pieces.size() > k ? &tensor.pieces[k] : nullptr;
  };
  o->hidden_states = Block(sample, piece(false, raw_fp8 ? 1 : 0), layers * values);
  if (sample.has_final_norm()) o->final_norm = Block(sample, piece(true, raw_fp8 ? 1 : 0), values);
  if (!raw_fp8) return;
  o->hidden_scales = Block(sample, piece(false, 0), layers * scales);
  if (sample.has_final_norm()) o->final_scales = Block(sample, piece(true, 0), scales);
}

// The assembler's mode for an Extract whose fp8 is (or is not) to be dequantized.
StreamAssembler::Mode AssemblyMode(bool dequantize) {
  return dequantize ? StreamAssembler::Mode::kAssembleDequantized : StreamAssembler::Mode::kAssemble;
}

// The verdict on a stream that ended (as remote_extractor.cc's Attempt::OnDone
// judges one): the assembler's error first (it cancelled the call), then the
// call's status, then completeness, then the values.
Outcome Judge(StreamAssembler& assembler, const absl::Status& error, const grpc::Status& status, bool dequantize) {
  if (!error.ok()) return DataLoss(std::string(error.message()));
  if (!status.ok()) {
    Outcome o;
    o.kind = "rpc";
    o.code = static_cast<int>(status.error_code());
    o.message = status.error_message();
    return o;
  }
  if (absl::Status end = assembler.EndOfStream(); !end.ok()) return DataLoss(std::string(end.message()));
  SampleTensors sample = assembler.Take();
  if (absl::Status s = CheckSampleValues(sample); !s.ok()) return DataLoss(std::string(s.message()));
  Outcome o;
  o.capture_ids = sample.capture_ids;
  o.tokens = sample.tokens;
  o.hidden = sample.hidden;
  HandOn(sample, dequantize, &o);
  return o;
}

// Python's StreamExpectation, as the dict hsx/client.py's _native_expectation makes.
StreamExpectation MakeExpectation(const py::dict& e) {
  StreamExpectation x;
  x.sample_id = e["sample_id"].cast<std::string>();
  x.num_tokens = e["num_tokens"].cast<int64_t>();
  x.token_ids_xxh64 = e["token_ids_xxh64"].cast<uint64_t>();
  x.capture_ids = e["capture_ids"].cast<std::vector<int>>();
  x.final_norm = e["final_norm"].cast<std::optional<bool>>();
  absl::StatusOr<OutputDType> dtype = ParseOutputDType(e["dtype"].cast<std::string>());
  if (!dtype.ok()) throw py::value_error(std::string(dtype.status().message()));
  x.dtype = *dtype;
  const std::optional<ChecksumKind> checksum = ParseChecksumKind(e["checksum"].cast<std::string>());
  if (!checksum) throw py::value_error("unknown checksum " + e["checksum"].cast<std::string>());
  x.checksum = *checksum;
  x.hidden_size = e["hidden_size"].cast<int64_t>();
  x.num_layers = e["num_layers"].cast<int64_t>();
  x.model_name = e["model_name"].cast<std::string>();
  return x;
}

grpc::ByteBuffer ToByteBuffer(const std::string& bytes) {
  grpc::Slice slice(bytes);
  return grpc::ByteBuffer(&slice, 1);
}

// The outcome of a stream given as its messages' bytes and its end status,
// without a server: what the shared malformed-stream table feeds
// (tests/python/test_stream_table.py), through the same Consume and Judge.
Outcome Replay(const std::vector<std::string>& messages, int end_code, const std::string& end_message,
               const py::dict& expect, bool dequantize) {
  StreamAssembler assembler(MakeExpectation(expect), AssemblyMode(dequantize));
  py::gil_scoped_release release;
  absl::Status error;
  for (const std::string& bytes : messages) {
    error = assembler.Consume(ToByteBuffer(bytes));
    if (!error.ok()) break;
  }
  return Judge(assembler, error, grpc::Status(static_cast<grpc::StatusCode>(end_code), end_message), dequantize);
}

// gRPC's receive buffers are malloc'ed and freed per read, and many are over
// glibc's initial mmap threshold (128 KiB): each is then mapped, page-faulted
// in by the kernel's copy and unmapped again, 0.2-0.3 CPU-ns per byte here
// (docs/BENCHMARKS.md). glibc raises the threshold by itself once a program
// frees a large mapped block, but the pooled sample blocks are never freed,
// so nothing here would. So: blocks under 4 MiB (gRPC's buffers) come from
// the heap and are reused, larger ones (the pool's) are still mapped; up to
// 64 MiB of free heap top is kept (measured: with 8 MiB the heap is trimmed
// and grown again all the time, 2.5 times the page faults of 64 MiB); and at
// most kMallocArenas arenas: a thread allocates from the arena it first took
// for good, gRPC's threads take one each by default, and each arena's heap
// is faulted in on its own (a 32-sample run: 13 arenas, 41k-50k faults; two
// arenas, 11k). glibc limits only arenas made after the call: hence once,
// when the first Channel is made, before it starts gRPC's threads.
// HSX_NATIVE_MALLOPT=0 in the environment leaves glibc's settings alone, for
// a process that tunes its own allocator.
constexpr int kMallocArenas = 2;

void TuneMalloc() {
#if defined(__GLIBC__)
  static const bool once = [] {
    const char* setting = std::getenv("HSX_NATIVE_MALLOPT");
    if (setting != nullptr && std::string_view(setting) == "0") return false;
    mallopt(M_MMAP_THRESHOLD, 4 << 20);
    mallopt(M_TRIM_THRESHOLD, 64 << 20);
    mallopt(M_ARENA_MAX, kMallocArenas);
    return true;
  }();
  (void)once;
#endif
}

// Idle blocks a Channel keeps for the next samples (StateBytesPool): a few
// samples' worth at Kimi-K2's EAGLE-3 capture (2048 tokens x 4 x 7168 bf16 =
// 117 MB), freed by close().
constexpr size_t kPoolIdleBytes = size_t{512} << 20;

// A connection to one hsx-server for Extract and GetModelInfo calls, safe to
// call from many Python threads at once (each call runs on its caller's
// thread, GIL released).
// Samples are assembled into blocks from a pool: the arrays of a sample the
// caller dropped give their memory to the next samples, which then write
// into pages already mapped (state_bytes_pool.h says what that saves).
class Channel {
 public:
  Channel(const std::string& target, bool tls, const std::string& ca, const std::string& cert,
          const std::string& key, const std::vector<std::pair<std::string, py::object>>& options)
      : method_("/hsx.v1.HiddenStates/Extract", grpc::internal::RpcMethod::SERVER_STREAMING) {
    TuneMalloc();
    grpc::ChannelArguments args;
    for (const auto& [name, value] : options) {
      if (py::isinstance<py::bool_>(value) || py::isinstance<py::int_>(value)) {
        args.SetInt(name, value.cast<int>());
      } else if (py::isinstance<py::str>(value)) {
        args.SetString(name, value.cast<std::string>());
      } else {
        throw py::type_error("channel option " + name + ": expected an int or a str");
      }
    }
    std::shared_ptr<grpc::ChannelCredentials> credentials = grpc::InsecureChannelCredentials();
    if (tls) {
      grpc::SslCredentialsOptions ssl;
      ssl.pem_root_certs = ca;
      ssl.pem_cert_chain = cert;
      ssl.pem_private_key = key;
      credentials = grpc::SslCredentials(ssl);
    }
    channel_ = grpc::CreateCustomChannel(target, credentials, args);
  }

  // Runs one Extract call (`request`: a serialized ExtractRequest, sent as
  // it is) and verifies its stream against `expect`; an fp8 sample is
  // dequantized to bf16 when `dequantize`.
  Outcome Extract(const py::bytes& request_bytes, const py::dict& expect, double timeout, const std::string& token,
                  bool dequantize) {
    const grpc::ByteBuffer request = ToByteBuffer(std::string(request_bytes));
    StreamAssembler assembler(MakeExpectation(expect), AssemblyMode(dequantize), pool_);
    py::gil_scoped_release release;
    grpc::ClientContext context;
    if (!Register(&context, timeout, token)) return Judge(assembler, absl::OkStatus(), Closed(), dequantize);
    std::unique_ptr<grpc::ClientReader<grpc::ByteBuffer>> reader(
        grpc::internal::ClientReaderFactory<grpc::ByteBuffer>::Create(channel_.get(), method_, &context, request));
    absl::Status error;
    grpc::ByteBuffer message;
    while (reader->Read(&message)) {
      if (error.ok()) {
        error = assembler.Consume(message);
        if (!error.ok()) context.TryCancel();  // the rest of the stream is read and dropped
      }
      message.Clear();  // the received slices go back to gRPC
    }
    const grpc::Status status = reader->Finish();
    Unregister(&context);
    return Judge(assembler, error, status, dequantize);
  }

  // Runs one unary call of `method` (e.g. "/hsx.v1.HiddenStates/GetModelInfo")
  // with a serialized request: (status code, status message, serialized
  // response). The client's other calls share this connection, so a client
  // holds one per server.
  py::tuple Unary(const std::string& method, const py::bytes& request_bytes, double timeout, const std::string& token) {
    const grpc::ByteBuffer request = ToByteBuffer(std::string(request_bytes));
    grpc::ByteBuffer response;
    grpc::Status status;
    {
      py::gil_scoped_release release;
      grpc::ClientContext context;
      if (Register(&context, timeout, token)) {
        status = grpc::internal::BlockingUnaryCall<grpc::ByteBuffer, grpc::ByteBuffer>(
            channel_.get(), grpc::internal::RpcMethod(method.c_str(), grpc::internal::RpcMethod::NORMAL_RPC), &context,
            request, &response);
        Unregister(&context);
      } else {
        status = Closed();
      }
    }
    std::string bytes;
    if (status.ok()) {
      std::vector<grpc::Slice> slices;
      if (!response.Dump(&slices).ok()) status = grpc::Status(grpc::StatusCode::INTERNAL, "unreadable response");
      for (const grpc::Slice& slice : slices) bytes.append(reinterpret_cast<const char*>(slice.begin()), slice.size());
    }
    return py::make_tuple(static_cast<int>(status.error_code()), status.error_message(), py::bytes(bytes));
  }

  // Cancels every call in flight (they end CANCELLED); later calls fail at
  // once. Frees the idle blocks (arrays still held keep theirs).
  void Close() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      closed_ = true;
      for (grpc::ClientContext* context : active_) context->TryCancel();
    }
    pool_->Clear();
  }

 private:
  // Sets the call's deadline and token, and records it for Close; false once
  // the channel is closed.
  bool Register(grpc::ClientContext* context, double timeout, const std::string& token) {
    context->set_deadline(std::chrono::system_clock::now() +
                          std::chrono::duration_cast<std::chrono::system_clock::duration>(
                              std::chrono::duration<double>(timeout)));
    if (!token.empty()) context->AddMetadata("authorization", "Bearer " + token);
    std::lock_guard<std::mutex> lock(mutex_);
    if (closed_) return false;
    active_.insert(context);
    return true;
  }
  static grpc::Status Closed() { return grpc::Status(grpc::StatusCode::CANCELLED, "the client was closed"); }
  void Unregister(grpc::ClientContext* context) {
    std::lock_guard<std::mutex> lock(mutex_);
    active_.erase(context);
  }

  const grpc::internal::RpcMethod method_;
  std::shared_ptr<grpc::Channel> channel_;
  const std::shared_ptr<StateBytesPool> pool_ = StateBytesPool::Create(kPoolIdleBytes);
  std::mutex mutex_;
  bool closed_ = false;
  std::set<grpc::ClientContext*> active_;
};

}  // namespace
}  // namespace hsx

PYBIND11_MODULE(_native, m) {
  using hsx::Channel;
  using hsx::Outcome;
  using hsx::TensorBytes;
  m.doc() = "hsx's native receive path (client/python/native/hsx_native.cc); used by hsx.Client when built.";
  // This module's Abseil (Debian's shared one, which Python's grpcio does not
  // use) serves only it and its gRPC.
  hsx::SkipMutexDeadlockDetection();
  py::class_<TensorBytes, std::shared_ptr<TensorBytes>>(m, "TensorBytes", py::buffer_protocol())
      .def_buffer([](TensorBytes& t) {
        return py::buffer_info(t.data, 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(t.size)}, {1}, /*readonly=*/false);
      });
  py::class_<Outcome>(m, "Outcome")
      .def_readonly("kind", &Outcome::kind)
      .def_readonly("code", &Outcome::code)
      .def_readonly("message", &Outcome::message)
      .def_readonly("capture_ids", &Outcome::capture_ids)
      .def_readonly("tokens", &Outcome::tokens)
      .def_readonly("hidden", &Outcome::hidden)
      .def_readonly("hidden_states", &Outcome::hidden_states)
      .def_readonly("final_norm", &Outcome::final_norm)
      .def_readonly("hidden_scales", &Outcome::hidden_scales)
      .def_readonly("final_scales", &Outcome::final_scales);
  py::class_<Channel>(m, "Channel")
      .def(py::init<const std::string&, bool, const std::string&, const std::string&, const std::string&,
                    const std::vector<std::pair<std::string, py::object>>&>(),
           py::arg("target"), py::arg("tls") = false, py::arg("ca") = "", py::arg("cert") = "", py::arg("key") = "",
           py::arg("options") = std::vector<std::pair<std::string, py::object>>{})
      .def("extract", &Channel::Extract, py::arg("request"), py::arg("expect"), py::arg("timeout"),
           py::arg("token") = "", py::arg("dequantize") = true)
      .def("unary", &Channel::Unary, py::arg("method"), py::arg("request"), py::arg("timeout"), py::arg("token") = "")
      .def("close", &Channel::Close);
  m.def("replay", &hsx::Replay, py::arg("messages"), py::arg("end_code"), py::arg("end_message"), py::arg("expect"),
        py::arg("dequantize") = true);
}
