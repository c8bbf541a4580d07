// libFuzzer target: the safetensors header parser must return a status, never
// crash, hang or read out of bounds, whatever the bytes.
#include <cstddef>
#include <cstdint>
#include <span>

#include "format/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  absl::StatusOr<hsx::SafetensorsHeader> header =
      hsx::ParseSafetensors(std::span<const uint8_t>(data, size), "fuzz.safetensors");
  if (header.ok()) {
    // Whatever parsed must describe ranges inside the input.
    for (const hsx::TensorInfo& tensor : header->tensors) {
      if (header->data_start + tensor.end > size) __builtin_trap();
    }
  }
  return 0;
}
