// dump_job.h: the part of hsx-dump after the transport: keeps up to
// `concurrency` samples in flight, verifies every sample before writing it
// atomically, and stops at the first failure without leaving a partial file.
#ifndef HSX_CLIENT_DUMP_DUMP_JOB_H_
#define HSX_CLIENT_DUMP_DUMP_JOB_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "client/dump/extractor.h"
#include "client/dump/input.h"
#include "client/dump/sample_file.h"

namespace hsx {

struct DumpOptions {
  std::string out_dir;
  CaptureSpec capture;
  OutputDType dtype = OutputDType::kBf16;
  int concurrency = 64;
  SampleFileInfo info;
};

struct DumpStats {
  int64_t samples = 0;
  int64_t tokens = 0;
  double seconds = 0.0;
};

// Checks what a consumer relies on: shape [len(input_ids), L, H] with the
// requested capture ids, finite values, no all-zero layer.
absl::Status VerifySample(const InputSample& input, const CaptureSpec& capture,
                          const SampleStates& states);

absl::StatusOr<DumpStats> RunDump(const std::vector<InputSample>& samples, Extractor& extractor,
                                  const DumpOptions& options);

}  // namespace hsx

#endif  // HSX_CLIENT_DUMP_DUMP_JOB_H_
