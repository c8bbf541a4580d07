// shard.cc: parsing --shard.
#include "client/dump/shard.h"

#include <vector>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace hsx {

absl::StatusOr<ShardSpec> ParseShard(const std::string& text) {
  std::vector<std::string> parts = absl::StrSplit(text, '/');
  ShardSpec shard;
  if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &shard.index) ||
      !absl::SimpleAtoi(parts[1], &shard.count) || shard.count < 1 || shard.index < 0 ||
      shard.index >= shard.count) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", text, "' is not I/N with 0 <= I < N (e.g. 0/4: samples 0, 4, 8, ...)"));
  }
  return shard;
}

}  // namespace hsx
