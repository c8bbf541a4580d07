// state_bytes_pool.h: blocks for StateBytes that are handed out again after
// their StateBytes is gone, instead of being freed.
//
// Why: a fresh block of tens of megabytes is fresh pages, and the first write
// to each 4 KiB page is a page fault in which the kernel zeroes the page;
// freeing it unmaps them again. In the Python client's native receive path,
// which assembles every sample into a block of its own, the pool took 0.3-0.4
// CPU-ns per byte off the stream (docs/BENCHMARKS.md). A block that comes
// back stays mapped, and a later sample is written into it.
//
// A new block of 2 MiB or more asks for transparent huge pages (madvise
// MADV_HUGEPAGE, where the kernel offers THP), so that warming it up costs
// one fault per 2 MiB rather than 512: 0.08 CPU-ns per byte less in a
// 64-sample Python client run (docs/BENCHMARKS.md). Such a block starts on a
// 2 MiB boundary and its capacity is a multiple of 2 MiB, so that huge pages
// cover all of it, not only its aligned middle (malloc's blocks begin 16
// bytes into a mapping: a 14 MiB block had 2 MiB of small pages, 512 faults).
//
// New blocks are sized in classes (a power of two times 1, 1.25, 1.5 or
// 1.75; from 2 MiB on, rounded up to a multiple of 2 MiB). A request takes
// the most recently returned idle block that holds it and is at most twice
// its class (samples of varied lengths reuse each other's blocks), or a new
// block of its class. At most `max_idle_bytes` of idle blocks are
// kept; beyond that the least recently returned are freed. Thread-safe; a
// StateBytes keeps its pool alive, so the two may die in any order.
#ifndef HSX_FORMAT_STATE_BYTES_POOL_H_
#define HSX_FORMAT_STATE_BYTES_POOL_H_

#include <cstddef>
#include <deque>
#include <memory>
#include <mutex>
#include <utility>

#include "format/state_bytes.h"

namespace hsx {

class StateBytesPool : public StateBytesRecycler, public std::enable_shared_from_this<StateBytesPool> {
 public:
  static std::shared_ptr<StateBytesPool> Create(size_t max_idle_bytes) {
    return std::shared_ptr<StateBytesPool>(new StateBytesPool(max_idle_bytes));
  }

  // The size class of `size` bytes: the capacity of the blocks that serve it.
  static size_t SizeClass(size_t size);

  // `size` bytes (not initialised), in an idle block (see above) or a new one.
  StateBytes Take(size_t size);

  void Recycle(BlockMemory block, size_t capacity) override;

  // Frees every idle block (blocks in use come back later as usual).
  void Clear();

  size_t idle_bytes() const;
  size_t idle_blocks() const;

 private:
  explicit StateBytesPool(size_t max_idle_bytes) : max_idle_bytes_(max_idle_bytes) {}

  const size_t max_idle_bytes_;
  mutable std::mutex mutex_;
  std::deque<std::pair<size_t, BlockMemory>> idle_;  // (capacity, block), newest last
  size_t idle_bytes_ = 0;
};

}  // namespace hsx

#endif  // HSX_FORMAT_STATE_BYTES_POOL_H_
