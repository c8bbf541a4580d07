// host_buffer_pool.cc: a best-fit free list guarded by one mutex.
#include "server/model/host_buffer_pool.h"

#include <algorithm>
#include <map>
#include <mutex>

namespace hsx {

struct HostBufferPool::State {
  Allocator allocate;
  size_t max_idle_bytes = 0;
  std::mutex mutex;
  std::multimap<size_t, std::unique_ptr<HostBuffer>> idle;  // by capacity
  size_t idle_bytes = 0;
  int64_t allocations = 0;
  bool closed = false;  // the pool is gone: returned buffers are freed

  void Return(std::unique_ptr<HostBuffer> buffer) {
    std::unique_ptr<HostBuffer> drop;  // freed outside the lock
    std::lock_guard<std::mutex> lock(mutex);
    const size_t capacity = buffer->bytes();
    // Over the cap, a buffer is freed, unless nothing is idle: one buffer is
    // always kept, so a steady stream of batches larger than the cap reuses it.
    if (closed || (!idle.empty() && idle_bytes + capacity > max_idle_bytes)) {
      drop = std::move(buffer);
      return;
    }
    idle_bytes += capacity;
    idle.emplace(capacity, std::move(buffer));
  }
};

// What Get hands out: a view of `bytes` at the start of a pooled buffer.
class HostBufferPool::Lease : public HostBuffer {
 public:
  Lease(std::shared_ptr<State> state, std::unique_ptr<HostBuffer> buffer, size_t bytes)
      : state_(std::move(state)), buffer_(std::move(buffer)), bytes_(bytes) {}
  ~Lease() override { state_->Return(std::move(buffer_)); }
  void* data() const override { return buffer_->data(); }
  size_t bytes() const override { return bytes_; }

 private:
  std::shared_ptr<State> state_;
  std::unique_ptr<HostBuffer> buffer_;
  size_t bytes_;
};

namespace {

size_t RoundUp(size_t bytes) {
  if (bytes <= (1u << 16)) return bytes;
  size_t step = 1;
  while (step * 8 <= bytes) step <<= 1;  // bytes in [4 step, 8 step): granularity step
  step = std::max<size_t>(step / 2, 1);
  return (bytes + step - 1) / step * step;
}

class HeapBuffer : public HostBuffer {
 public:
  explicit HeapBuffer(size_t bytes) : data_(new char[bytes]), bytes_(bytes) {}
  void* data() const override { return data_.get(); }
  size_t bytes() const override { return bytes_; }

 private:
  std::unique_ptr<char[]> data_;  // uninitialised: callers overwrite it
  size_t bytes_;
};

}  // namespace

HostBufferPool::HostBufferPool(Allocator allocate, size_t max_idle_bytes) : state_(std::make_shared<State>()) {
  state_->allocate = std::move(allocate);
  state_->max_idle_bytes = max_idle_bytes;
}

HostBufferPool::~HostBufferPool() {
  std::multimap<size_t, std::unique_ptr<HostBuffer>> idle;
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    state_->closed = true;
    idle.swap(state_->idle);
    state_->idle_bytes = 0;
  }
}

absl::StatusOr<std::unique_ptr<HostBuffer>> HostBufferPool::Get(size_t bytes) {
  std::unique_ptr<HostBuffer> buffer;
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    auto it = state_->idle.lower_bound(bytes);
    if (it != state_->idle.end()) {
      state_->idle_bytes -= it->first;
      buffer = std::move(it->second);
      state_->idle.erase(it);
    } else {
      ++state_->allocations;
    }
  }
  if (buffer == nullptr) {
    // Nothing idle is large enough: allocate a little more than asked (a
    // quarter of the power of two at most), so that buffers of similar
    // sizes are interchangeable and a working set forms after warm-up.
    absl::StatusOr<std::unique_ptr<HostBuffer>> fresh = state_->allocate(RoundUp(bytes));
    if (!fresh.ok()) return fresh.status();
    buffer = *std::move(fresh);
  }
  return std::unique_ptr<HostBuffer>(new Lease(state_, std::move(buffer), bytes));
}

void HostBufferPool::RaiseIdleCap(size_t bytes) {
  std::lock_guard<std::mutex> lock(state_->mutex);
  state_->max_idle_bytes = std::max(state_->max_idle_bytes, bytes);
}

size_t HostBufferPool::idle_bytes() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->idle_bytes;
}

int64_t HostBufferPool::allocations() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->allocations;
}

HostBufferPool::Allocator HostBufferPool::HeapAllocator() {
  return [](size_t bytes) -> absl::StatusOr<std::unique_ptr<HostBuffer>> {
    return std::unique_ptr<HostBuffer>(new HeapBuffer(bytes));
  };
}

}  // namespace hsx
