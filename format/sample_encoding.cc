// sample_encoding.cc: the choice, the in-place check and the one-pass encoding.
#include "format/sample_encoding.h"

#include <algorithm>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "format/fp8.h"
#include "format/tensor_encoding.h"

namespace hsx {
namespace {

// Rows that are already the bytes to send, held by an owner that keeps
// nothing else.
bool UseInPlace(const SampleTensors& rows, OutputDType dtype) {
  return rows.dtype == dtype && rows.owner != nullptr && rows.held_bytes == rows.bytes();
}

void CheckInPlace(SampleTensors& rows, ChecksumKind checksum) {
  for (SampleTensor& tensor : rows.tensors) {
    const bool answered = tensor.findings.has_value() && tensor.findings->checksum_kind == checksum;
    if (answered) continue;
    tensor.findings = rows.dtype == OutputDType::kFp8
                          ? CheckFp8Tensor(tensor.pieces[0].data(), rows.tokens, rows.hidden, checksum)
                          : CheckTensor(tensor.pieces[0].data(), rows.tokens * rows.hidden, rows.dtype, checksum);
  }
}

absl::StatusOr<SampleTensors> EncodeIntoBuffer(const SampleTensors& rows, OutputDType dtype, ChecksumKind checksum,
                                               const BufferAllocator& allocate) {
  SampleTensors out;
  out.capture_ids = rows.capture_ids;
  out.tokens = rows.tokens;
  out.hidden = rows.hidden;
  out.dtype = dtype;
  const int64_t values = rows.tokens * rows.hidden;
  const size_t tensor_bytes = static_cast<size_t>(rows.tokens * RowBytes(dtype, rows.hidden));
  absl::StatusOr<std::unique_ptr<HostBuffer>> buffer =
      allocate(std::max<size_t>(rows.tensors.size() * tensor_bytes, 1));
  if (!buffer.ok()) return buffer.status();
  std::shared_ptr<HostBuffer> encoded = *std::move(buffer);
  for (size_t k = 0; k < rows.tensors.size(); ++k) {
    char* dst = static_cast<char*>(encoded->data()) + k * tensor_bytes;
    out.AddTensor(rows.tensors[k].capture_id, dst);
    const void* src = rows.tensors[k].pieces[0].data();
    out.tensors.back().findings =
        dtype == OutputDType::kFp8
            ? EncodeFp8Tensor(src, RowsOfDType(rows.dtype), rows.tokens, rows.hidden, dst, checksum)
            : EncodeTensor(src, RowsOfDType(rows.dtype), values, dtype, dst, checksum);
  }
  out.held_bytes = static_cast<int64_t>(encoded->bytes());
  out.owner = std::move(encoded);
  return out;
}

}  // namespace

absl::StatusOr<SampleTensors> EncodeSample(SampleTensors rows, OutputDType dtype, ChecksumKind checksum,
                                           const BufferAllocator& allocate) {
  const int64_t tensor_bytes = rows.tokens * rows.row_bytes();
  for (const SampleTensor& tensor : rows.tensors) {
    if (tensor.pieces.size() != 1 || tensor.bytes != tensor_bytes) {
      return absl::InternalError(absl::StrCat("capture id ", tensor.capture_id, ": ", tensor.pieces.size(),
                                              " pieces of rows, expected one of ", tensor_bytes, " bytes"));
    }
  }
  if (UseInPlace(rows, dtype)) {
    CheckInPlace(rows, checksum);
    return rows;
  }
  if (rows.dtype == OutputDType::kFp16 || rows.dtype == OutputDType::kFp8) {
    return absl::InternalError(absl::StrCat(OutputDTypeName(rows.dtype), " rows cannot be encoded again"));
  }
  return EncodeIntoBuffer(rows, dtype, checksum, allocate);
}

}  // namespace hsx
