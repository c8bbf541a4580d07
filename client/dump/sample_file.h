// sample_file.h: the on-disk format of one extracted sample (DESIGN.md,
// "On-disk format"): hs_{i}.safetensors holding
//   hidden_states            [T, L, H]  bf16 | fp16 | fp32, layers in ascending capture id
//   token_ids                [T]        int64
//   loss_mask                [T]        int64, when the input line has one
//   final_norm_hidden_states [T, H]     when the post-norm state was asked for
// and string metadata: sample id and index, capture ids, the layer convention,
// pre/post-norm, model name, dtype, xxh64 checksums of each tensor's bytes.
// Written atomically (temporary file, fsync, rename).
#ifndef HSX_CLIENT_DUMP_SAMPLE_FILE_H_
#define HSX_CLIENT_DUMP_SAMPLE_FILE_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "client/dump/input.h"
#include "server/model/encoding.h"
#include "server/model/safetensors.h"
#include "server/model/sample_states.h"

namespace hsx {

// The convention string recorded in every output.
inline constexpr char kLayerConvention[] =
    "capture id k = residual stream entering decoder layer k (HF output_hidden_states[k] for k < N); "
    "k = N = last layer output before the final norm";

struct SampleFileInfo {
  std::string model_name;
  int64_t num_layers = 0;
};

// File name of sample `index`: hs_{index}.safetensors.
std::string SampleFileName(int64_t index);

absl::Status WriteSampleFile(const std::string& path, const InputSample& input,
                             const SampleStates& states, OutputDType dtype,
                             const SampleFileInfo& info);

}  // namespace hsx

#endif  // HSX_CLIENT_DUMP_SAMPLE_FILE_H_
