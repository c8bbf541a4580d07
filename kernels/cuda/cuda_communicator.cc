// cuda_communicator.cc: the same-device and NCCL transports of the CUDA
// all-reduce (see cuda_communicator.h for the protocol and why it is safe).
#include "kernels/cuda/cuda_communicator.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/collective_plan.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/cuda_errors.h"
#include "kernels/cuda/nccl_api.h"
#include "kernels/cuda/ops.h"
#include "kernels/rank_barrier.h"

namespace hsx {
namespace {

// A group's shared part: the ranks' devices and streams, the host barrier,
// what each rank posted, and the checks every transport makes.
class CudaGroup : public CommunicatorGroup {
 public:
  CudaGroup(std::vector<CudaRank> ranks, std::vector<Backend*> backends)
      : ranks_(std::move(ranks)),
        backends_(std::move(backends)),
        barrier_(size()),
        posted_{std::vector<Posted>(ranks_.size()), std::vector<Posted>(ranks_.size())},
        rounds_(ranks_.size(), 0) {
    for (int r = 0; r < size(); ++r) communicators_.push_back(std::make_unique<RankCommunicator>(this, r));
  }

  int size() const override { return static_cast<int>(ranks_.size()); }
  Communicator* rank(int rank) override { return communicators_[rank].get(); }
  void Abort(const absl::Status& why) override { barrier_.Abort(why); }
  absl::Status Reset() override {
    barrier_.Reset();
    // No rank is in the group: every rank starts again at round 0, whoever
    // had posted in the aborted round.
    std::fill(rounds_.begin(), rounds_.end(), 0);
    return absl::OkStatus();
  }

  // Rank `rank`'s all-reduce of `data`, on its thread.
  virtual absl::Status AllReduce(int rank, const Matrix& data) = 0;

 protected:
  struct Posted {
    float* data = nullptr;
    int64_t elements = 0;
  };

  // "AllReduceSum (rank 2 of 4, 1024 x 7168 f32)": the op and sizes errors name.
  std::string What(int rank, const Matrix& data) const {
    return absl::StrCat("AllReduceSum (rank ", rank, " of ", size(), ", ", data.rows, " x ", data.cols, " ",
                        ElementTypeName(data.type), ")");
  }

  absl::Status CudaCall(cudaError_t status, int rank, const Matrix& data, const char* call) const {
    if (status == cudaSuccess) return absl::OkStatus();
    return cuda::ClassifyCudaError(
        absl::InternalError(absl::StrCat(What(rank, data), " on cuda:", ranks_[rank].device, ": ", call, ": ",
                                         cudaGetErrorName(status), ": ", cudaGetErrorString(status))),
        status, ranks_[rank].device);
  }

  // The contract's preconditions, checked before anything is posted.
  absl::Status CheckPartial(int rank, const Matrix& data) const {
    if (data.type != ElementType::kF32) {
      return absl::InvalidArgumentError(
          absl::StrCat(What(rank, data), ": partials must be f32, got ", ElementTypeName(data.type)));
    }
    if (data.ld != data.cols && data.rows > 1) {
      return absl::InvalidArgumentError(absl::StrCat(What(rank, data), ": the matrix must be contiguous (ld ",
                                                     data.ld, " != cols ", data.cols, ")"));
    }
    return absl::OkStatus();
  }

  // Posts the rank's matrix and meets the others; returns this round's
  // postings, the same for every rank, which so take the same decision on
  // their sizes.
  //
  // Why two sets of postings, by the parity of the round: after the barrier a
  // rank may run ahead into its next all-reduce and post again while a slower
  // rank still reads this round's postings (the NCCL transport meets only
  // once per all-reduce). It cannot get two rounds ahead: posting the round
  // after next means passing the next round's barrier, which the slower rank
  // reaches only after reading these.
  absl::StatusOr<const std::vector<Posted>*> PostAndMeet(int rank, const Matrix& data) {
    std::vector<Posted>& posted = posted_[rounds_[rank]++ % 2];
    posted[rank] = {static_cast<float*>(data.data), data.rows * data.cols};
    if (absl::Status s = barrier_.ArriveAndWait(); !s.ok()) return s;
    for (int r = 0; r < size(); ++r) {
      if (posted[r].elements != posted[rank].elements) {
        return absl::InvalidArgumentError(absl::StrCat(What(rank, data), ": rank ", r, " passed ",
                                                       posted[r].elements, " elements, this rank ",
                                                       posted[rank].elements));
      }
    }
    return &posted;
  }

