// uncached_copy.h: a copy whose stores bypass the caches (non-temporal
// stores), for bytes that are written once and read much later.
//
// Why: a plain copy into memory that is not in the cache first reads each
// destination line into the cache (read-for-ownership) and later writes it
// back, so each byte crosses the memory bus three times; non-temporal stores
// write the line whole, and it crosses twice. The Python client's native
// receive path assembles every received sample (tens of megabytes, far more
// than a core's L2 cache) this way: in 16 KiB pieces into 1 GiB, 0.044 against
// memcpy's 0.084 CPU-ns per byte (bench/copy_bench.cc, docs/BENCHMARKS.md).
// Bytes copied this way are not in the cache afterwards: for small copies
// that are read soon, memcpy is the better choice.
//
// Guarantees: `to` holds `from`'s bytes as with memcpy, at any alignment of
// either; the calling thread reads them back as usual. The stores are weakly
// ordered with respect to other threads: call FenceUncachedCopies() before
// another thread may read the bytes (before publishing them). On other
// architectures than x86-64 both are memcpy and nothing.
#ifndef HSX_FORMAT_UNCACHED_COPY_H_
#define HSX_FORMAT_UNCACHED_COPY_H_

#include <cstddef>

namespace hsx {

void CopyUncached(void* to, const void* from, size_t n);
void FenceUncachedCopies();

}  // namespace hsx

#endif  // HSX_FORMAT_UNCACHED_COPY_H_
