// dump_job.cc: the in-flight window, verification and writes.
#include "client/dump/dump_job.h"

#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <filesystem>
#include <mutex>

#include "absl/strings/str_cat.h"

namespace hsx {

absl::Status VerifySample(const InputSample& input, const CaptureSpec& capture,
                          const SampleStates& states) {
  const int64_t layers = static_cast<int64_t>(states.capture_ids.size());
  const std::string where = absl::StrCat("sample ", input.index, " (id ", input.id, ")");
  if (states.capture_ids != capture.ids) {
    return absl::DataLossError(absl::StrCat(where, ": received other capture ids than requested"));
  }
  if (states.tokens != static_cast<int64_t>(input.input_ids.size()) ||
      static_cast<int64_t>(states.hidden_states.size()) != states.tokens * layers * states.hidden) {
    return absl::DataLossError(absl::StrCat(where, ": ", states.tokens, " rows of states for ",
                                            input.input_ids.size(), " tokens"));
  }
  if (capture.final_norm != !states.final_norm.empty() ||
      (capture.final_norm && static_cast<int64_t>(states.final_norm.size()) != states.tokens * states.hidden)) {
    return absl::DataLossError(absl::StrCat(where, ": final norm state missing or misshapen"));
  }
  for (int64_t l = 0; l < layers; ++l) {
    bool all_zero = true;
    for (int64_t t = 0; t < states.tokens; ++t) {
      const float* row = &states.hidden_states[(t * layers + l) * states.hidden];
      for (int64_t i = 0; i < states.hidden; ++i) {
        if (!std::isfinite(row[i])) {
          return absl::DataLossError(absl::StrCat(where, ": non-finite value in capture id ",
                                                  states.capture_ids[l], " row ", t));
        }
        all_zero &= row[i] == 0.0f;
      }
    }
    if (all_zero) {
      return absl::DataLossError(absl::StrCat(where, ": capture id ", states.capture_ids[l], " is all zeros"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<DumpStats> RunDump(const std::vector<InputSample>& samples, Extractor& extractor,
                                  const DumpOptions& options) {
  std::mutex mutex;
  std::condition_variable changed;
  int in_flight = 0;
  absl::Status failure;
  DumpStats stats;
  const auto start = std::chrono::steady_clock::now();
  auto elapsed = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(); };
  for (const InputSample& sample : samples) {
    {
      std::unique_lock<std::mutex> lock(mutex);
      changed.wait(lock, [&] { return in_flight < options.concurrency || !failure.ok(); });
      if (!failure.ok()) break;
      ++in_flight;
    }
    extractor.Extract(sample, options.capture, [&, sample_ptr = &sample](absl::StatusOr<SampleStates> states) {
      absl::Status status = states.status();
      if (status.ok()) status = VerifySample(*sample_ptr, options.capture, *states);
      if (status.ok()) {
        const std::string path =
            (std::filesystem::path(options.out_dir) / SampleFileName(sample_ptr->index)).string();
        status = WriteSampleFile(path, *sample_ptr, *states, options.dtype, options.info);
      }
      std::lock_guard<std::mutex> lock(mutex);
      if (status.ok()) {
        ++stats.samples;
        stats.tokens += static_cast<int64_t>(sample_ptr->input_ids.size());
      } else if (failure.ok()) {
        failure = status;
      }
      --in_flight;
      changed.notify_all();
    });
  }
  std::unique_lock<std::mutex> lock(mutex);
  changed.wait(lock, [&] { return in_flight == 0; });
  stats.seconds = elapsed();
  if (!failure.ok()) return failure;
  return stats;
}

}  // namespace hsx
