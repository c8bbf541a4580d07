// state_bytes.h: the bytes of one encoded tensor of a sample (EncodedSample's
// hidden_states and final_norm).
//
// A heap block whose size is fixed when it is allocated and whose bytes are
// left uninitialised then, because whoever allocates it writes every byte
// (the stream assembler copies each received row in; the encoder encodes each
// value): std::string::resize would zero-fill the block first, a pass over
// every streamed byte (about 10% of hsx-dump's CPU per byte). Copies are deep;
// a moved-from block is empty; == compares the bytes.
#ifndef HSX_FORMAT_STATE_BYTES_H_
#define HSX_FORMAT_STATE_BYTES_H_

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <ostream>
#include <span>
#include <string_view>
#include <utility>

namespace hsx {

class StateBytes {
 public:
  StateBytes() = default;
  // `size` bytes, not initialised: the caller writes all of them.
  explicit StateBytes(size_t size) : data_(std::make_unique_for_overwrite<char[]>(size)), size_(size) {}
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
      : data_(std::move(other.data_)), size_(std::exchange(other.size_, 0)) {}
  StateBytes& operator=(StateBytes&& other) noexcept {
    data_ = std::move(other.data_);
    size_ = std::exchange(other.size_, 0);
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
  std::unique_ptr<char[]> data_;
  size_t size_ = 0;
};

}  // namespace hsx

#endif  // HSX_FORMAT_STATE_BYTES_H_
