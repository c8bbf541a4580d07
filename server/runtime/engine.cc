// engine.cc: rank setup and the lockstep run.
#include "server/runtime/engine.h"

#include <algorithm>
#include <thread>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace hsx {

struct Engine::Rank {
  ModelWeights weights;
  std::unique_ptr<Backend> backend;
  std::unique_ptr<Model> model;
};

Engine::Engine(const Checkpoint& checkpoint, const EngineOptions& options)
    : checkpoint_(checkpoint), options_(options) {}

Engine::~Engine() = default;

absl::StatusOr<std::unique_ptr<Engine>> Engine::Create(const Checkpoint& checkpoint,
                                                       const EngineOptions& options) {
  if (absl::Status s = CheckTensorParallelDegree(checkpoint.config(), options.tp); !s.ok()) return s;
  std::unique_ptr<Engine> engine(new Engine(checkpoint, options));
  const int cores = options.threads > 0 ? options.threads
                                        : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const int per_rank = std::max(1, cores / options.tp);
  engine->group_ = std::make_unique<InProcessGroup>(options.tp);
  for (int r = 0; r < options.tp; ++r) {
    auto rank = std::make_unique<Rank>();
    absl::StatusOr<ModelWeights> weights = LoadModelWeights(checkpoint, r, options.tp);
    if (!weights.ok()) return weights.status();
    rank->weights = *std::move(weights);
    rank->backend = MakeCpuBackend(options.precision, per_rank);
    rank->model = std::make_unique<Model>(checkpoint.config(), rank->weights, *rank->backend,
                                          options.tp > 1 ? engine->group_->rank(r) : nullptr);
    engine->ranks_.push_back(std::move(rank));
  }
  return engine;
}

absl::StatusOr<Captures> Engine::Run(const Batch& batch, const CaptureSpec& capture) {
  if (ranks_.size() == 1) return ranks_[0]->model->Run(batch, capture);
  std::vector<absl::StatusOr<Captures>> results(ranks_.size());
  std::vector<std::thread> threads;
  for (size_t r = 1; r < ranks_.size(); ++r) {
    threads.emplace_back([&, r] { results[r] = ranks_[r]->model->Run(batch, capture); });
  }
  results[0] = ranks_[0]->model->Run(batch, capture);
  for (std::thread& t : threads) t.join();
  // Every rank validated the same batch, so they fail (before any
  // collective) or succeed together; rank 0 speaks for all.
  return std::move(results[0]);
}

}  // namespace hsx
