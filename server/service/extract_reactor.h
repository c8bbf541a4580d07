// extract_reactor.h: one Extract stream, from the batcher's result to the
// last message.
//
// Life cycle. The service creates the reactor and queues the sample; the
// batcher later calls Deliver() on its own thread with the sample's rows in
// the batch's capture buffers. Deliver() encodes the whole sample at once
// into the output dtype (checks and checksums in the same pass, see
// ResponseEncoder), lets go of the rows it does not send from (so the
// batch's capture buffers go back to their pool as soon as every sample of
// the batch is delivered) and starts the first write (the Header); it never
// blocks. Each following message is built in OnWriteDone, when the previous
// one has been taken by gRPC: a chunk is a few bytes of framing plus a slice
// aliasing the encoded rows (no copy), so at most one
// message is in flight per stream. A client that stops reading stalls HTTP/2
// flow control, OnWriteDone stops coming, and the stream holds its sample
// encoded (half the float32 size for bf16 and fp16) until it ends.
//
// Guarantees:
//  - Finish is called exactly once: after the Trailer with OK, or earlier
//    with the error (engine failure, verification failure, cancellation).
//    It is never called while a write is outstanding.
//  - The reactor owns itself (a shared_ptr released in OnDone) and the
//    batcher's callback holds another reference, so a stream cancelled while
//    its sample is still queued or running is freed only after the batcher
//    has delivered; the late states are dropped.
//  - `on_done` runs exactly once, in OnDone, with the final status.
#ifndef HSX_SERVER_SERVICE_EXTRACT_REACTOR_H_
#define HSX_SERVER_SERVICE_EXTRACT_REACTOR_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>

#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/server_callback.h>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "format/capture_spec.h"
#include "format/response_encoder.h"
#include "format/sample_tensors.h"
#include "hsx/v1/hsx.pb.h"
#include "server/model/host_buffer_pool.h"
#include "server/service/metrics.h"

namespace hsx {

// How a stream ended, for the service's bookkeeping and logs.
struct StreamResult {
  grpc::Status status;
  int64_t tokens = 0;
  int64_t messages_sent = 0;
  absl::Duration elapsed;
};

class ExtractReactor : public grpc::ServerWriteReactor<grpc::ByteBuffer>,
                       public std::enable_shared_from_this<ExtractReactor> {
 public:
  // The reactor keeps itself alive until OnDone; hand reactor.get() to gRPC.
  // `pool` gives the buffer of the encoded sample; it must outlive the reactor.
  static std::shared_ptr<ExtractReactor> Create(EncoderOptions encoder_options, CaptureSpec capture,
                                                int64_t tokens, HostBufferPool* pool, Metrics* metrics,
                                                std::function<void(const StreamResult&)> on_done);

  // The sample's rows, or the error that stopped its batch. Any thread.
  void Deliver(absl::StatusOr<SampleTensors> rows);
  // Ends the stream with `status` before anything was delivered.
  void Fail(grpc::Status status);
  // True once the client cancelled or the stream finished: the batcher then
  // drops the sample instead of computing it. Any thread.
  bool Abandoned();
  // Cancels the call when a write has waited longer than `limit` for the
  // client to take it (a client that keeps its connection open but never
  // reads would otherwise hold its slot and memory forever). True if it did.
  // `context` is the call's; any thread.
  bool CancelIfStalled(absl::Time now, absl::Duration limit);
  // The call's context, for CancelIfStalled; valid until OnDone.
  void SetContext(grpc::CallbackServerContext* context);

  void OnWriteDone(bool ok) override;
  void OnCancel() override;
  void OnDone() override;

 private:
  // What to do once the lock is released.
  struct Action {
    enum Kind { kNone, kWrite, kFinish } kind = kNone;
    grpc::Status status;
  };

  ExtractReactor(EncoderOptions encoder_options, CaptureSpec capture, int64_t tokens, HostBufferPool* pool,
                 Metrics* metrics, std::function<void(const StreamResult&)> on_done);
  absl::Status CheckRows(const SampleTensors& rows) const;
  Action NextWriteLocked();
  Action FinishLocked(grpc::Status status);
  grpc::Status StalledStatus() const;
  void Perform(const Action& action);

  const EncoderOptions encoder_options_;
  const CaptureSpec capture_;
  const int64_t tokens_;
  HostBufferPool* const pool_;
  Metrics* const metrics_;
  const std::function<void(const StreamResult&)> on_done_;
  const absl::Time start_;

  std::mutex mutex_;
  std::shared_ptr<ExtractReactor> self_;      // released in OnDone
  std::unique_ptr<ResponseEncoder> encoder_;  // set by Deliver, released at Finish
  int64_t held_state_bytes_ = 0;
  grpc::ByteBuffer message_;                  // the message in flight
  int64_t message_bytes_ = 0;
  int64_t messages_sent_ = 0;
  bool write_in_flight_ = false;
  absl::Time write_started_;               // of the write in flight
  absl::Duration stalled_for_;             // set when CancelIfStalled cancelled the call
  // Guards context_ only, so that OnDone (which clears it) never races a
  // TryCancel; recursive because gRPC may run callbacks inline.
  std::recursive_mutex context_mutex_;
  grpc::CallbackServerContext* context_ = nullptr;
  bool cancelled_ = false;
  bool finish_called_ = false;
  grpc::Status final_status_;
};

// absl::Status -> grpc::Status, same code and message.
grpc::Status ToGrpcStatus(const absl::Status& status);

}  // namespace hsx

#endif  // HSX_SERVER_SERVICE_EXTRACT_REACTOR_H_