  std::vector<CudaRank> ranks_;
  std::vector<Backend*> backends_;
  RankBarrier barrier_;
  std::vector<Posted> posted_[2];  // by round parity (PostAndMeet)
  std::vector<int64_t> rounds_;    // per rank: its all-reduces since the last Reset (its own thread's)

 private:
  class RankCommunicator : public Communicator {
   public:
    RankCommunicator(CudaGroup* group, int rank) : group_(group), rank_(rank) {}
    int rank() const override { return rank_; }
    int size() const override { return group_->size(); }
    absl::Status AllReduceSum(const Matrix& data) override {
      if (group_->size() == 1) return absl::OkStatus();
      return group_->AllReduce(rank_, data);
    }

   private:
    CudaGroup* group_;
    int rank_;
  };

  std::vector<std::unique_ptr<Communicator>> communicators_;
};

#define HSX_CUDA_TRY(call, what)                                               \
  do {                                                                         \
    if (absl::Status _s = CudaCall((call), rank, data, what); !_s.ok()) return _s; \
  } while (0)

// ---- Same device -----------------------------------------------------------------

class SameDeviceGroup : public CudaGroup {
 public:
  using CudaGroup::CudaGroup;

  ~SameDeviceGroup() override {
    cudaSetDevice(ranks_.front().device);
    for (cudaEvent_t e : ready_) cudaEventDestroy(e);
    for (cudaEvent_t e : done_) cudaEventDestroy(e);
  }

  absl::Status Init() {
    if (cudaError_t s = cudaSetDevice(ranks_.front().device); s != cudaSuccess) {
      return absl::InternalError(absl::StrCat("same-device group: cudaSetDevice: ", cudaGetErrorString(s)));
    }
    for (int r = 0; r < size(); ++r) {
      for (std::vector<cudaEvent_t>* events : {&ready_, &done_}) {
        cudaEvent_t event = nullptr;
        if (cudaError_t s = cudaEventCreateWithFlags(&event, cudaEventDisableTiming); s != cudaSuccess) {
          return absl::InternalError(absl::StrCat("same-device group: cudaEventCreate: ", cudaGetErrorString(s)));
        }
        events->push_back(event);
      }
    }
    return absl::OkStatus();
  }

  absl::Status AllReduce(int rank, const Matrix& data) override {
    if (absl::Status s = CheckPartial(rank, data); !s.ok()) return s;
    const cudaStream_t stream = ranks_[rank].stream;
    const int n = size();
    HSX_CUDA_TRY(cudaSetDevice(ranks_[rank].device), "cudaSetDevice");
    // 1. This rank's partial is complete at `ready`.
    HSX_CUDA_TRY(cudaEventRecord(ready_[rank], stream), "cudaEventRecord");
    absl::StatusOr<const std::vector<Posted>*> met = PostAndMeet(rank, data);
    if (!met.ok()) return met.status();
    const std::vector<Posted>& posted = **met;
    // 2. Own slice: wait for every partial, sum in rank order, push the sum.
    for (int r = 0; r < n; ++r) {
      if (r != rank) HSX_CUDA_TRY(cudaStreamWaitEvent(stream, ready_[r], 0), "cudaStreamWaitEvent");
    }
    const SliceRange slice = ReduceSlice(posted[rank].elements, n, rank);
    if (slice.size() > 0) {
      std::vector<const float*> sources;
      for (const Summand& summand : ReduceSources(n, rank, false)) {
        sources.push_back(posted[summand.rank].data + slice.begin);
      }
      float* own = posted[rank].data + slice.begin;
      HSX_CUDA_TRY(static_cast<cudaError_t>(cuda::LaunchSumInRankOrder(sources.data(), n, own, slice.size(), stream)),
                   "LaunchSumInRankOrder");
      for (int r = 0; r < n; ++r) {
        if (r == rank) continue;
        HSX_CUDA_TRY(cudaMemcpyAsync(posted[r].data + slice.begin, own, sizeof(float) * slice.size(),
                                     cudaMemcpyDeviceToDevice, stream),
                     "cudaMemcpyAsync (gather)");
      }
    }
    HSX_CUDA_TRY(cudaEventRecord(done_[rank], stream), "cudaEventRecord");
    // 3. Nobody goes on until every slice has landed everywhere.
    if (absl::Status s = barrier_.ArriveAndWait(); !s.ok()) return s;
    for (int r = 0; r < n; ++r) {
      if (r != rank) HSX_CUDA_TRY(cudaStreamWaitEvent(stream, done_[r], 0), "cudaStreamWaitEvent");
    }
    return absl::OkStatus();
  }

