// in_process_communicator.cc: post, reduce a row slice each, copy back.
#include "kernels/cpu/in_process_communicator.h"

#include <cstring>

#include "absl/strings/str_cat.h"

namespace hsx {

InProcessGroup::InProcessGroup(int size) : size_(size), posted_(size) {
  for (int r = 0; r < size; ++r) ranks_.push_back(std::make_unique<InProcessCommunicator>(this, r));
}

InProcessGroup::~InProcessGroup() = default;

void InProcessGroup::Abort(const absl::Status& why) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (aborted_.ok()) aborted_ = why.ok() ? absl::AbortedError("collective aborted") : why;
  changed_.notify_all();
}

absl::Status InProcessGroup::Reset() {
  std::lock_guard<std::mutex> lock(mutex_);
  aborted_ = absl::OkStatus();
  arrived_ = 0;
  ++generation_;
  return absl::OkStatus();
}

absl::Status InProcessGroup::ArriveAndWait() {
  std::unique_lock<std::mutex> lock(mutex_);
  if (!aborted_.ok()) return aborted_;
  const int64_t generation = generation_;
  if (++arrived_ == size_) {
    arrived_ = 0;
    ++generation_;
    changed_.notify_all();
    return absl::OkStatus();
  }
  changed_.wait(lock, [&] { return generation_ != generation || !aborted_.ok(); });
  return generation_ != generation ? absl::OkStatus() : aborted_;
}

absl::Status InProcessCommunicator::AllReduceSum(const Matrix& data) {
  InProcessGroup& g = *group_;
  const int n = g.size();
  if (n == 1) return absl::OkStatus();
  if (data.type != ElementType::kF32) {
    return absl::InvalidArgumentError(
        absl::StrCat("AllReduceSum: partials must be f32, got ", ElementTypeName(data.type)));
  }
  g.posted_[rank_] = data;
  if (rank_ == 0) g.result_.resize(static_cast<size_t>(data.rows * data.cols));
  if (absl::Status s = g.ArriveAndWait(); !s.ok()) return s;
  // Rank r reduces rows [r * rows / n, (r + 1) * rows / n) in rank order.
  const int64_t begin = data.rows * rank_ / n;
  const int64_t end = data.rows * (rank_ + 1) / n;
  for (int64_t row = begin; row < end; ++row) {
    float* out = g.result_.data() + row * data.cols;
    std::memcpy(out, g.posted_[0].at(row, 0), sizeof(float) * data.cols);
    for (int r = 1; r < n; ++r) {
      const float* in = static_cast<const float*>(g.posted_[r].at(row, 0));
      for (int64_t c = 0; c < data.cols; ++c) out[c] += in[c];
    }
  }
  if (absl::Status s = g.ArriveAndWait(); !s.ok()) return s;
  for (int64_t row = 0; row < data.rows; ++row) {
    std::memcpy(data.at(row, 0), g.result_.data() + row * data.cols, sizeof(float) * data.cols);
  }
  // Nobody reuses result_ or its matrix before all have copied.
  return g.ArriveAndWait();
}

}  // namespace hsx
