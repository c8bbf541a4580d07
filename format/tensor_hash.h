// tensor_hash.h: the checksum of one streamed tensor, fed piece by piece:
// XXH64, what every hsx-server sends, or XXH3 (64-bit), which a client asks
// for with ExtractRequest.checksum (docs/api.md, "Checksums"). Both seed 0.
//
// Why two: on the streaming path every byte is hashed once on each side, and
// XXH64 is scalar (about 0.12 ns per byte in cache), while XXH3 runs in vector
// registers (0.03-0.05 ns per byte with AVX-512 or AVX2). XXH3 runs the widest
// build this CPU can execute: Debian's xxhash.h compiled for AVX-512 and for
// AVX2 (xxh3_simd.c), else libxxhash's own build. xxhash guarantees every
// build gives the same digest; the tests compare each one this CPU runs with
// libxxhash's one-shot XXH3_64bits.
#ifndef HSX_FORMAT_TENSOR_HASH_H_
#define HSX_FORMAT_TENSOR_HASH_H_

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>
#include <vector>

namespace hsx {

enum class ChecksumKind { kXxh64, kXxh3 };

// "xxh64" or "xxh3_64" (logs and error messages).
const char* ChecksumKindName(ChecksumKind kind);

// A checksum as flags and request tables name it: "xxh64" or "xxh3"; else nullopt.
std::optional<ChecksumKind> ParseChecksumKind(std::string_view name);

// One compiled XXH3 implementation behind a common signature; `state` is an
// XXH3_state_t from XXH3_createState (every build shares its layout).
struct Xxh3Build {
  const char* name;  // "avx512", "avx2" or "libxxhash"
  void (*reset)(void* state);
  void (*update)(void* state, const void* bytes, size_t n);
  uint64_t (*digest)(const void* state);
};

// The builds this CPU can run, the one TensorHash uses first.
const std::vector<Xxh3Build>& RunnableXxh3Builds();

class TensorHash {
 public:
  explicit TensorHash(ChecksumKind kind = ChecksumKind::kXxh64);
  // For tests: XXH3 through a given build.
  explicit TensorHash(const Xxh3Build& build);
  ~TensorHash();
  TensorHash(const TensorHash&) = delete;
  TensorHash& operator=(const TensorHash&) = delete;

  // Starts over, as if nothing had been fed.
  void Reset();
  void Update(const void* bytes, size_t n);
  // Of everything fed since the last Reset; feeding may go on.
  uint64_t Digest() const;
  ChecksumKind kind() const { return kind_; }

 private:
  // XXH3 with `xxh3`, or XXH64 when it is null: what both public constructors make.
  explicit TensorHash(const Xxh3Build* xxh3);

  ChecksumKind kind_;
  const Xxh3Build* xxh3_ = nullptr;  // kXxh3 only
  void* state_;                      // XXH64_state_t or XXH3_state_t
};

}  // namespace hsx

#endif  // HSX_FORMAT_TENSOR_HASH_H_