 private:
  std::vector<cudaEvent_t> ready_;  // per rank: its partial is complete
  std::vector<cudaEvent_t> done_;   // per rank: its slice is summed and copied to everyone
};

// ---- NCCL ---------------------------------------------------------------------------

// Why each communicator has a lock: NCCL lets one thread at a time call it,
// and ncclCommAbort frees it. Rank r's thread holds comms_[r].in_use while it
// enqueues on it; Abort, on whichever thread failed, marks every communicator
// aborted and then takes each lock before aborting it, so it never frees a
// communicator a rank is still inside. Enqueueing takes microseconds; a rank
// still inside NCCL kAbortWait after the abort began is blocked on a peer that
// will not come (connection set-up waits for both sides), and only
// ncclCommAbort can end that, so Abort then aborts without the lock, as the
// lesser harm than a hang. The clean way out of a stuck call is NCCL's
// non-blocking mode (ncclConfig_t blocking = 0, ncclCommInitRankConfig), which
// these communicators (ncclCommInitAll) do not use yet: to do, on two GPUs.
class NcclGroup : public CudaGroup {
 public:
  NcclGroup(std::vector<CudaRank> ranks, std::vector<Backend*> backends, const cuda::NcclApi* api)
      : CudaGroup(std::move(ranks), std::move(backends)), api_(api), comms_(ranks_.size()) {}

  ~NcclGroup() override {
    for (RankComm& c : comms_) {
      std::lock_guard<std::timed_mutex> lock(c.in_use);
      if (ncclComm_t comm = c.comm.exchange(nullptr); comm != nullptr) api_->ncclCommDestroy(comm);
    }
  }

  // Makes every rank's communicator; no rank may be in the group.
  absl::Status Init() {
    std::vector<int> devices;
    for (const CudaRank& r : ranks_) devices.push_back(r.device);
    std::vector<ncclComm_t> made(ranks_.size(), nullptr);
    const ncclResult_t result = api_->ncclCommInitAll(made.data(), size(), devices.data());
    if (result != ncclSuccess) {
      return absl::FailedPreconditionError(
          absl::StrCat("NCCL: ncclCommInitAll over ", size(), " GPUs: ", api_->ncclGetErrorString(result)));
    }
    for (int r = 0; r < size(); ++r) {
      std::lock_guard<std::timed_mutex> lock(comms_[r].in_use);
      comms_[r].comm = made[r];
      comms_[r].aborted = false;
    }
    return absl::OkStatus();
  }

  void Abort(const absl::Status& why) override {
    CudaGroup::Abort(why);
    // No rank starts enqueueing any more ...
    for (RankComm& c : comms_) c.aborted = true;
    // ... and kernels waiting for a rank that will not come end with the
    // communicators.
    const auto deadline = std::chrono::steady_clock::now() + kAbortWait;  // for all ranks together
    for (RankComm& c : comms_) {
      std::unique_lock<std::timed_mutex> lock(c.in_use, std::defer_lock);
      (void)lock.try_lock_until(deadline);  // see above: past the deadline, abort regardless
      if (ncclComm_t comm = c.comm.exchange(nullptr); comm != nullptr) api_->ncclCommAbort(comm);
    }
  }

  absl::Status Reset() override {
    // No rank is in the group: a communicator aborted (or one a rank could
    // not leave in time) means all are made anew, as NCCL makes them together.
    bool whole = true;
    for (RankComm& c : comms_) whole = whole && c.comm.load() != nullptr && !c.aborted;
    if (!whole) {
      for (RankComm& c : comms_) {
        std::lock_guard<std::timed_mutex> lock(c.in_use);
        if (ncclComm_t comm = c.comm.exchange(nullptr); comm != nullptr) api_->ncclCommAbort(comm);
      }
      if (absl::Status s = Init(); !s.ok()) return s;
    }
    return CudaGroup::Reset();
  }

