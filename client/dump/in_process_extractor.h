// in_process_extractor.h: hsx-dump --model, the engine in this process: the
// one Extractor that needs the server's runtime (the remote one does not).
//
// The batcher's rows (the activation type: bf16 or f32; for --dtype fp8 on a
// device, fp8 rows the device encoded) become the file's bytes as the
// server's become its stream's: EncodeSample (one pass to the output dtype,
// checked and hashed; rows already in it used where they are), never through
// a float32 copy.
#ifndef HSX_CLIENT_DUMP_IN_PROCESS_EXTRACTOR_H_
#define HSX_CLIENT_DUMP_IN_PROCESS_EXTRACTOR_H_

#include <utility>

#include "client/dump/extractor.h"
#include "format/sample_encoding.h"
#include "server/model/host_buffer_pool.h"
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
    // XXH64: what the file records, so that WriteSampleFile need not hash
    // a tensor again.
    item.row_check = RowCheck{dtype, ChecksumKind::kXxh64};
    item.deliver = [dtype, done](absl::StatusOr<SampleTensors> rows) {
      if (!rows.ok()) {
        done(rows.status());
        return;
      }
      done(EncodeSample(*std::move(rows), dtype, ChecksumKind::kXxh64, HostBufferPool::HeapAllocator()));
    };
    if (absl::Status s = batcher_.Submit(std::move(item)); !s.ok()) done(s);
  }

 private:
  Batcher batcher_;
};

}  // namespace hsx

#endif  // HSX_CLIENT_DUMP_IN_PROCESS_EXTRACTOR_H_
