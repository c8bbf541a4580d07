// extractor.h: where hsx-dump gets a sample's hidden states from. The
// in-process engine and a remote hsx-server are two implementations; all that
// follows (verification, atomic writes, the journal, progress) is shared.
#ifndef HSX_CLIENT_DUMP_EXTRACTOR_H_
#define HSX_CLIENT_DUMP_EXTRACTOR_H_

#include <functional>
#include <memory>

#include "absl/status/statusor.h"
#include "client/dump/input.h"
#include "server/model/forward.h"
#include "server/model/sample_states.h"
#include "server/runtime/batcher.h"
#include "server/runtime/engine.h"

namespace hsx {

class Extractor {
 public:
  using Done = std::function<void(absl::StatusOr<SampleStates>)>;
  virtual ~Extractor() = default;
  // Starts one sample; `done` is called exactly once, from any thread.
  virtual void Extract(const InputSample& sample, const CaptureSpec& capture, Done done) = 0;
};

// Runs the model in this process through the shared batcher.
class InProcessExtractor : public Extractor {
 public:
  InProcessExtractor(Engine& engine, const BatcherOptions& options) : batcher_(engine, options) {}
  void Extract(const InputSample& sample, const CaptureSpec& capture, Done done) override {
    WorkItem item{sample.input_ids, capture, done};
    if (absl::Status s = batcher_.Submit(std::move(item)); !s.ok()) done(s);
  }

 private:
  Batcher batcher_;
};

}  // namespace hsx

#endif  // HSX_CLIENT_DUMP_EXTRACTOR_H_
