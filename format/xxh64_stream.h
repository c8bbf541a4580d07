// xxh64_stream.h: XXH64 (seed 0) of bytes fed piece by piece: the one
// streaming hash behind every checksum hsx writes or checks (the wire's
// per-tensor checksums, sample files' digests, input files, checkpoints).
#ifndef HSX_FORMAT_XXH64_STREAM_H_
#define HSX_FORMAT_XXH64_STREAM_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include <xxhash.h>

#include "absl/strings/str_format.h"

namespace hsx {

class Xxh64Stream {
 public:
  Xxh64Stream() : state_(XXH64_createState()) { Reset(); }
  ~Xxh64Stream() { XXH64_freeState(state_); }
  Xxh64Stream(const Xxh64Stream&) = delete;
  Xxh64Stream& operator=(const Xxh64Stream&) = delete;

  // Starts over, as if nothing had been fed.
  void Reset() { XXH64_reset(state_, 0); }
  void Update(const void* bytes, size_t n) { XXH64_update(state_, bytes, n); }
  // Of everything fed since the last Reset; feeding may go on.
  uint64_t Digest() const { return XXH64_digest(state_); }
  // The same as 16 lowercase hex digits (how manifests and headers print it).
  std::string HexDigest() const { return absl::StrFormat("%016x", Digest()); }

 private:
  XXH64_state_t* state_;
};

}  // namespace hsx

#endif  // HSX_FORMAT_XXH64_STREAM_H_
