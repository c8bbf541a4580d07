// libFuzzer target: model.safetensors.index.json. Whatever the text, the
// parser returns a status, and every file name it accepts stays inside the
// checkpoint directory (no '/', not "." or "..", not empty).
#include <cstddef>
#include <cstdint>
#include <string>

#include "server/model/checkpoint.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  auto index = hsx::ParseCheckpointIndex(text, "fuzz/model.safetensors.index.json");
  if (!index.ok()) return 0;
  for (const auto& [tensor, file] : *index) {
    if (file.empty() || file == "." || file == ".." || file.find('/') != std::string::npos) __builtin_trap();
  }
  return 0;
}
