// value_comparison.h: one way to compare a device's values with a reference's,
// and a failure message that is enough to fix the bug from.
//
// Every CUDA-vs-reference check (per-op conformance, the backend tests, the
// whole-model, tensor-parallel and batch-invariance tests) goes through
// ValuesMatch, so that a first GPU run prints, for each failing comparison:
// the op, the shape, the dtype, how many elements are outside the tolerance,
// the worst one (index, coordinates, both values, its error) and the first 8
// elements outside the tolerance with their values. The device time of such a
// run is scarce; the message must not send anyone back for a second look.
//
// Error of one element: |got - want| / max(1, |want|). Tolerance 0 means
// bitwise: two floats are equal only if their bits are (so -0 differs from +0,
// and a NaN differs from everything but the same NaN). A NaN on one side only
// is always outside the tolerance.
#ifndef HSX_TESTS_COMMON_VALUE_COMPARISON_H_
#define HSX_TESTS_COMMON_VALUE_COMPARISON_H_

#include <gtest/gtest.h>

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace hsx::testing {

// What was compared, for the message: "RmsNorm", [24, 64], "bf16".
struct ComparedValues {
  std::string op;
  std::vector<int64_t> shape;  // row-major; its product must equal the element count
  std::string dtype;
};

// One element outside the tolerance.
struct ElementMismatch {
  int64_t index = -1;  // flat, row-major
  float got = 0;
  float want = 0;
  double error = 0;  // +inf when a side is NaN (and the bits differ)
};

// The comparison's findings. `first` holds at most kFirstShown elements, in index order.
struct Mismatches {
  static constexpr size_t kFirstShown = 8;
  int64_t elements = 0;  // compared
  int64_t outside = 0;   // outside the tolerance
  ElementMismatch worst;
  std::vector<ElementMismatch> first;
  std::string criterion;  // "outside tolerance 0.01 (...)", "not bitwise equal", "more than 1 float ulps apart"
  bool size_differs = false;
  int64_t got_size = 0;
  int64_t want_size = 0;
};

// Compares got with want element by element.
Mismatches FindMismatches(std::span<const float> got, std::span<const float> want, double tolerance);

// The same with a distance in float ulps (error = ulps between the two, as
// ordered integers): for ops whose only difference is the last bits of exp.
Mismatches FindUlpMismatches(std::span<const float> got, std::span<const float> want, int64_t max_ulps);

// The message for findings with at least one element outside the tolerance, e.g.
//   RmsNorm [24, 64] bf16: 2 of 1536 elements outside tolerance 0.01 (|got - want| / max(1, |want|));
//   worst at 517 [8, 5]: got 1.25, want 1 (error 0.25); first outside: 517 [8, 5] got 1.25 want 1, ...
std::string DescribeMismatches(const ComparedValues& what, const Mismatches& found);

// A gtest assertion: success when every element is within the tolerance (or
// bitwise equal, at tolerance 0), else a failure carrying DescribeMismatches.
::testing::AssertionResult ValuesMatch(const ComparedValues& what, std::span<const float> got,
                                       std::span<const float> want, double tolerance);

// The same, at most max_ulps float ulps apart.
::testing::AssertionResult ValuesWithinUlps(const ComparedValues& what, std::span<const float> got,
                                            std::span<const float> want, int64_t max_ulps);

// The same for raw bf16 bit patterns (the dequantisation kernels' output):
// tolerance 0 only; with nan_equal, any two NaNs count as equal.
::testing::AssertionResult Bf16BitsMatch(const ComparedValues& what, std::span<const uint16_t> got,
                                         std::span<const uint16_t> want, bool nan_equal = false);

// "[8, 5]": the coordinates of a flat index in a row-major shape.
std::string Coordinates(int64_t index, const std::vector<int64_t>& shape);

}  // namespace hsx::testing

#endif  // HSX_TESTS_COMMON_VALUE_COMPARISON_H_
