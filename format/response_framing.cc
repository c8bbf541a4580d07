// response_framing.cc: the protobuf wire encoding of a Chunk, by hand.
#include "format/response_framing.h"

#include <string>

#include <google/protobuf/io/coded_stream.h>
#include <grpcpp/support/slice.h>

namespace hsx {
namespace {

using google::protobuf::io::CodedOutputStream;

// Field tags: (number << 3) | wire type (0 varint, 2 length-delimited).
constexpr uint8_t kResponseChunkTag = (2 << 3) | 2;  // ExtractResponse.chunk
constexpr uint8_t kCaptureIdTag = (1 << 3) | 0;      // Chunk.capture_id
constexpr uint8_t kFirstRowTag = (2 << 3) | 0;       // Chunk.first_row
constexpr uint8_t kNumRowsTag = (3 << 3) | 0;        // Chunk.num_rows
constexpr uint8_t kDataTag = (4 << 3) | 2;           // Chunk.data

// Appends a varint field unless it holds the default (0), as proto3 does. An
// int32 is sign-extended to 64 bits first (negative ids take 10 bytes).
uint8_t* PutVarintField(uint8_t tag, int64_t value, uint8_t* p) {
  if (value == 0) return p;
  *p++ = tag;
  return CodedOutputStream::WriteVarint64ToArray(static_cast<uint64_t>(value), p);
}

size_t VarintFieldSize(int64_t value) {
  return value == 0 ? 0 : 1 + CodedOutputStream::VarintSize64(static_cast<uint64_t>(value));
}

void ReleaseOwner(void* owner) { delete static_cast<std::shared_ptr<const void>*>(owner); }

}  // namespace

grpc::ByteBuffer SerializeResponse(const v1::ExtractResponse& message) {
  const std::string bytes = message.SerializeAsString();
  grpc::Slice slice(bytes);
  return grpc::ByteBuffer(&slice, 1);
}

grpc::ByteBuffer ChunkResponse(int32_t capture_id, int64_t first_row, int64_t num_rows, const char* data,
                               size_t size, std::shared_ptr<const void> owner) {
  const size_t data_field = size == 0 ? 0 : 1 + CodedOutputStream::VarintSize64(size) + size;
  const size_t chunk_size =
      VarintFieldSize(capture_id) + VarintFieldSize(first_row) + VarintFieldSize(num_rows) + data_field;
  uint8_t framing[64];  // at most 1+10 + 3 * (1+10) + 1+10 = 55 bytes
  uint8_t* p = framing;
  *p++ = kResponseChunkTag;
  p = CodedOutputStream::WriteVarint64ToArray(chunk_size, p);
  p = PutVarintField(kCaptureIdTag, capture_id, p);
  p = PutVarintField(kFirstRowTag, first_row, p);
  p = PutVarintField(kNumRowsTag, num_rows, p);
  if (size == 0) {
    grpc::Slice head(framing, static_cast<size_t>(p - framing));
    return grpc::ByteBuffer(&head, 1);
  }
  *p++ = kDataTag;
  p = CodedOutputStream::WriteVarint64ToArray(size, p);
  grpc::Slice slices[2] = {
      grpc::Slice(framing, static_cast<size_t>(p - framing)),
      grpc::Slice(const_cast<char*>(data), size, &ReleaseOwner, new std::shared_ptr<const void>(std::move(owner))),
  };
  return grpc::ByteBuffer(slices, 2);
}

}  // namespace hsx
