// in_process_communicator.cc: post, reduce a slice each (collective_plan.h), copy back.
#include "kernels/cpu/in_process_communicator.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "kernels/collective_plan.h"

namespace hsx {

InProcessGroup::InProcessGroup(int size) : size_(size), barrier_(size), posted_(size) {
  for (int r = 0; r < size; ++r) ranks_.push_back(std::make_unique<InProcessCommunicator>(this, r));
}

InProcessGroup::~InProcessGroup() = default;

void InProcessGroup::Abort(const absl::Status& why) { barrier_.Abort(why); }

absl::Status InProcessGroup::Reset() {
  barrier_.Reset();
  return absl::OkStatus();
}

absl::Status InProcessCommunicator::AllReduceSum(const Matrix& data) {
  InProcessGroup& g = *group_;
  const int n = g.size();
  if (n == 1) return absl::OkStatus();
  if (data.type != ElementType::kF32) {
    return absl::InvalidArgumentError(
        absl::StrCat("AllReduceSum: partials must be f32, got ", ElementTypeName(data.type)));
  }
  if (data.ld != data.cols && data.rows > 1) {
    return absl::InvalidArgumentError("AllReduceSum: the matrix must be contiguous (ld == cols)");
  }
  const int64_t elements = data.rows * data.cols;
  g.posted_[rank_] = data;
  if (rank_ == 0) g.result_.resize(static_cast<size_t>(elements));
  if (absl::Status s = g.ArriveAndWait(); !s.ok()) return s;
  // Reduce-scatter: this rank sums its slice of everyone's partials in rank order.
  const SliceRange slice = ReduceSlice(elements, n, rank_);
  float* out = g.result_.data() + slice.begin;
  std::memcpy(out, static_cast<const float*>(g.posted_[0].data) + slice.begin, sizeof(float) * slice.size());
  for (int r = 1; r < n; ++r) {
    const float* in = static_cast<const float*>(g.posted_[r].data) + slice.begin;
    for (int64_t i = 0; i < slice.size(); ++i) out[i] += in[i];
  }
  if (absl::Status s = g.ArriveAndWait(); !s.ok()) return s;
  // All-gather.
  std::memcpy(data.data, g.result_.data(), sizeof(float) * elements);
  // Nobody reuses result_ or its matrix before all have copied.
  return g.ArriveAndWait();
}

}  // namespace hsx
