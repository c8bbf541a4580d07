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
// nothing is attached, and the consumer checks the rows itself (an fp8
// sample's rows then arrive encoded already: Model::Run has the device
// encode them, and AttachFindings leaves them as they are).
//
// A consumer that sends fp8 (row_check's dtype kFp8) would encode the rows
// itself (EncodeSample). Where it gives a buffer to encode into
// (WorkItem::encode_buffer), the sink encodes each piece as it is written
// (Fp8TensorEncoder, whole rows only) into a buffer of the sample's own
// tensors; AttachFindings then hands the sample on as those fp8 rows with
// their findings, which EncodeSample sends in place: the same bytes and
// findings as its own encoding gives. A piece that is not whole rows, a
// failed allocation or rows not all fed leave the sample as it was.
#ifndef HSX_SERVER_RUNTIME_CAPTURE_CHECK_H_
#define HSX_SERVER_RUNTIME_CAPTURE_CHECK_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "format/fp8.h"
#include "format/sample_encoding.h"
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

  // Sample `s` (whose check's dtype is kFp8) is encoded as it is written:
  // of the batch's tensors (`batch`'s ids, then its final norm) those
  // `wanted` names, `tokens` rows of `hidden` values each, into a buffer
  // from `allocate`, taken at its first piece.
  void EncodeFp8(int64_t s, const CaptureSpec& batch, const CaptureSpec& wanted, int64_t tokens, int64_t hidden,
                 BufferAllocator allocate);

  void Written(int64_t sample, size_t tensor, const void* rows, int64_t values) override;

  // Gives each tensor of `sample` (the batch's s-th, every captured tensor,
  // before SelectCaptures) what the check found, when it saw all its rows;
  // or, for a sample encoded into fp8 whole, replaces it by its encoded
  // tensors (only the wanted ones, with their findings). Once per sample.
  void AttachFindings(int64_t s, SampleTensors& sample);

 private:
  // One sample encoded into fp8 (EncodeFp8).
  struct Fp8Sample {
    std::vector<int> slot;  // per batch tensor: its index among the wanted, or -1
    std::vector<int> ids;   // the wanted capture ids (then the final norm, if wanted)
    bool final_norm = false;
    int64_t tokens = 0;
    int64_t hidden = 0;
    BufferAllocator allocate;
    std::shared_ptr<HostBuffer> buffer;                      // taken at the first piece
    std::vector<std::unique_ptr<Fp8TensorEncoder>> encoders;  // per wanted tensor
    bool failed = false;  // not whole rows, or no buffer: the consumer encodes
  };
  void WrittenFp8(int64_t sample, Fp8Sample& f, size_t tensor, const void* rows, int64_t values);
  bool TakeFp8(Fp8Sample& f, SampleTensors& sample);

  struct Checked {
    std::unique_ptr<TensorChecker> checker;
    int64_t fed = 0;
  };
  std::vector<std::vector<Checked>> checked_;  // [sample][tensor]; empty for a sample not checked
  std::vector<std::optional<RowCheck>> checks_;  // per sample
  std::vector<int64_t> values_;                  // per sample: values per tensor
  ElementType type_;
  std::vector<std::unique_ptr<Fp8Sample>> fp8_;  // per sample; null unless EncodeFp8
};

}  // namespace hsx

#endif  // HSX_SERVER_RUNTIME_CAPTURE_CHECK_H_
