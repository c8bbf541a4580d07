// capture_spec_test.cc: the one normalisation of capture sets.
#include "format/capture_spec.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace hsx {
namespace {

using ::testing::HasSubstr;

TEST(CaptureSpecTest, MakeSortsAndDeduplicates) {
  absl::StatusOr<CaptureSpec> spec = CaptureSpec::Make({7, 2, 7, 0}, true, 7);
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->ids(), (std::vector<int>{0, 2, 7}));
  EXPECT_TRUE(spec->final_norm());
}

TEST(CaptureSpecTest, MakeNamesTheIdOutOfRange) {
  absl::StatusOr<CaptureSpec> spec = CaptureSpec::Make({1, 8}, false, 7, "capture_ids");
  EXPECT_EQ(spec.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(spec.status().message()), HasSubstr("capture_ids[1] = 8 is outside 0..7"));
  spec = CaptureSpec::Make({-1}, false, 7);
  EXPECT_THAT(std::string(spec.status().message()), HasSubstr("capture id -1 is outside 0..7"));
}

TEST(CaptureSpecTest, Eagle3AndAll) {
  EXPECT_EQ(CaptureSpec::Eagle3(61).ids(), (std::vector<int>{2, 30, 58, 61}));
  EXPECT_EQ(CaptureSpec::Eagle3(4).ids(), (std::vector<int>{1, 2, 4}));  // 2 = N/2 once
  EXPECT_EQ(CaptureSpec::All(3, true), (*CaptureSpec::Make({3, 2, 1, 0}, true, 3)));
}

TEST(CaptureSpecTest, Parse) {
  EXPECT_EQ(*CaptureSpec::Parse("eagle3", 61, false), CaptureSpec::Eagle3(61));
  EXPECT_EQ(*CaptureSpec::Parse("all", 2, true), CaptureSpec::All(2, true));
  EXPECT_EQ(CaptureSpec::Parse(" 3, 1,3", 4, false)->ids(), (std::vector<int>{1, 3}));
  EXPECT_THAT(std::string(CaptureSpec::Parse("1,x", 4, false).status().message()),
              HasSubstr("capture id 'x' is not an integer"));
  EXPECT_THAT(std::string(CaptureSpec::Parse("9", 4, false).status().message()),
              HasSubstr("capture id 9 is outside 0..4"));
  EXPECT_THAT(std::string(CaptureSpec::Parse("", 4, false).status().message()), HasSubstr("nothing to capture"));
  EXPECT_TRUE(CaptureSpec::Parse("", 4, true).ok());  // the final norm alone
}

TEST(CaptureSpecTest, TrainerPresetsHoldWhatEachTrainerReads) {
  // speculators: three auxiliary layers and N (its last column), no final norm.
  EXPECT_EQ(*CaptureSpec::Parse("speculators", 61, false), *CaptureSpec::Make({2, 30, 58, 61}, false, 61));
  EXPECT_EQ(*CaptureSpec::Parse("speculators", 61, true), *CaptureSpec::Make({2, 30, 58, 61}, true, 61));
  // SpecForge and ModelOpt: three auxiliary layers and the post-norm state, not N.
  for (const char* name : {"specforge", "modelopt"}) {
    EXPECT_EQ(*CaptureSpec::Parse(name, 61, false), *CaptureSpec::Make({2, 30, 58}, true, 61)) << name;
    EXPECT_EQ(*CaptureSpec::Parse(name, 61, true), *CaptureSpec::Make({2, 30, 58}, true, 61)) << name;
  }
  EXPECT_EQ(CaptureSpec::Parse("specforge", 8, false)->ids(), (std::vector<int>{2, 4, 5}));  // the tiny model
  EXPECT_EQ(CaptureSpec::Trainer("eagle3", 61).status().code(), absl::StatusCode::kNotFound);
}

TEST(CaptureSpecTest, UnknownNamesAreErrorsNamingThePresets) {
  for (const char* name : {"eagle4", "SpecForge", "speculators,", "modelopt 2", "none"}) {
    absl::StatusOr<CaptureSpec> spec = CaptureSpec::Parse(name, 61, false);
    EXPECT_EQ(spec.status().code(), absl::StatusCode::kInvalidArgument) << name;
    EXPECT_THAT(std::string(spec.status().message()),
                HasSubstr("one of eagle3, all, speculators, specforge, modelopt")) << name;
  }
}

TEST(CaptureSpecTest, UnionKeepsTheInvariant) {
  const CaptureSpec a = *CaptureSpec::Make({4, 1}, false, 4);
  const CaptureSpec b = *CaptureSpec::Make({0, 4}, true, 4);
  EXPECT_EQ(CaptureSpec::Union({&a, &b}), *CaptureSpec::Make({0, 1, 4}, true, 4));
  EXPECT_EQ(CaptureSpec::Union({}), CaptureSpec());
}

}  // namespace
}  // namespace hsx
