// capture_views_test.cc: a batch's captures as one view per sample, each
// owning its own buffer; the selection of a request's tensors; the host
// buffer pool the captures come from (reuse, idle bounds, buffers that
// outlive the pool).
#include "server/model/capture_views.h"

#include <cstring>
#include <memory>
#include <vector>

#include <gtest/gtest.h>

#include "format/capture_spec.h"
#include "format/sample_tensors.h"
#include "server/model/host_buffer_pool.h"

namespace hsx {
namespace {

// A host buffer that records its release.
class WatchedBuffer : public HostBuffer {
 public:
  WatchedBuffer(size_t bytes, int* released) : data_(bytes), released_(released) {}
  ~WatchedBuffer() override { ++*released_; }
  void* data() const override { return const_cast<char*>(data_.data()); }
  size_t bytes() const override { return data_.size(); }

 private:
  std::vector<char> data_;
  int* released_;
};

TEST(CaptureViewsTest, EachSampleOwnsItsBufferAlone) {
  Captures captures;
  captures.ids = {0, 2};
  captures.has_final_norm = true;
  captures.hidden = 4;
  captures.type = ElementType::kF32;
  captures.cu_seqlens = {0, 3, 4, 9};
  captures.tokens = 9;
  int released = 0;
  for (int64_t s = 0; s < captures.num_samples(); ++s) {
    captures.samples.push_back(std::make_unique<WatchedBuffer>(captures.SampleBytes(s), &released));
    float* rows = static_cast<float*>(captures.samples.back()->data());
    const int64_t count = captures.SampleBytes(s) / 4;
    for (int64_t i = 0; i < count; ++i) rows[i] = static_cast<float>(1000 * s + i);
  }
  float row[4];
  captures.LayerRow(1, 5, row);  // sample 2, its row 1, of tensor 1: [tensor][5 rows][4]
  EXPECT_EQ(row[0], 2000.0f + (1 * 5 + 1) * 4);
  captures.FinalNormRow(3, row);  // sample 1's only row of tensor 2
  EXPECT_EQ(row[3], 1000.0f + 2 * 4 + 3);
  std::vector<SampleTensors> views = ViewBySample(std::move(captures));
  ASSERT_EQ(views.size(), 3u);
  auto first_value = [](const SampleTensor& tensor) {
    return reinterpret_cast<const float*>(tensor.pieces[0].data())[0];
  };
  for (size_t s = 0; s < views.size(); ++s) {
    EXPECT_EQ(views[s].held_bytes, views[s].bytes()) << s;
    EXPECT_EQ(first_value(views[s].tensors[0]), 1000.0f * s);
  }
  EXPECT_EQ(views[2].tokens, 5);
  EXPECT_EQ(first_value(views[2].tensors.back()), 2000.0f + 2 * 5 * 4);
  views[1] = SampleTensors();
  EXPECT_EQ(released, 1) << "a sample's buffer must go back as soon as its view does";
  SampleTensors subset = SelectCaptures(std::move(views[0]), *CaptureSpec::Make({2}, false, 2));
  EXPECT_EQ(subset.bytes() * 3, subset.held_bytes) << "a subset still holds the whole sample";
}

// The capture check's findings follow the tensors a request keeps.
TEST(CaptureViewsTest, TheCopysFindingsAreSelectedWithTheirTensors) {
  SampleTensors view;
  view.capture_ids = {0, 2, 5};
  view.tokens = 1;
  view.hidden = 1;
  view.dtype = OutputDType::kFp32;
  static const float rows[4] = {1, 2, 3, 4};
  for (int k = 0; k < 3; ++k) view.AddTensor(view.capture_ids[k], &rows[k]);
  view.AddTensor(-1, &rows[3]);
  for (uint64_t k = 0; k < 4; ++k) view.tensors[k].findings = TensorFindings{.checksum = 100 + k};
  struct Case {
    std::vector<int> ids;
    bool final_norm;
    std::vector<uint64_t> want;
  };
  for (const Case& c : {Case{{0, 2, 5}, true, {100, 101, 102, 103}}, Case{{0, 2, 5}, false, {100, 101, 102}},
                        Case{{5}, true, {102, 103}}, Case{{0, 5}, false, {100, 102}}}) {
    SampleTensors subset = SelectCaptures(view, *CaptureSpec::Make(c.ids, c.final_norm, 5));
    std::vector<uint64_t> got;
    for (const SampleTensor& tensor : subset.tensors) {
      ASSERT_TRUE(tensor.findings.has_value());
      got.push_back(tensor.findings->checksum);
    }
    EXPECT_EQ(got, c.want) << c.ids.size() << " ids, final norm " << c.final_norm;
    EXPECT_EQ(subset.capture_ids, c.ids);
    EXPECT_EQ(subset.has_final_norm(), c.final_norm);
  }
  // A tensor without findings stays without, beside those that have them.
  view.tensors[1].findings.reset();
  SampleTensors subset = SelectCaptures(view, *CaptureSpec::Make({2, 5}, false, 5));
  ASSERT_EQ(subset.tensors.size(), 2u);
  EXPECT_FALSE(subset.tensors[0].findings.has_value());
  EXPECT_EQ(subset.tensors[1].findings->checksum, 102u);
}

TEST(HostBufferPoolTest, ReusesAndBoundsIdleBuffers) {
  HostBufferPool pool(HostBufferPool::HeapAllocator(), 3 << 20);
  void* first;
  {
    auto a = pool.Get(2 << 20);
    ASSERT_TRUE(a.ok());
    first = (*a)->data();
    EXPECT_EQ((*a)->bytes(), size_t{2} << 20);
  }
  EXPECT_GE(pool.idle_bytes(), size_t{2} << 20);
  {
    auto b = pool.Get(1 << 20);  // fits in the idle one: no new allocation
    ASSERT_TRUE(b.ok());
    EXPECT_EQ((*b)->data(), first);
    EXPECT_EQ((*b)->bytes(), size_t{1} << 20);
    EXPECT_EQ(pool.idle_bytes(), 0u);
  }
  EXPECT_EQ(pool.allocations(), 1);
  {
    auto c = pool.Get(2 << 20);
    auto d = pool.Get(2 << 20);  // two at once: a second buffer
    EXPECT_NE((*c)->data(), (*d)->data());
  }
  EXPECT_EQ(pool.allocations(), 2);
  EXPECT_LE(pool.idle_bytes(), size_t{3} << 20) << "kept more idle than the cap";
  EXPECT_GT(pool.idle_bytes(), 0u);
}

TEST(HostBufferPoolTest, ARaisedCapKeepsAWholeBatchOfBuffers) {
  // A batch's captures are one buffer per sample: with the cap raised to the
  // batch's total, the next batch of the same shape allocates nothing.
  HostBufferPool pool(HostBufferPool::HeapAllocator(), 1 << 20);
  auto batch = [&pool] {
    std::vector<std::unique_ptr<HostBuffer>> buffers;
    for (int i = 0; i < 4; ++i) buffers.push_back(*pool.Get(1 << 20));
  };
  batch();
  batch();
  EXPECT_EQ(pool.allocations(), 7) << "the default cap keeps one of the four";
  pool.RaiseIdleCap(4 << 20);
  batch();
  const int64_t before = pool.allocations();
  batch();
  EXPECT_EQ(pool.allocations(), before);
  EXPECT_EQ(pool.idle_bytes(), size_t{4} << 20);
  pool.RaiseIdleCap(1 << 20);  // never lowers it
  batch();
  EXPECT_EQ(pool.allocations(), before);
}

TEST(HostBufferPoolTest, BuffersMayOutliveThePool) {
  std::unique_ptr<HostBuffer> kept;
  {
    HostBufferPool pool(HostBufferPool::HeapAllocator(), 1 << 20);
    kept = *pool.Get(4096);
    std::memset(kept->data(), 1, 4096);
  }
  kept.reset();  // freed, not returned to a destroyed pool (ASan would object)
}

}  // namespace
}  // namespace hsx
