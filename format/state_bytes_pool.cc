// state_bytes_pool.cc: the size classes and the idle list.
#include "format/state_bytes_pool.h"

#include <sys/mman.h>

#include <bit>
#include <cstdint>
#include <vector>

namespace hsx {
namespace {

constexpr size_t kHugePage = size_t{2} << 20;

// A new block of `capacity` bytes (a multiple of kHugePage from kHugePage
// on, see SizeClass): from kHugePage on, aligned to it and given the advice
// to use transparent huge pages before its first write (where THP is
// "madvise" or "always"; elsewhere the advice is ignored).
BlockMemory NewBlock(size_t capacity) {
  if (capacity < kHugePage) return AllocateBlock(capacity);
  BlockMemory block = AllocateBlock(capacity, kHugePage);
#ifdef MADV_HUGEPAGE
  madvise(block.get(), capacity, MADV_HUGEPAGE);
#endif
  return block;
}

}  // namespace

size_t StateBytesPool::SizeClass(size_t size) {
  if (size < 64) return size;
  const size_t quarter = std::bit_floor(size) / 4;
  const size_t capacity = (size + quarter - 1) / quarter * quarter;
  return capacity < kHugePage ? capacity : (capacity + kHugePage - 1) / kHugePage * kHugePage;
}

StateBytes StateBytesPool::Take(size_t size) {
  if (size == 0) return StateBytes();
  size_t capacity = SizeClass(size);
  BlockMemory block;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto it = idle_.rbegin(); it != idle_.rend(); ++it) {  // the most recently used first: still cached
      if (it->first >= size && it->first <= 2 * capacity) {
        capacity = it->first;
        block = std::move(it->second);
        idle_.erase(std::next(it).base());
        idle_bytes_ -= capacity;
        break;
      }
    }
  }
  if (block == nullptr) block = NewBlock(capacity);
  return StateBytes(std::move(block), capacity, size, shared_from_this());
}

void StateBytesPool::Recycle(BlockMemory block, size_t capacity) {
  std::vector<BlockMemory> freed;  // freed after the lock is let go
  std::lock_guard<std::mutex> lock(mutex_);
  if (capacity > max_idle_bytes_) return;  // block is freed on return
  idle_.emplace_back(capacity, std::move(block));
  idle_bytes_ += capacity;
  while (idle_bytes_ > max_idle_bytes_) {
    idle_bytes_ -= idle_.front().first;
    freed.push_back(std::move(idle_.front().second));
    idle_.pop_front();
  }
}

void StateBytesPool::Clear() {
  std::deque<std::pair<size_t, BlockMemory>> freed;
  std::lock_guard<std::mutex> lock(mutex_);
  freed.swap(idle_);
  idle_bytes_ = 0;
}

size_t StateBytesPool::idle_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return idle_bytes_;
}

size_t StateBytesPool::idle_blocks() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return idle_.size();
}

}  // namespace hsx
