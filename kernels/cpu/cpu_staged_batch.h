// cpu_staged_batch.h: the CPU backend's StagedBatch, shared by its source
// files (the ops and the attention).
//
// Holds the batch's token ids, each token's position within its sample and
// the samples' boundaries in host memory, as Stage() checked them: cu_seqlens
// runs from 0 to the token count and no sample is empty.
#ifndef HSX_KERNELS_CPU_CPU_STAGED_BATCH_H_
#define HSX_KERNELS_CPU_CPU_STAGED_BATCH_H_

#include <cstdint>
#include <vector>

#include "kernels/backend.h"

namespace hsx {

class CpuStagedBatch : public StagedBatch {
 public:
  int64_t tokens() const override { return static_cast<int64_t>(token_ids.size()); }
  int64_t num_samples() const override { return static_cast<int64_t>(cu_seqlens.size()) - 1; }
  int64_t longest() const override { return longest_length; }

  std::vector<int32_t> token_ids;
  std::vector<int32_t> positions;
  std::vector<int64_t> cu_seqlens;
  int64_t longest_length = 0;
};

}  // namespace hsx

#endif  // HSX_KERNELS_CPU_CPU_STAGED_BATCH_H_
