// engine.h: the model behind one process: N tensor-parallel ranks, each a
// persistent worker thread that owns its backend, its placed share of the
// weights and its forward pass for the engine's whole life.
//
// Run() hands the same batch to every rank; the ranks meet in all-reduces
// after each split block, so after each one the residual stream is whole on
// every rank and rank 0's captures are the result. No reassembly of partial
// results exists to get wrong (docs/design.md, principle 2).
//
// Failure: if any rank fails (an op's error reported by its backend, an
// allocation, a collective), the batch fails with that rank's error; the
// engine aborts the communicator group at the first error so that no rank
// waits forever in a collective, re-arms it afterwards, and serves the next
// batch.
//
// Device loss: if a rank's error says its device is lost
// (kernels/device_lost.h; on CUDA a sticky error), or the group cannot be
// re-armed, no later batch can run. The engine then stops for good: that
// batch and every later Run() fail at once, without touching the devices,
// with one UNAVAILABLE status naming the rank, its device and its error
// (lost()), and options.on_device_lost hears it once. A device-lost error
// outranks any other rank's error in the same batch. Nothing is retried on
// a poisoned device; the process must be restarted.
#ifndef HSX_SERVER_RUNTIME_ENGINE_H_
#define HSX_SERVER_RUNTIME_ENGINE_H_

#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "server/model/checkpoint.h"
#include "server/model/forward.h"
#include "server/runtime/device_factory.h"

namespace hsx {

struct EngineOptions {
  int tp = 1;
  ElementType precision = ElementType::kBf16;
  int threads = 0;  // CPU threads in all (0: every core), shared out among the ranks
  Device device = Device::kCpu;
  // CUDA: ranks per GPU, 1 (rank r on GPU r) or tp (all on GPU 0, for tests).
  int ranks_per_device = 1;
  // CUDA: the attention kernel (device_factory.h).
  CudaAttention attention = CudaAttention::kReference;
  // The batcher's token budget: the batch term of the device memory plan.
  int64_t max_batch_tokens = 8192;
  // Tests: builds the ranks' backends and communicators instead of `device`'s factory.
  std::shared_ptr<DeviceFactory> factory = nullptr;
  // Called once, on the thread that called Run() or WaitForCopies(), with
  // lost()'s status when the engine stops because a device was lost
  // (hsx-server: health NOT_SERVING). May be empty.
  std::function<void(const absl::Status&)> on_device_lost = nullptr;
};

class Engine {
 public:
  // Opens nothing itself: `checkpoint` must outlive the engine.
  static absl::StatusOr<std::unique_ptr<Engine>> Create(const Checkpoint& checkpoint,
                                                        const EngineOptions& options);
  ~Engine();

  const ModelConfig& config() const { return checkpoint_.config(); }
  const EngineOptions& options() const { return options_; }
  // Bytes of weights rank `rank`'s backend placed at load.
  int64_t placed_bytes(int rank) const;

  // What Run() does about capture copies still running when the ranks'
  // compute has ended (Backend::FenceCopies; CUDA's copy stream).
  enum class Copies {
    kWait,   // Run waits for them: the captures are complete when it returns
    kFence,  // Run returns at once; the caller calls WaitForCopies before reading
  };

  // Runs one batch on all ranks. Not thread-safe: one caller (the batcher).
  // The captures must be released before the engine. `sink`, when set, is
  // told of the captured rows as they are written (Model::Run, CaptureSink),
  // on rank 0's thread, before Run returns. `fp8` names the samples sent as
  // fp8 and what each wants (Model::Run: rank 0, the capturing rank, copies
  // them out encoded where its copies do not land on return).
  absl::StatusOr<Captures> Run(const Batch& batch, const CaptureSpec& capture, Copies copies = Copies::kWait,
                               CaptureSink* sink = nullptr, const Fp8Samples& fp8 = {});
  // Waits for the copies of a Run(..., kFence)'s captures; any thread. A copy
  // that failed because its device was lost stops the engine as Run would.
  absl::Status WaitForCopies(const Captures& captures);

  // OK while the engine serves; once a device is lost, the UNAVAILABLE status
  // every later Run() returns (IsDeviceLost() holds for it). Thread-safe.
  absl::Status lost() const;

 private:
  struct RankState;
  class RankWorker;
  Engine(const Checkpoint& checkpoint, const EngineOptions& options);
  // Runs fn on every rank's thread at once and waits for all; the first error
  // aborts the communicator group (if any) and is returned, unless a rank's
  // device was lost: then the engine's lost status (DeviceLost) is.
  absl::Status OnEveryRank(const std::function<absl::Status(RankState&, int)>& fn);
  // Latches the engine's lost status, made from rank `rank`'s `cause` (-1:
  // the communicator group's).
  absl::Status DeviceLost(int rank, const absl::Status& cause);
  // Tells options_.on_device_lost, the first time only.
  void NotifyLost(const absl::Status& lost);

  const Checkpoint& checkpoint_;
  EngineOptions options_;
  std::unique_ptr<DeviceFactory> owned_factory_;
  DeviceFactory* factory_ = nullptr;
  std::unique_ptr<CommunicatorGroup> group_;
  std::vector<std::unique_ptr<RankWorker>> workers_;
  mutable std::mutex lost_mutex_;
  absl::Status lost_;  // set once, never cleared
  std::once_flag lost_notified_;
};

}  // namespace hsx

#endif  // HSX_SERVER_RUNTIME_ENGINE_H_
