// response_framing.h: ExtractResponse messages as gRPC byte buffers, with a
// chunk's row bytes referenced, not copied.
//
// The bytes are exactly what the generated ExtractResponse serializer writes
// (proto3: fields at their default value are omitted, fields in number
// order), so the wire format is unchanged and every client parses them with
// its generated code (tests/unit/response_framing_test.cc parses them back).
// A chunk is two slices: a few bytes of hand-encoded framing (the oneof tag,
// the Chunk's length, capture_id, first_row, num_rows and the data field's
// tag and length) and a slice aliasing the encoded rows. The rows' owner is
// kept alive by the slice and released in its destroy callback, when gRPC has
// written the bytes to the socket (not at OnWriteDone, which can come first).
#ifndef HSX_FORMAT_RESPONSE_FRAMING_H_
#define HSX_FORMAT_RESPONSE_FRAMING_H_

#include <cstddef>
#include <cstdint>
#include <memory>

#include <grpcpp/support/byte_buffer.h>

#include "hsx/v1/hsx.pb.h"

namespace hsx {

// A whole message, serialized into one slice (header, summary, trailer).
grpc::ByteBuffer SerializeResponse(const v1::ExtractResponse& message);

// ExtractResponse{chunk: {capture_id, first_row, num_rows, data}} where data
// is [data, data + size); `owner` keeps those bytes alive until gRPC is done.
grpc::ByteBuffer ChunkResponse(int32_t capture_id, int64_t first_row, int64_t num_rows, const char* data,
                               size_t size, std::shared_ptr<const void> owner);

}  // namespace hsx

#endif  // HSX_FORMAT_RESPONSE_FRAMING_H_
