// batcher.h: packs queued samples into ragged batches for the engine and hands
// each sample its own states.
//
// Packing: the oldest queued sample always goes into the next batch (nothing
// starves); then later samples are added in arrival order, skipping those that
// do not fit, while the batch stays within max_batch_tokens and the memory
// estimate within max_batch_bytes (when set). Nothing waits for a batch to
// fill: the engine being busy is what lets the queue grow. The batch captures
// the union of what its samples asked for; each sample's consumer receives
// exactly its own rows (by cu_seqlens) and its own capture ids, in place in
// the batch's pooled host buffers (SampleTensors, no copy: the buffers go
// back to the engine's pool when the last holder lets go). Where a consumer
// says how it will check the rows it sends as they are (WorkItem::row_check),
// the batcher's capture check (capture_check.h) runs while the engine copies
// them out, and the sample's tensors carry what it found.
//
// Delivery runs one batch behind the engine, on a thread of its own: while
// batch N's samples are handed to their consumers (the service encodes each
// sample's stream there, one pass over its rows), batch N+1 runs. Batch N+1
// is handed over only when batch N's delivery has finished, so at most two
// batches' capture buffers are alive at once: the one being delivered and the
// one just run (the engine waits meanwhile).
//
// Device loss (Engine::lost()): the batch that lost it fails with the
// engine's UNAVAILABLE status, so does every sample still queued (the engine
// fails their batches at once, without running them), and Submit() refuses
// every later one with it.
#ifndef HSX_SERVER_RUNTIME_BATCHER_H_
#define HSX_SERVER_RUNTIME_BATCHER_H_

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "format/sample_tensors.h"
#include "server/model/capture_views.h"
#include "server/runtime/capture_check.h"
#include "server/runtime/engine.h"

namespace hsx {

// One sample waiting to run.
struct WorkItem {
  std::vector<int32_t> tokens;
  CaptureSpec capture;
  // Called exactly once, with the sample's rows or the error that stopped
  // its batch (Cancelled when `abandoned` said so). Calls come from the
  // delivery thread, one at a time; a dropped (abandoned) sample's from the
  // batch thread, which may overlap a delivery. A consumer that keeps the
  // rows keeps its sample's capture buffer: release it (e.g. after encoding)
  // before returning when you can.
  std::function<void(absl::StatusOr<SampleTensors>)> deliver;
  // Optional: asked before the sample is packed into a batch; true means its
  // consumer has gone (a cancelled RPC), so it is dropped, not computed.
  std::function<bool()> abandoned = nullptr;
  // Optional: how `deliver`'s consumer checks and hashes the rows it sends as
  // they are; the batcher's capture check then does it where it can, and
  // the tensors carry what it found (SampleTensor::findings). A dtype of
  // kFp8 also tells the engine the sample is sent as fp8: where its copies
  // do not land on return (CUDA) the device encodes it (Model::Run), and
  // the sample arrives as fp8 rows of exactly `capture`, without findings.
  std::optional<RowCheck> row_check = std::nullopt;
  // Optional, for a row_check of dtype kFp8: gives the buffer the capture
  // check may encode the sample's rows into (the consumer's pool); the
  // sample is then delivered as those fp8 rows (CaptureCheck::EncodeFp8).
  BufferAllocator encode_buffer = nullptr;
};

struct BatcherOptions {
  int64_t max_batch_tokens = 8192;
  int64_t max_batch_bytes = 0;  // 0: no memory limit beyond the token budget
  size_t lookahead = 1024;      // queued samples scanned per batch
};

// Bytes of host/device memory one rank needs to run a batch of these sample
// lengths, capturing `capture_layers` states (plus the final norm): the
// residual stream, every per-layer activation alive at once, the attention
// score matrices and the captured states.
int64_t EstimateBatchBytes(const ModelConfig& config, int tp, const std::vector<int64_t>& lengths,
                           int64_t capture_layers, bool final_norm);

// The packing rule alone (for tests and the packing benchmark): indices into
// `lengths` (a queue, oldest first) of the next batch. `fits`, when given, is
// asked whether a candidate set of lengths stays within the memory budget.
std::vector<size_t> PackNext(const std::vector<int64_t>& lengths, int64_t max_batch_tokens,
                             size_t lookahead,
                             const std::function<bool(const std::vector<int64_t>&)>& fits = nullptr);



class Batcher {
 public:
  Batcher(Engine& engine, const BatcherOptions& options);
  // Finishes every queued sample, then stops.
  ~Batcher();

  // Queues a sample. InvalidArgument / ResourceExhausted when it could never
  // run (longer than max_batch_tokens, or over max_batch_bytes alone);
  // the engine's lost() status once a device is lost.
  absl::Status Submit(WorkItem item);

  // The engine's lost() status: OK while a batch can run.
  absl::Status device_lost() const { return engine_.lost(); }
  // Tokens queued and not yet running.
  int64_t queued_tokens() const;
  // Real tokens over capacity, summed over every batch run so far.
  double fill() const;
  // Batches the engine has run (delivered or not).
  int64_t batches_run() const;

 private:
  // A batch the engine has run, waiting for its consumers.
  struct Finished {
    std::vector<WorkItem> items;
    absl::StatusOr<Captures> captures;
    std::unique_ptr<CaptureCheck> check;  // what it found as the rows were copied
  };

  void Loop();
  void RunBatch(std::vector<WorkItem> items);
  // On the batch loop: waits until the previous batch is delivered (the
  // slot is empty), then gives this one to the delivery thread.
  void HandOver(Finished finished);
  void DeliveryLoop();
  // On the delivery thread: waits for the batch's copies, then hands each
  // sample its rows (or the batch's error).
  void Deliver(Finished finished);

  Engine& engine_;
  BatcherOptions options_;
  mutable std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<WorkItem> queue_;
  int64_t queued_tokens_ = 0;
  int64_t batches_ = 0;
  int64_t tokens_run_ = 0;
  bool stopping_ = false;

  std::mutex delivery_mutex_;
  std::condition_variable delivery_wake_;
  // The batch handed to the delivery thread; empty again once it is delivered.
  std::optional<Finished> handed_over_;
  bool loop_ended_ = false;  // no batch will be handed over any more

  std::thread thread_;           // Loop
  std::thread delivery_thread_;  // DeliveryLoop
};

}  // namespace hsx

#endif  // HSX_SERVER_RUNTIME_BATCHER_H_