  absl::Status AllReduce(int rank, const Matrix& data) override {
    if (absl::Status s = CheckPartial(rank, data); !s.ok()) return s;
    absl::StatusOr<const std::vector<Posted>*> met = PostAndMeet(rank, data);
    if (!met.ok()) return met.status();
    RankComm& own = comms_[rank];
    std::lock_guard<std::timed_mutex> lock(own.in_use);
    const ncclComm_t comm = own.comm.load();
    if (own.aborted || comm == nullptr) {
      return absl::AbortedError(absl::StrCat(What(rank, data), ": the NCCL group was aborted"));
    }
    return AllReduceLocked(rank, data, **met, comm);
  }

 private:
  static constexpr std::chrono::seconds kAbortWait{5};

  struct RankComm {
    std::timed_mutex in_use;  // held by the rank's thread while it calls NCCL
    std::atomic<ncclComm_t> comm{nullptr};  // taken (exchanged for null) by whoever frees it
    std::atomic<bool> aborted{false};       // set by Abort before it takes the locks
  };

  // The all-reduce proper, with the rank's communicator held.
  absl::Status AllReduceLocked(int rank, const Matrix& data, const std::vector<Posted>& posted, ncclComm_t comm) {
    const int n = size();
    const cudaStream_t stream = ranks_[rank].stream;
    HSX_CUDA_TRY(cudaSetDevice(ranks_[rank].device), "cudaSetDevice");
    const int64_t elements = posted[rank].elements;
    float* base = posted[rank].data;
    const SliceRange own = ReduceSlice(elements, n, rank);
    // Staging for the peers' partials of the own slice, stream-ordered on
    // this rank's stream (freed after the sum that reads it).
    std::unique_ptr<Buffer> staging;
    int64_t block = 0;
    if (own.size() > 0) {
      absl::StatusOr<std::unique_ptr<Buffer>> made = backends_[rank]->Allocate(n - 1, own.size(), ElementType::kF32);
      if (!made.ok()) return made.status();
      staging = *std::move(made);
      block = staging->matrix().ld;
    }
    float* stage = staging ? static_cast<float*>(staging->matrix().data) : nullptr;
    // Reduce-scatter: the peers' partials of the own slice into staging.
    if (absl::Status st = Exchange(rank, data, comm, ReduceScatterExchanges(elements, n, rank),
                                   [&](const PeerExchange& e) { return stage + e.staging * block; });
        !st.ok()) {
      return st;
    }
    // The rank-order sum of the own slice, in place.
    if (own.size() > 0) {
      std::vector<const float*> sources;
      for (const Summand& summand : ReduceSources(n, rank, true)) {
        sources.push_back(summand.staging < 0 ? base + own.begin : stage + summand.staging * block);
      }
      HSX_CUDA_TRY(static_cast<cudaError_t>(
                       cuda::LaunchSumInRankOrder(sources.data(), n, base + own.begin, own.size(), stream)),
                   "LaunchSumInRankOrder");
    }
    // All-gather: the peers' sums into place.
    return Exchange(rank, data, comm, AllGatherExchanges(elements, n, rank),
                    [&](const PeerExchange& e) { return base + e.receive.begin; });
  }

  absl::Status Nccl(ncclResult_t result, int rank, const Matrix& data, const char* call) const {
    if (result == ncclSuccess) return absl::OkStatus();
    // ncclUnhandledCudaError and ncclSystemError may stand for a sticky CUDA
    // error: the device says. A communicator left unusable otherwise is
    // aborted and made anew by the engine (Abort, Reset); if that fails the
    // engine stops serving (server/runtime/engine.h).
    return cuda::ClassifyOnDevice(
        absl::InternalError(absl::StrCat(What(rank, data), " on cuda:", ranks_[rank].device, ": ", call, ": ",
                                         api_->ncclGetErrorString(result))),
        ranks_[rank].device, ranks_[rank].stream);
  }

