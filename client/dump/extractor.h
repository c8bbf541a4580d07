// extractor.h: where hsx-dump gets a sample's hidden states from. The
// in-process engine (in_process_extractor.h) and a remote hsx-server
// (remote_extractor.h) are two implementations; all that follows (verification, atomic writes, the
// journal, progress) is shared and starts from the same SampleTensors: the
// states already in the output dtype, exactly the bytes that go to disk.
#ifndef HSX_CLIENT_DUMP_EXTRACTOR_H_
#define HSX_CLIENT_DUMP_EXTRACTOR_H_

#include <functional>
#include <memory>
#include <utility>

#include "absl/status/statusor.h"
#include "client/dump/input.h"
#include "format/capture_spec.h"
#include "format/encoding.h"
#include "format/tensor_hash.h"
#include "format/sample_file.h"

namespace hsx {

// What to extract for every sample.
struct ExtractSpec {
  CaptureSpec capture;  // ids ascending
  OutputDType dtype = OutputDType::kBf16;
  // False when the caller only verifies and drops each sample (--discard):
  // an extractor may then check the states as they arrive and deliver the
  // sample without them (SampleTensors::dropped), which VerifySample accepts.
  bool keep_states = true;
  // The Trailer's checksum to ask a server for (the in-process extractor
  // has no stream and ignores it).
  ChecksumKind checksum = ChecksumKind::kXxh64;
};

class Extractor {
 public:
  using Done = std::function<void(absl::StatusOr<SampleTensors>)>;
  virtual ~Extractor() = default;
  // Starts one sample; `done` is called exactly once, from any thread (possibly
  // before Extract returns). `sample` must stay alive until then.
  virtual void Extract(const InputSample& sample, const ExtractSpec& spec, Done done) = 0;
  // Gives up on everything in flight (after a failure or a signal): pending
  // samples finish soon, with an error. Extract after this fails at once.
  virtual void CancelAll() {}
};

}  // namespace hsx

#endif  // HSX_CLIENT_DUMP_EXTRACTOR_H_
