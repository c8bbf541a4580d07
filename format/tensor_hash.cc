// tensor_hash.cc: XXH64 through libxxhash; XXH3 through the widest build the
// CPU runs (picked once, at first use).
#include "format/tensor_hash.h"

#define XXH_STATIC_LINKING_ONLY  // sizeof(XXH3_state_t), to check the builds agree
#include <xxhash.h>

#include <cstdlib>

namespace hsx {

#if defined(HSX_XXH3_X86)
extern "C" {
size_t hsx_xxh3_avx2_state_size(void);
void hsx_xxh3_avx2_reset(void* state);
void hsx_xxh3_avx2_update(void* state, const void* bytes, size_t n);
unsigned long long hsx_xxh3_avx2_digest(const void* state);
size_t hsx_xxh3_avx512_state_size(void);
void hsx_xxh3_avx512_reset(void* state);
void hsx_xxh3_avx512_update(void* state, const void* bytes, size_t n);
unsigned long long hsx_xxh3_avx512_digest(const void* state);
}
#endif

namespace {

std::vector<Xxh3Build> FindBuilds() {
  std::vector<Xxh3Build> builds;
#if defined(HSX_XXH3_X86)
  // A build compiled from another xxhash.h than libxxhash's would disagree on
  // the state's layout: then it is not used.
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      hsx_xxh3_avx512_state_size() == sizeof(XXH3_state_t)) {
    builds.push_back({"avx512", hsx_xxh3_avx512_reset, hsx_xxh3_avx512_update,
                      [](const void* s) -> uint64_t { return hsx_xxh3_avx512_digest(s); }});
  }
  if (__builtin_cpu_supports("avx2") && hsx_xxh3_avx2_state_size() == sizeof(XXH3_state_t)) {
    builds.push_back({"avx2", hsx_xxh3_avx2_reset, hsx_xxh3_avx2_update,
                      [](const void* s) -> uint64_t { return hsx_xxh3_avx2_digest(s); }});
  }
#endif
  builds.push_back({"libxxhash", [](void* s) { XXH3_64bits_reset(static_cast<XXH3_state_t*>(s)); },
                    [](void* s, const void* p, size_t n) { XXH3_64bits_update(static_cast<XXH3_state_t*>(s), p, n); },
                    [](const void* s) -> uint64_t { return XXH3_64bits_digest(static_cast<const XXH3_state_t*>(s)); }});
  return builds;
}

}  // namespace

const char* ChecksumKindName(ChecksumKind kind) { return kind == ChecksumKind::kXxh3 ? "xxh3_64" : "xxh64"; }

std::optional<ChecksumKind> ParseChecksumKind(std::string_view name) {
  if (name == "xxh64") return ChecksumKind::kXxh64;
  if (name == "xxh3") return ChecksumKind::kXxh3;
  return std::nullopt;
}

const std::vector<Xxh3Build>& RunnableXxh3Builds() {
  static const std::vector<Xxh3Build> builds = FindBuilds();
  return builds;
}

TensorHash::TensorHash(ChecksumKind kind)
    : TensorHash(kind == ChecksumKind::kXxh3 ? &RunnableXxh3Builds().front() : nullptr) {}

TensorHash::TensorHash(const Xxh3Build& build) : TensorHash(&build) {}

TensorHash::TensorHash(const Xxh3Build* xxh3)
    : kind_(xxh3 != nullptr ? ChecksumKind::kXxh3 : ChecksumKind::kXxh64), xxh3_(xxh3),
      state_(xxh3 != nullptr ? static_cast<void*>(XXH3_createState()) : static_cast<void*>(XXH64_createState())) {
  if (state_ == nullptr) std::abort();  // out of memory for a few hundred bytes
  Reset();
}

TensorHash::~TensorHash() {
  if (xxh3_ != nullptr) {
    XXH3_freeState(static_cast<XXH3_state_t*>(state_));
  } else {
    XXH64_freeState(static_cast<XXH64_state_t*>(state_));
  }
}

void TensorHash::Reset() {
  if (xxh3_ != nullptr) {
    xxh3_->reset(state_);
  } else {
    XXH64_reset(static_cast<XXH64_state_t*>(state_), 0);
  }
}

void TensorHash::Update(const void* bytes, size_t n) {
  if (xxh3_ != nullptr) {
    xxh3_->update(state_, bytes, n);
  } else {
    XXH64_update(static_cast<XXH64_state_t*>(state_), bytes, n);
  }
}

uint64_t TensorHash::Digest() const {
  return xxh3_ != nullptr ? xxh3_->digest(state_) : XXH64_digest(static_cast<const XXH64_state_t*>(state_));
}

}  // namespace hsx
