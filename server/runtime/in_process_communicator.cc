// in_process_communicator.cc: post, reduce a row slice each, copy back.
#include "server/runtime/in_process_communicator.h"

#include <cstring>


namespace hsx {

InProcessGroup::InProcessGroup(int size) : size_(size), barrier_(size), posted_(size) {
  for (int r = 0; r < size; ++r) ranks_.push_back(std::make_unique<InProcessCommunicator>(this, r));
}

void InProcessCommunicator::AllReduceSum(const Matrix& data) {
  InProcessGroup& g = *group_;
  const int n = g.size();
  if (n == 1) return;
  g.posted_[rank_] = data;
  if (rank_ == 0) g.result_.resize(static_cast<size_t>(data.rows * data.cols));
  g.barrier_.arrive_and_wait();
  // Rank r reduces rows [r * rows / n, (r + 1) * rows / n) in rank order.
  const int64_t begin = data.rows * rank_ / n;
  const int64_t end = data.rows * (rank_ + 1) / n;
  for (int64_t row = begin; row < end; ++row) {
    float* out = g.result_.data() + row * data.cols;
    std::memcpy(out, g.posted_[0].row(row), sizeof(float) * data.cols);
    for (int r = 1; r < n; ++r) {
      const float* in = g.posted_[r].row(row);
      for (int64_t c = 0; c < data.cols; ++c) out[c] += in[c];
    }
  }
  g.barrier_.arrive_and_wait();
  for (int64_t row = 0; row < data.rows; ++row) {
    std::memcpy(data.row(row), g.result_.data() + row * data.cols, sizeof(float) * data.cols);
  }
  g.barrier_.arrive_and_wait();  // nobody reuses result_ or its matrix before all have copied
}

}  // namespace hsx
