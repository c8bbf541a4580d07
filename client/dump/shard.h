// shard.h: --shard I/N, the samples one hsx-dump process of N takes (and
// hsx-verify expects): those whose index % N == I.
#ifndef HSX_CLIENT_DUMP_SHARD_H_
#define HSX_CLIENT_DUMP_SHARD_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"

namespace hsx {

struct ShardSpec {
  int64_t index = 0;
  int64_t count = 1;
  bool Contains(int64_t sample_index) const { return sample_index % count == index; }
};

// "I/N" with 0 <= I < N; the error shows the expected form.
absl::StatusOr<ShardSpec> ParseShard(const std::string& text);

}  // namespace hsx

#endif  // HSX_CLIENT_DUMP_SHARD_H_
