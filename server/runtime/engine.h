// engine.h: the model behind one process: N tensor-parallel ranks, one thread
// each, every rank holding its own slice of the weights (read in place from
// the checkpoint mapping) and its own backend.
//
// Run() hands the same batch to every rank; the ranks meet in all-reduces
// after each split block, so after each one the residual stream is whole on
// every rank and rank 0's captures are the result. No reassembly of partial
// results exists to get wrong (DESIGN.md principle 2).
#ifndef HSX_SERVER_RUNTIME_ENGINE_H_
#define HSX_SERVER_RUNTIME_ENGINE_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "server/model/checkpoint.h"
#include "server/model/forward.h"
#include "server/model/model_weights.h"
#include "server/runtime/in_process_communicator.h"

namespace hsx {

struct EngineOptions {
  int tp = 1;
  Precision precision = Precision::kBf16;
  int threads = 0;  // CPU threads in all (0: every core), shared out among the ranks
};

class Engine {
 public:
  // Opens nothing itself: `checkpoint` must outlive the engine.
  static absl::StatusOr<std::unique_ptr<Engine>> Create(const Checkpoint& checkpoint,
                                                        const EngineOptions& options);
  ~Engine();

  const ModelConfig& config() const { return checkpoint_.config(); }
  const EngineOptions& options() const { return options_; }

  // Runs one batch on all ranks. Not thread-safe: one caller (the batcher).
  absl::StatusOr<Captures> Run(const Batch& batch, const CaptureSpec& capture);

 private:
  struct Rank;
  Engine(const Checkpoint& checkpoint, const EngineOptions& options);

  const Checkpoint& checkpoint_;
  EngineOptions options_;
  std::unique_ptr<InProcessGroup> group_;
  std::vector<std::unique_ptr<Rank>> ranks_;
};

}  // namespace hsx

#endif  // HSX_SERVER_RUNTIME_ENGINE_H_
