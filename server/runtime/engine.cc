// engine.cc: rank workers, their set-up and tear-down, and the lockstep run.
#include "server/runtime/engine.h"

#include <condition_variable>
#include <mutex>
#include <thread>

#include "base/thread_name.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "base/status_names.h"
#include "kernels/device_lost.h"

namespace hsx {

// What one rank owns; created, used and destroyed on the rank's own thread.
struct Engine::RankState {
  std::unique_ptr<Backend> backend;
  ModelWeights weights;
  std::unique_ptr<Model> model;
  absl::StatusOr<Captures> result;
};

// One persistent thread running the tasks posted to it, one at a time.
class Engine::RankWorker {
 public:
  explicit RankWorker(int rank) : thread_([this, rank] {
    NameThisThread("hsx-engine-r" + std::to_string(rank));
    Loop();
  }) {}
  ~RankWorker() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    wake_.notify_one();
    thread_.join();
  }

  RankState& state() { return state_; }

  void Post(std::function<void()> task) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      task_ = std::move(task);
    }
    wake_.notify_one();
  }

 private:
  void Loop() {
    for (;;) {
      std::function<void()> task;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return stop_ || task_ != nullptr; });
        if (task_ == nullptr) return;  // stopping, nothing left to run
        task = std::move(task_);
        task_ = nullptr;
      }
      task();
    }
  }

  RankState state_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::function<void()> task_;
  bool stop_ = false;
  std::thread thread_;  // last: starts once everything above exists
};

Engine::Engine(const Checkpoint& checkpoint, const EngineOptions& options)
    : checkpoint_(checkpoint), options_(options) {}

Engine::~Engine() {
  // Models hold communicators, and everything a backend made must go before
  // the backend: models first, then the group, then weights and backends.
  (void)OnEveryRank([](RankState& s, int) {
    s.model.reset();
    s.result = absl::CancelledError();
    return absl::OkStatus();
  });
  group_.reset();
  (void)OnEveryRank([](RankState& s, int) {
    s.weights = ModelWeights();
    s.backend.reset();
    return absl::OkStatus();
  });
  workers_.clear();
}

absl::Status Engine::OnEveryRank(const std::function<absl::Status(RankState&, int)>& fn) {
  std::mutex mutex;
  std::condition_variable done;
  size_t remaining = workers_.size();
  absl::Status first_error;
  // The first rank whose own error marks its device lost. Ranks that were
  // waiting in a collective return the abort status, a copy of the first
  // error, so the first lost one seen is the rank it came from.
  int lost_rank = -1;
  absl::Status lost_cause;
  for (size_t r = 0; r < workers_.size(); ++r) {
    RankWorker* worker = workers_[r].get();
    worker->Post([&, worker, r] {
      absl::Status status = fn(worker->state(), static_cast<int>(r));
      std::lock_guard<std::mutex> lock(mutex);
      if (!status.ok() && first_error.ok()) {
        first_error = status;
        // Nobody may wait for this rank in a collective any more.
        if (group_ != nullptr) group_->Abort(status);
      }
      if (IsDeviceLost(status) && lost_rank < 0) {
        lost_rank = static_cast<int>(r);
        lost_cause = status;
      }
      if (--remaining == 0) done.notify_one();
    });
  }
  std::unique_lock<std::mutex> lock(mutex);
  done.wait(lock, [&] { return remaining == 0; });
  // A poisoned device is not touched again: no re-arming (NCCL would make new
  // communicators on it).
  if (lost_rank >= 0) return DeviceLost(lost_rank, lost_cause);
  if (!first_error.ok() && group_ != nullptr) {
    if (absl::Status s = group_->Reset(); !s.ok()) {
      // No collective can run any more: as good as a lost device.
      return DeviceLost(-1, MarkDeviceLost(absl::Status(s.code(), absl::StrCat(first_error.message(),
                                                                             "; re-arming the ranks failed: ",
                                                                             s.message())),
                                          "the communicator group"));
    }
  }
  return first_error;
}

absl::Status Engine::DeviceLost(int rank, const absl::Status& cause) {
  const std::string device = LostDevice(cause);
  const std::string who =
      rank < 0 ? device : absl::StrCat("rank ", rank, " of ", workers_.size(), " (", device, ")");
  absl::Status lost = MarkDeviceLost(
      absl::UnavailableError(absl::StrCat(
          "device lost: ", who, " failed with ",
          StatusCodeName(static_cast<int>(cause.code())), ": ", cause.message(),
          "; this process runs no more batches and must be restarted: retry on another replica")),
      device);
  std::lock_guard<std::mutex> lock(lost_mutex_);
  if (lost_.ok()) lost_ = std::move(lost);
  return lost_;
}

