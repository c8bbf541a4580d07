// extractor.h: where hsx-dump gets a sample's hidden states from. The
// in-process engine and a remote hsx-server (remote_extractor.h) are two
// implementations; all that follows (verification, atomic writes, the
// journal, progress) is shared and starts from the same EncodedSample: the
// states already in the output dtype, exactly the bytes that go to disk.
#ifndef HSX_CLIENT_DUMP_EXTRACTOR_H_
#define HSX_CLIENT_DUMP_EXTRACTOR_H_

#include <functional>
#include <memory>
#include <utility>

#include "absl/status/statusor.h"
#include "client/dump/input.h"
#include "format/sample_file.h"
#include "format/encoding.h"
#include "server/model/forward.h"
#include "server/model/sample_states.h"
#include "server/runtime/batcher.h"
#include "server/runtime/engine.h"

namespace hsx {

// What to extract for every sample.
struct ExtractSpec {
  CaptureSpec capture;  // ids ascending
  OutputDType dtype = OutputDType::kBf16;
};

class Extractor {
 public:
  using Done = std::function<void(absl::StatusOr<EncodedSample>)>;
  virtual ~Extractor() = default;
  // Starts one sample; `done` is called exactly once, from any thread (possibly
  // before Extract returns). `sample` must stay alive until then.
  virtual void Extract(const InputSample& sample, const ExtractSpec& spec, Done done) = 0;
  // Gives up on everything in flight (after a failure or a signal): pending
  // samples finish soon, with an error. Extract after this fails at once.
  virtual void CancelAll() {}
};

// Runs the model in this process through the shared batcher.
class InProcessExtractor : public Extractor {
 public:
  InProcessExtractor(Engine& engine, const BatcherOptions& options) : batcher_(engine, options) {}
  void Extract(const InputSample& sample, const ExtractSpec& spec, Done done) override {
    const OutputDType dtype = spec.dtype;
    WorkItem item{sample.input_ids, spec.capture,
                  [dtype, done](absl::StatusOr<SampleStates> states) {
                    if (!states.ok()) {
                      done(states.status());
                      return;
                    }
                    done(EncodeSampleStates(*states, dtype));
                  },
                  /*abandoned=*/nullptr, /*deliver=*/nullptr};
    if (absl::Status s = batcher_.Submit(std::move(item)); !s.ok()) done(s);
  }

 private:
  Batcher batcher_;
};

}  // namespace hsx

#endif  // HSX_CLIENT_DUMP_EXTRACTOR_H_
