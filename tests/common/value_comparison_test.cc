// value_comparison_test.cc: the message a failing CUDA-vs-reference comparison
// prints, checked on two buffers made to differ on purpose (runs on the CPU).
#include "tests/common/value_comparison.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

namespace hsx::testing {
namespace {

// A [4, 6] buffer and a copy with ten elements changed: elements 2, 3, 7, 9,
// 11, 13, 17, 19 and 23 by more than the tolerance, element 20 by less.
struct TwoBuffers {
  std::vector<float> want;
  std::vector<float> got;
  TwoBuffers() {
    for (int i = 0; i < 24; ++i) want.push_back(0.25f * static_cast<float>(i) - 2.0f);
    got = want;
    for (int i : {2, 3, 7, 9, 11, 13, 17, 19, 23}) got[i] += 0.125f;
    got[13] = 10.0f;        // the worst: want 1.25, error 8.75 / 1.25 = 7
    got[20] += 0.0009765625f;  // inside a 0.01 tolerance
  }
};

TEST(ValueComparison, MessageNamesOpShapeDtypeCountWorstAndFirstEight) {
  const TwoBuffers b;
  const ComparedValues what{"RmsNorm", {4, 6}, "bf16"};
  const ::testing::AssertionResult result = ValuesMatch(what, b.got, b.want, 0.01);
  ASSERT_FALSE(result);
  EXPECT_EQ(std::string(result.message()),
            "RmsNorm [4, 6] bf16: 9 of 24 elements outside tolerance 0.01 (|got - want| / max(1, |want|)); "
            "worst at 13 [2, 1] got 10 want 1.25 (error 7); first 8 outside: "
            "2 [0, 2] got -1.375 want -1.5; 3 [0, 3] got -1.125 want -1.25; 7 [1, 1] got -0.125 want -0.25; "
            "9 [1, 3] got 0.375 want 0.25; 11 [1, 5] got 0.875 want 0.75; 13 [2, 1] got 10 want 1.25; "
            "17 [2, 5] got 2.375 want 2.25; 19 [3, 1] got 2.875 want 2.75");
}

TEST(ValueComparison, BitwiseCountsEveryDifferingElement) {
  const TwoBuffers b;
  const ::testing::AssertionResult result = ValuesMatch({"Linear", {24}, "fp32"}, b.got, b.want, 0);
  ASSERT_FALSE(result);
  EXPECT_NE(std::string(result.message()).find("Linear [24] fp32: 10 of 24 elements not bitwise equal; worst at 13 [13]"),
            std::string::npos)
      << result.message();
}

TEST(ValueComparison, EqualBuffersMatchAndCloseOnesMatchWithinTheirTolerance) {
  const TwoBuffers b;
  EXPECT_TRUE(ValuesMatch({"Add", {4, 6}, "fp32"}, b.want, b.want, 0));
  std::vector<float> close = b.want;
  close[5] += 1e-3f;
  EXPECT_TRUE(ValuesMatch({"Add", {4, 6}, "fp32"}, close, b.want, 1e-2));
  EXPECT_FALSE(ValuesMatch({"Add", {4, 6}, "fp32"}, close, b.want, 0));
}

TEST(ValueComparison, NanOnOneSideSignedZerosAndSizesAreReported) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<float> want = {1, 0.0f, 3};
  const std::vector<float> got = {nan, -0.0f, 3};
  const Mismatches loose = FindMismatches(got, want, 0.5);
  EXPECT_EQ(loose.outside, 1);  // the NaN; -0 is within any tolerance
  EXPECT_TRUE(std::isinf(loose.worst.error));
  EXPECT_EQ(FindMismatches(got, want, 0).outside, 2);  // bitwise: -0 is not +0
  const ::testing::AssertionResult shorter = ValuesMatch({"Embed", {3}, "fp32"}, {want.data(), 2}, want, 0);
  ASSERT_FALSE(shorter);
  EXPECT_NE(std::string(shorter.message()).find("got 2 elements, want 3"), std::string::npos) << shorter.message();
}

TEST(ValueComparison, Bf16BitsNameTheElementAndCanTreatNansAsEqual) {
  const std::vector<uint16_t> want = {0x3F80, 0x7FC1, 0x4000};  // 1, a NaN, 2
  const std::vector<uint16_t> got = {0x3F80, 0x7FC2, 0x4040};   // 1, another NaN, 3
  const ::testing::AssertionResult strict = Bf16BitsMatch({"DequantizeInt4", {1, 3}, "bf16"}, got, want);
  ASSERT_FALSE(strict);
  EXPECT_NE(std::string(strict.message()).find("2 of 3 elements not bitwise equal"), std::string::npos);
  const ::testing::AssertionResult nans_equal = Bf16BitsMatch({"DequantizeInt4", {1, 3}, "bf16"}, got, want, true);
  ASSERT_FALSE(nans_equal);
  EXPECT_NE(std::string(nans_equal.message()).find("1 of 3 elements not bitwise equal; worst at 2 [0, 2] got 3 want 2"),
            std::string::npos)
      << nans_equal.message();
}

TEST(ValueComparison, UlpDistanceNamesTheElementsMoreThanTheLimitApart) {
  const std::vector<float> want = {1.0f, 2.0f, -3.0f};
  std::vector<float> got = want;
  got[0] = std::nextafter(1.0f, 2.0f);                           // 1 ulp
  got[2] = std::nextafter(std::nextafter(-3.0f, -4.0f), -4.0f);  // 2 ulps
  EXPECT_TRUE(ValuesWithinUlps({"SiluMul", {3}, "fp32"}, got, want, 2));
  const ::testing::AssertionResult result = ValuesWithinUlps({"SiluMul", {3}, "fp32"}, got, want, 1);
  ASSERT_FALSE(result);
  EXPECT_NE(std::string(result.message()).find("1 of 3 elements more than 1 float ulps apart; worst at 2 [2] got "
                                               "-3.00000048 want -3 (error 2)"),
            std::string::npos)
      << result.message();
}

TEST(ValueComparison, CoordinatesAreRowMajor) {
  EXPECT_EQ(Coordinates(0, {4, 6}), "[0, 0]");
  EXPECT_EQ(Coordinates(23, {4, 6}), "[3, 5]");
  EXPECT_EQ(Coordinates(29, {2, 3, 5}), "[1, 2, 4]");
}

}  // namespace
}  // namespace hsx::testing
