// capture_check.h: the batcher's check of the captured rows, made while the
// engine's capture copy has just written them.
//
// A consumer that sends a sample's rows as they are (bf16 rows as bf16, f32
// rows as fp32) checks and hashes them first (EncodeSample's in-place pass,
// its RowCheck: the request's dtype and checksum). On a backend whose copies
// land on return (the CPU) the engine tells this sink of each piece of rows
// it has just written (CaptureSink), and the check reads them from cache;
// the findings then go with the sample's tensors (SampleTensor::findings),
// and EncodeSample does not read the rows again. Elsewhere nothing is fed,
// nothing is attached, and the consumer checks the rows itself.
#ifndef HSX_SERVER_RUNTIME_CAPTURE_CHECK_H_
#define HSX_SERVER_RUNTIME_CAPTURE_CHECK_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "format/sample_tensors.h"
#include "format/tensor_encoding.h"
#include "kernels/backend.h"
#include "server/model/forward.h"

namespace hsx {

class CaptureCheck : public CaptureSink {
 public:
  // Per sample of the batch, how its consumer checks rows it sends as they
  // are (none: no check); the rows are of `type`, `tensors` per sample of
  // `values` values each (indexed by sample). A sample whose rows would be
  // converted anyway (not SentAsIs) is not checked.
  CaptureCheck(const std::vector<std::optional<RowCheck>>& checks, ElementType type, size_t tensors,
               std::vector<int64_t> values);

  void Written(int64_t sample, size_t tensor, const void* rows, int64_t values) override;

  // Gives each tensor of `sample` (the batch's s-th, every captured tensor,
  // before SelectCaptures) what the check found, when it saw all its rows.
  void AttachFindings(int64_t s, SampleTensors& sample) const;

 private:
  struct Checked {
    std::unique_ptr<TensorChecker> checker;
    int64_t fed = 0;
  };
  std::vector<std::vector<Checked>> checked_;  // [sample][tensor]; empty for a sample not checked
  std::vector<std::optional<RowCheck>> checks_;  // per sample
  std::vector<int64_t> values_;                  // per sample: values per tensor
};

}  // namespace hsx

#endif  // HSX_SERVER_RUNTIME_CAPTURE_CHECK_H_
