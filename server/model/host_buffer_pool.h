// host_buffer_pool.h: reuse of large host buffers across batches.
//
// A batch's capture buffers (pinned on CUDA) and a sample's encoded response
// bytes are tens to hundreds of MB. Allocating them fresh for every batch
// costs a page fault per 4 KiB on first touch and an munmap on release, which
// was a third of the server's streaming CPU. The pool hands out buffers it
// already owns (best fit: the smallest idle one that is large enough) and
// takes them back when the handed-out HostBuffer is destroyed, on any thread.
//
// Guarantees: a buffer is never handed out twice at once; the pool keeps at
// most max(`max_idle_bytes`, one buffer) idle (a returned buffer over that is
// freed), so its memory is bounded by what is in use plus that; buffers in use
// may outlive the pool (they are then freed on release).
#ifndef HSX_SERVER_MODEL_HOST_BUFFER_POOL_H_
#define HSX_SERVER_MODEL_HOST_BUFFER_POOL_H_

#include <cstddef>
#include <functional>
#include <memory>

#include "absl/status/statusor.h"
#include "kernels/backend.h"

namespace hsx {

class HostBufferPool {
 public:
  using Allocator = std::function<absl::StatusOr<std::unique_ptr<HostBuffer>>(size_t bytes)>;

  HostBufferPool(Allocator allocate, size_t max_idle_bytes);
  ~HostBufferPool();
  HostBufferPool(const HostBufferPool&) = delete;
  HostBufferPool& operator=(const HostBufferPool&) = delete;

  // A buffer of exactly `bytes` (its data may lie in a larger idle buffer),
  // contents unspecified; it returns to the pool when destroyed.
  absl::StatusOr<std::unique_ptr<HostBuffer>> Get(size_t bytes);

  // Lets the pool keep at least `bytes` idle from now on (never lowers the
  // cap): what one batch's buffers add up to, so that a steady stream of
  // batches of many buffers reuses them all.
  void RaiseIdleCap(size_t bytes);

  // For tests and metrics.
  size_t idle_bytes() const;
  int64_t allocations() const;  // buffers the allocator had to make

  // Plain heap memory (malloc-backed), for buffers no device copies into.
  static Allocator HeapAllocator();

 private:
  struct State;
  class Lease;
  std::shared_ptr<State> state_;
};

}  // namespace hsx

#endif  // HSX_SERVER_MODEL_HOST_BUFFER_POOL_H_
