// in_process_extractor.h: hsx-dump --model, the engine in this process: the
// one Extractor that needs the server's runtime (the remote one does not).
#ifndef HSX_CLIENT_DUMP_IN_PROCESS_EXTRACTOR_H_
#define HSX_CLIENT_DUMP_IN_PROCESS_EXTRACTOR_H_

#include <utility>

#include "client/dump/extractor.h"
#include "format/sample_states.h"
#include "server/runtime/batcher.h"
#include "server/runtime/engine.h"

namespace hsx {

// Runs the model in this process through the shared batcher.
class InProcessExtractor : public Extractor {
 public:
  InProcessExtractor(Engine& engine, const BatcherOptions& options) : batcher_(engine, options) {}
  void Extract(const InputSample& sample, const ExtractSpec& spec, Done done) override {
    const OutputDType dtype = spec.dtype;
    WorkItem item;
    item.tokens = sample.input_ids;
    item.capture = spec.capture;
    item.done = [dtype, done](absl::StatusOr<SampleStates> states) {
      if (!states.ok()) {
        done(states.status());
        return;
      }
      done(EncodeSampleStates(*states, dtype));
    };
    if (absl::Status s = batcher_.Submit(std::move(item)); !s.ok()) done(s);
  }

 private:
  Batcher batcher_;
};

}  // namespace hsx

#endif  // HSX_CLIENT_DUMP_IN_PROCESS_EXTRACTOR_H_
