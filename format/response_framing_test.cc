// response_framing_test.cc: hand-framed chunk messages against the generated
// protobuf code: they parse as ExtractResponse, field by field and byte for
// byte, and a chunk's slice keeps its owner alive until gRPC lets it go.
#include "format/response_framing.h"

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <grpcpp/support/byte_buffer.h>
#include <gtest/gtest.h>

#include "format/test_values.h"
#include "hsx/v1/hsx.pb.h"

namespace hsx {
namespace {

using ::hsx::testing::Flatten;

TEST(ResponseFramingTest, ChunkBytesAreTheGeneratedSerialization) {
  const std::string data(100000, '\x5a');
  for (int32_t capture_id : {0, 3, 61, -1}) {
    for (int64_t first_row : {int64_t{0}, int64_t{1}, int64_t{300}, int64_t{1} << 40}) {
      for (size_t size : {size_t{0}, size_t{1}, size_t{127}, size_t{128}, size_t{100000}}) {
        const int64_t num_rows = static_cast<int64_t>(size % 7);
        v1::ExtractResponse want;
        v1::Chunk* chunk = want.mutable_chunk();
        chunk->set_capture_id(capture_id);
        chunk->set_first_row(first_row);
        chunk->set_num_rows(num_rows);
        chunk->set_data(data.substr(0, size));
        const std::string bytes =
            Flatten(ChunkResponse(capture_id, first_row, num_rows, data.data(), size, nullptr));
        EXPECT_EQ(bytes, want.SerializeAsString()) << capture_id << " " << first_row << " " << size;
        v1::ExtractResponse got;
        ASSERT_TRUE(got.ParseFromString(bytes));
        ASSERT_TRUE(got.has_chunk());
        EXPECT_EQ(got.chunk().capture_id(), capture_id);
        EXPECT_EQ(got.chunk().first_row(), first_row);
        EXPECT_EQ(got.chunk().num_rows(), num_rows);
        EXPECT_EQ(got.chunk().data(), data.substr(0, size));
      }
    }
  }
}

TEST(ResponseFramingTest, TheSliceKeepsItsOwnerUntilDestroyed) {
  auto owner = std::make_shared<std::string>(4096, 'x');
  std::weak_ptr<std::string> watch = owner;
  {
    grpc::ByteBuffer message = ChunkResponse(1, 0, 1, owner->data(), owner->size(), owner);
    owner.reset();
    EXPECT_FALSE(watch.expired()) << "released while gRPC still holds the slice";
    grpc::ByteBuffer copy(message);  // gRPC's own references
    message.Clear();
    EXPECT_FALSE(watch.expired());
  }
  EXPECT_TRUE(watch.expired()) << "never released";
}

}  // namespace
}  // namespace hsx
