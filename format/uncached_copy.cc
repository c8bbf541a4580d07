// uncached_copy.cc: SSE2's streaming stores (every x86-64 CPU has them; on
// the development VM's AMD EPYC the 512-bit ones were no faster, the bus is
// the limit).
#include "format/uncached_copy.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <emmintrin.h>
#endif

namespace hsx {

#if defined(__x86_64__)

void CopyUncached(void* to, const void* from, size_t n) {
  auto* out = static_cast<char*>(to);
  const auto* in = static_cast<const char*>(from);
  // Streaming stores need an aligned destination: the head up to the next
  // 16-byte boundary is copied as usual, as is the tail under 64 bytes.
  const size_t head = std::min(n, static_cast<size_t>(-reinterpret_cast<uintptr_t>(out) & 15));
  std::memcpy(out, in, head);
  out += head;
  in += head;
  n -= head;
  for (; n >= 64; n -= 64, out += 64, in += 64) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + 32));
    const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(out), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(out + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(out + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(out + 48), d);
  }
  std::memcpy(out, in, n);
}

void FenceUncachedCopies() { _mm_sfence(); }

#else

void CopyUncached(void* to, const void* from, size_t n) { std::memcpy(to, from, n); }
void FenceUncachedCopies() {}

#endif

}  // namespace hsx
