// piece_reader.h: reads bytes that lie in several pieces of memory (received
// gRPC slices; the pieces of a tensor kept as received) in order, without
// copying them.
//
// Used both to read a chunk message's protobuf framing across the slices it
// arrived in (StreamAssembler) and to walk the rows of several tensors kept as
// received pieces in file order (WriteSampleFile). Take() hands on a range as
// the sub-pieces it spans, which may split a piece anywhere.
#ifndef HSX_FORMAT_PIECE_READER_H_
#define HSX_FORMAT_PIECE_READER_H_

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

namespace hsx {

using BytePiece = std::span<const uint8_t>;

class PieceReader {
 public:
  // `pieces` must outlive the reader.
  explicit PieceReader(std::span<const BytePiece> pieces) : pieces_(pieces) { Skip(); }
  bool done() const { return index_ == pieces_.size(); }
  bool Byte(uint8_t* out) {
    if (done()) return false;
    *out = pieces_[index_][at_++];
    Skip();
    return true;
  }
  // A protobuf varint.
  bool Varint(uint64_t* out) {
    *out = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      uint8_t b;
      if (!Byte(&b)) return false;
      *out |= static_cast<uint64_t>(b & 0x7f) << shift;
      if ((b & 0x80) == 0) return true;
    }
    return false;
  }
  // Appends the next `length` bytes to `out` as sub-pieces; false when fewer
  // are left.
  bool Take(uint64_t length, std::vector<BytePiece>* out) {
    while (length > 0) {
      if (done()) return false;
      const BytePiece piece = pieces_[index_];
      const size_t n = static_cast<size_t>(std::min<uint64_t>(length, piece.size() - at_));
      out->push_back(piece.subspan(at_, n));
      at_ += n;
      length -= n;
      Skip();
    }
    return true;
  }

 private:
  void Skip() {
    while (index_ < pieces_.size() && at_ == pieces_[index_].size()) {
      ++index_;
      at_ = 0;
    }
  }
  std::span<const BytePiece> pieces_;
  size_t index_ = 0;
  size_t at_ = 0;
};

}  // namespace hsx

#endif  // HSX_FORMAT_PIECE_READER_H_
