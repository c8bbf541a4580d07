// state_bytes_pool.cc: the size classes and the idle list.
#include "format/state_bytes_pool.h"

#include <sys/mman.h>

#include <bit>
#include <cstdint>
#include <vector>

namespace hsx {
namespace {

// Asks for transparent huge pages over the 2 MiB-aligned part of a new block,
// before its first write: one fault per 2 MiB instead of 512 (where THP is
// "madvise" or "always"; elsewhere the advice is ignored).
void AdviseHugePages(char* block, size_t capacity) {
#ifdef MADV_HUGEPAGE
  constexpr uintptr_t kHuge = uintptr_t{2} << 20;
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(block) + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(block) + capacity) & ~(kHuge - 1);
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#endif
}

}  // namespace

size_t StateBytesPool::SizeClass(size_t size) {
  if (size < 64) return size;
  const size_t quarter = std::bit_floor(size) / 4;
  return (size + quarter - 1) / quarter * quarter;
}

StateBytes StateBytesPool::Take(size_t size) {
  if (size == 0) return StateBytes();
  size_t capacity = SizeClass(size);
  std::unique_ptr<char[]> block;
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
  if (block == nullptr) {
    block = std::make_unique_for_overwrite<char[]>(capacity);
    AdviseHugePages(block.get(), capacity);
  }
  return StateBytes(std::move(block), capacity, size, shared_from_this());
}

void StateBytesPool::Recycle(std::unique_ptr<char[]> block, size_t capacity) {
  std::vector<std::unique_ptr<char[]>> freed;  // freed after the lock is let go
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
  std::deque<std::pair<size_t, std::unique_ptr<char[]>>> freed;
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