  // One grouped round: for each exchange, e.send of this rank's matrix to the
  // peer and e.receive.size() elements from it into receive_to(e).
  absl::Status Exchange(int rank, const Matrix& data, ncclComm_t comm, const std::vector<PeerExchange>& exchanges,
                        const std::function<float*(const PeerExchange&)>& receive_to) {
    const cudaStream_t stream = ranks_[rank].stream;
    const float* base = static_cast<const float*>(data.data);  // what this rank posted
    if (absl::Status s = Nccl(api_->ncclGroupStart(), rank, data, "ncclGroupStart"); !s.ok()) return s;
    absl::Status status;
    for (const PeerExchange& e : exchanges) {
      if (status.ok() && e.send.size() > 0) {
        status = Nccl(api_->ncclSend(base + e.send.begin, e.send.size(), ncclFloat32, e.peer, comm, stream), rank,
                      data, "ncclSend");
      }
      if (status.ok() && e.receive.size() > 0) {
        status = Nccl(api_->ncclRecv(receive_to(e), e.receive.size(), ncclFloat32, e.peer, comm, stream), rank, data,
                      "ncclRecv");
      }
    }
    const absl::Status ended = Nccl(api_->ncclGroupEnd(), rank, data, "ncclGroupEnd");  // always closes the group
    return status.ok() ? ended : status;
  }

  const cuda::NcclApi* api_;
  std::vector<RankComm> comms_;  // per rank; sized once (RankComm does not move)
};

#undef HSX_CUDA_TRY

absl::StatusOr<std::vector<CudaRank>> RanksOf(std::span<Backend* const> backends) {
  std::vector<CudaRank> ranks;
  for (Backend* backend : backends) {
    absl::StatusOr<CudaRank> rank = CudaRankOf(*backend);
    if (!rank.ok()) return rank.status();
    ranks.push_back(*rank);
  }
  if (ranks.empty()) return absl::InvalidArgumentError("a communicator group needs at least one rank");
  return ranks;
}

}  // namespace

absl::StatusOr<std::unique_ptr<CommunicatorGroup>> MakeSameDeviceGroup(std::span<Backend* const> backends) {
  absl::StatusOr<std::vector<CudaRank>> ranks = RanksOf(backends);
  if (!ranks.ok()) return ranks.status();
  if (static_cast<int>(ranks->size()) > cuda::kMaxCollectiveRanks) {
    return absl::InvalidArgumentError(absl::StrCat("same-device group: ", ranks->size(), " ranks, at most ",
                                                   cuda::kMaxCollectiveRanks));
  }
  for (const CudaRank& r : *ranks) {
    if (r.device != ranks->front().device) {
      return absl::InvalidArgumentError(absl::StrCat("same-device group: ranks on cuda:", ranks->front().device,
                                                     " and cuda:", r.device, " (one device only)"));
    }
  }
  auto group = std::make_unique<SameDeviceGroup>(*std::move(ranks),
                                                 std::vector<Backend*>(backends.begin(), backends.end()));
  if (absl::Status s = group->Init(); !s.ok()) return s;
  return group;
}

absl::StatusOr<std::unique_ptr<CommunicatorGroup>> MakeNcclGroup(std::span<Backend* const> backends) {
  absl::StatusOr<std::vector<CudaRank>> ranks = RanksOf(backends);
  if (!ranks.ok()) return ranks.status();
  if (static_cast<int>(ranks->size()) > cuda::kMaxCollectiveRanks) {
    return absl::InvalidArgumentError(absl::StrCat("NCCL group: ", ranks->size(), " ranks, at most ",
                                                   cuda::kMaxCollectiveRanks));
  }
  for (size_t a = 0; a < ranks->size(); ++a) {
    for (size_t b = a + 1; b < ranks->size(); ++b) {
      if ((*ranks)[a].device == (*ranks)[b].device) {
        return absl::InvalidArgumentError(absl::StrCat("NCCL group: ranks ", a, " and ", b, " share cuda:",
                                                       (*ranks)[a].device,
                                                       " (NCCL refuses that; use the same-device transport)"));
      }
    }
  }
  absl::StatusOr<const cuda::NcclApi*> api = cuda::LoadNcclApi();
  if (!api.ok()) return api.status();
  auto group = std::make_unique<NcclGroup>(*std::move(ranks), std::vector<Backend*>(backends.begin(), backends.end()),
                                           *api);
  if (absl::Status s = group->Init(); !s.ok()) return s;
  return group;
}

}  // namespace hsx
