// sample_tensors.cc: byte counts and the one-piece tensor.
#include "format/sample_tensors.h"

#include <string>

namespace hsx {

int64_t SampleTensors::bytes() const {
  int64_t total = 0;
  for (const SampleTensor& tensor : tensors) total += tensor.bytes;
  return total;
}

int64_t SampleTensors::layer_bytes() const {
  int64_t total = 0;
  for (size_t i = 0; i < tensors.size() && i < capture_ids.size(); ++i) total += tensors[i].bytes;
  return total;
}

void SampleTensors::AddTensor(int capture_id, const void* rows) {
  SampleTensor tensor;
  tensor.capture_id = capture_id;
  tensor.bytes = tokens * row_bytes();
  tensor.pieces.emplace_back(static_cast<const uint8_t*>(rows), static_cast<size_t>(tensor.bytes));
  tensors.push_back(std::move(tensor));
}

std::string TensorString(const SampleTensor& tensor) {
  std::string out;
  out.reserve(static_cast<size_t>(tensor.bytes));
  for (const BytePiece& piece : tensor.pieces) out.append(piece.begin(), piece.end());
  return out;
}

}  // namespace hsx