absl::Status Engine::lost() const {
  std::lock_guard<std::mutex> lock(lost_mutex_);
  return lost_;
}

absl::StatusOr<std::unique_ptr<Engine>> Engine::Create(const Checkpoint& checkpoint, const EngineOptions& options) {
  HSX_RETURN_IF_ERROR(CheckTensorParallelDegree(checkpoint.config(), options.tp));
  std::unique_ptr<Engine> engine(new Engine(checkpoint, options));
  if (options.factory != nullptr) {
    engine->factory_ = options.factory.get();
  } else {
    HSX_ASSIGN_OR_RETURN(engine->owned_factory_,
                         MakeDeviceFactory(options.device, options.precision, options.tp, options.threads,
                                           options.ranks_per_device, options.attention));
    engine->factory_ = engine->owned_factory_.get();
  }
  // Before anything is loaded: refuse what will not fit (memory_plan.h).
  HSX_RETURN_IF_ERROR(engine->factory_->PlanMemory(checkpoint.config(), options.max_batch_tokens));
  for (int r = 0; r < options.tp; ++r) engine->workers_.push_back(std::make_unique<RankWorker>(r));
  Engine* e = engine.get();
  HSX_RETURN_IF_ERROR(e->OnEveryRank([e](RankState& s, int rank) -> absl::Status {
    HSX_ASSIGN_OR_RETURN(s.backend, e->factory_->MakeBackend(rank));
    HSX_ASSIGN_OR_RETURN(s.weights, LoadModelWeights(e->checkpoint_, rank, e->options_.tp, *s.backend));
    return s.backend->Synchronize();
  }));
  std::vector<Backend*> backends;
  for (auto& worker : e->workers_) backends.push_back(worker->state().backend.get());
  HSX_ASSIGN_OR_RETURN(e->group_, e->factory_->MakeGroup(backends));
  HSX_RETURN_IF_ERROR(e->OnEveryRank([e](RankState& s, int rank) {
    Communicator* communicator = e->options_.tp > 1 ? e->group_->rank(rank) : nullptr;
    s.model = std::make_unique<Model>(e->checkpoint_.config(), s.weights, *s.backend, communicator);
    return absl::OkStatus();
  }));
  return engine;
}

int64_t Engine::placed_bytes(int rank) const { return workers_[rank]->state().backend->placed_bytes(); }

absl::StatusOr<Captures> Engine::Run(const Batch& batch, const CaptureSpec& capture, Copies copies,
                                     CaptureSink* sink, const Fp8Samples& fp8) {
  if (absl::Status lost = this->lost(); !lost.ok()) return lost;
  absl::Status status = OnEveryRank([&](RankState& s, int rank) {
    s.result = rank == 0 ? s.model->Run(batch, capture, sink, fp8) : s.model->Run(batch, capture);
    return s.result.status();
  });
  RankState& first = workers_[0]->state();
  absl::StatusOr<Captures> result = std::move(first.result);
  for (auto& worker : workers_) worker->state().result = absl::CancelledError();  // drop other ranks' buffers
  if (!status.ok() && !IsDeviceLost(status)) {
    // A rank that left the batch early (a failed allocation, an aborted
    // collective) skipped the Synchronize() that ends Model::Run: an op error
    // its backend recorded before it left would fail the next batch, and its
    // device work may still run. Wait for it and drop those errors (the
    // collectives were aborted and re-armed, so nothing waits for a peer).
    (void)OnEveryRank([](RankState& s, int) {
      s.backend->Synchronize().IgnoreError();
      return absl::OkStatus();
    });
  }
  if (IsDeviceLost(status)) NotifyLost(status);
  if (!status.ok()) return status;
  if (copies == Copies::kWait) {
    if (absl::Status s = WaitForCopies(*result); !s.ok()) return s;
  }
  return result;
}

absl::Status Engine::WaitForCopies(const Captures& captures) {
  absl::Status status = captures.WaitForCopies();
  if (!IsDeviceLost(status)) return status;
  // Only rank 0 copies captures out.
  absl::Status lost = DeviceLost(0, status);
  NotifyLost(lost);
  return lost;
}

void Engine::NotifyLost(const absl::Status& lost) {
  std::call_once(lost_notified_, [&] {
    if (options_.on_device_lost) options_.on_device_lost(lost);
  });
}

}  // namespace hsx
