// state_bytes.h: a block of a sample's encoded bytes (the stream
// assembler's, which SampleTensors' pieces then view).
//
// A heap block whose size is fixed when it is allocated and whose bytes are
// left uninitialised then, because whoever allocates it writes every byte
// (the stream assembler copies each received row in; the encoder encodes each
// value): std::string::resize would zero-fill the block first, a pass over
// every streamed byte (about 10% of hsx-dump's CPU per byte). Copies are deep;
// a moved-from block is empty; == compares the bytes.
//
// A block may come from a pool (state_bytes_pool.h) and go back to it when
// its StateBytes is destroyed or assigned over, instead of being freed.
#ifndef HSX_FORMAT_STATE_BYTES_H_
#define HSX_FORMAT_STATE_BYTES_H_

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <ostream>
#include <span>
#include <string_view>
#include <utility>

namespace hsx {

// A block's memory, from malloc or aligned_alloc (AllocateBlock), given back
// with free().
struct FreeBlock {
  void operator()(char* block) const { std::free(block); }
};
using BlockMemory = std::unique_ptr<char[], FreeBlock>;

// `size` bytes, not initialised, at an address that is a multiple of
// `alignment` (0: malloc's; else a power of two that divides `size`).
// Throws std::bad_alloc when there is no memory, as new does.
inline BlockMemory AllocateBlock(size_t size, size_t alignment = 0) {
  void* block = alignment == 0 ? std::malloc(size) : std::aligned_alloc(alignment, size);
  if (block == nullptr && size > 0) throw std::bad_alloc();
  return BlockMemory(static_cast<char*>(block));
}

// Where a pooled block goes when its StateBytes lets go of it (see
// StateBytesPool); called from whichever thread destroys the StateBytes.
class StateBytesRecycler {
 public:
  virtual ~StateBytesRecycler() = default;
  virtual void Recycle(BlockMemory block, size_t capacity) = 0;
};

class StateBytes {
 public:
  StateBytes() = default;
  // The first `size` bytes of a pooled `block` of `capacity` bytes, which
  // goes back to `recycler` at the end (StateBytesPool::Take makes these).
  StateBytes(BlockMemory block, size_t capacity, size_t size, std::shared_ptr<StateBytesRecycler> recycler)
      : data_(std::move(block)), size_(size), capacity_(capacity), recycler_(std::move(recycler)) {}
  ~StateBytes() { Release(); }
  // `size` bytes, not initialised: the caller writes all of them.
  explicit StateBytes(size_t size) : data_(AllocateBlock(size)), size_(size) {}
  // A copy of `bytes`.
  explicit StateBytes(std::string_view bytes) : StateBytes(bytes.size()) {
    if (size_ > 0) std::memcpy(data_.get(), bytes.data(), size_);
  }

  StateBytes(const StateBytes& other) : StateBytes(other.view()) {}
  StateBytes& operator=(const StateBytes& other) {
    if (this != &other) *this = StateBytes(other.view());
    return *this;
  }
  StateBytes(StateBytes&& other) noexcept
      : data_(std::move(other.data_)), size_(std::exchange(other.size_, 0)),
        capacity_(std::exchange(other.capacity_, 0)), recycler_(std::move(other.recycler_)) {}
  StateBytes& operator=(StateBytes&& other) noexcept {
    if (this != &other) {
      Release();
      data_ = std::move(other.data_);
      size_ = std::exchange(other.size_, 0);
      capacity_ = std::exchange(other.capacity_, 0);
      recycler_ = std::move(other.recycler_);
    }
    return *this;
  }

  char* data() { return data_.get(); }
  const char* data() const { return data_.get(); }
  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  std::string_view view() const { return {data_.get(), size_}; }
  std::span<const uint8_t> bytes() const { return {reinterpret_cast<const uint8_t*>(data_.get()), size_}; }

  friend bool operator==(const StateBytes& a, const StateBytes& b) { return a.view() == b.view(); }
  // For test failure messages: the size, not megabytes of values.
  friend std::ostream& operator<<(std::ostream& out, const StateBytes& b) {
    return out << "StateBytes(" << b.size() << " bytes)";
  }

 private:
  // Hands a pooled block back (a plain one is freed by data_'s destructor).
  void Release() {
    if (recycler_ != nullptr && data_ != nullptr) recycler_->Recycle(std::move(data_), capacity_);
    recycler_.reset();
  }

  BlockMemory data_;
  size_t size_ = 0;
  size_t capacity_ = 0;                           // of a pooled block
  std::shared_ptr<StateBytesRecycler> recycler_;  // set for a pooled block
};

}  // namespace hsx

#endif  // HSX_FORMAT_STATE_BYTES_H_
