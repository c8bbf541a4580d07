// value_comparison.cc: see value_comparison.h.
#include "tests/common/value_comparison.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace hsx::testing {
namespace {

bool SameBits(float a, float b) { return std::memcmp(&a, &b, sizeof(float)) == 0; }

// The element's error, or a negative value when it is within the tolerance.
double OutsideBy(float got, float want, double tolerance) {
  if (SameBits(got, want)) return -1;
  if (std::isnan(got) || std::isnan(want)) return std::numeric_limits<double>::infinity();
  const double error = std::abs(static_cast<double>(got) - want) / std::max(1.0, std::abs(static_cast<double>(want)));
  if (tolerance == 0) return error;  // bits differ: outside, even at error 0 (-0 vs +0)
  return error > tolerance ? error : -1;
}

std::string Shape(const std::vector<int64_t>& shape) { return absl::StrCat("[", absl::StrJoin(shape, ", "), "]"); }

// "517 [8, 5] got 1.25 want 1": %.9g keeps every float distinguishable.
std::string Element(const ElementMismatch& m, const std::vector<int64_t>& shape) {
  char values[96];
  std::snprintf(values, sizeof(values), "got %.9g want %.9g", m.got, m.want);
  return absl::StrCat(m.index, " ", Coordinates(m.index, shape), " ", values);
}

}  // namespace

std::string Coordinates(int64_t index, const std::vector<int64_t>& shape) {
  if (shape.empty()) return "[]";
  std::vector<int64_t> coordinates(shape.size());
  for (size_t d = shape.size(); d-- > 0;) {
    const int64_t extent = std::max<int64_t>(shape[d], 1);
    coordinates[d] = d == 0 ? index : index % extent;
    index /= extent;
  }
  return Shape(coordinates);
}

namespace {

// The comparison loop: error_of(got, want) is negative when the pair passes.
template <typename ErrorOf>
Mismatches Find(std::span<const float> got, std::span<const float> want, std::string criterion, ErrorOf error_of) {
  Mismatches found;
  found.criterion = std::move(criterion);
  found.got_size = static_cast<int64_t>(got.size());
  found.want_size = static_cast<int64_t>(want.size());
  found.size_differs = got.size() != want.size();
  const size_t n = std::min(got.size(), want.size());
  found.elements = static_cast<int64_t>(n);
  for (size_t i = 0; i < n; ++i) {
    const double error = error_of(got[i], want[i]);
    if (error < 0) continue;
    const ElementMismatch m{static_cast<int64_t>(i), got[i], want[i], error};
    if (found.outside++ == 0 || error > found.worst.error) found.worst = m;
    if (found.first.size() < Mismatches::kFirstShown) found.first.push_back(m);
  }
  return found;
}

// Distance of two floats in ulps, as ordered integers (+0 and -0 are 1 apart).
int64_t UlpsApart(float a, float b) {
  int32_t ia, ib;
  std::memcpy(&ia, &a, 4);
  std::memcpy(&ib, &b, 4);
  const int64_t oa = ia < 0 ? int64_t{INT32_MIN} - ia : ia;
  const int64_t ob = ib < 0 ? int64_t{INT32_MIN} - ib : ib;
  return std::abs(oa - ob);
}

::testing::AssertionResult Verdict(const ComparedValues& what, const Mismatches& found) {
  if (found.outside == 0 && !found.size_differs) {
    return ::testing::AssertionSuccess() << what.op << ": " << found.elements << " elements match";
  }
  return ::testing::AssertionFailure() << DescribeMismatches(what, found);
}

}  // namespace

Mismatches FindMismatches(std::span<const float> got, std::span<const float> want, double tolerance) {
  std::string criterion = tolerance == 0 ? "not bitwise equal"
                                         : absl::StrCat("outside tolerance ", tolerance, " (|got - want| / max(1, |want|))");
  return Find(got, want, std::move(criterion), [tolerance](float g, float w) { return OutsideBy(g, w, tolerance); });
}

Mismatches FindUlpMismatches(std::span<const float> got, std::span<const float> want, int64_t max_ulps) {
  return Find(got, want, absl::StrCat("more than ", max_ulps, " float ulps apart"), [max_ulps](float g, float w) {
    if (SameBits(g, w)) return -1.0;
    if (std::isnan(g) || std::isnan(w)) return std::numeric_limits<double>::infinity();
    const int64_t ulps = UlpsApart(g, w);
    return ulps > max_ulps ? static_cast<double>(ulps) : -1.0;
  });
}

std::string DescribeMismatches(const ComparedValues& what, const Mismatches& found) {
  std::string text = absl::StrCat(what.op, " ", Shape(what.shape), " ", what.dtype, ": ");
  if (found.size_differs) {
    absl::StrAppend(&text, "got ", found.got_size, " elements, want ", found.want_size, "; in the first ",
                    found.elements, ": ");
  }
  absl::StrAppend(&text, found.outside, " of ", found.elements, " elements ", found.criterion);
  if (found.outside == 0) return text;
  char error[32];
  std::snprintf(error, sizeof(error), "%.3g", found.worst.error);
  absl::StrAppend(&text, "; worst at ", Element(found.worst, what.shape), " (error ", error, "); first ",
                  found.first.size(), " outside: ");
  std::vector<std::string> first;
  for (const ElementMismatch& m : found.first) first.push_back(Element(m, what.shape));
  absl::StrAppend(&text, absl::StrJoin(first, "; "));
  return text;
}

::testing::AssertionResult ValuesMatch(const ComparedValues& what, std::span<const float> got,
                                       std::span<const float> want, double tolerance) {
  return Verdict(what, FindMismatches(got, want, tolerance));
}

::testing::AssertionResult ValuesWithinUlps(const ComparedValues& what, std::span<const float> got,
                                            std::span<const float> want, int64_t max_ulps) {
  return Verdict(what, FindUlpMismatches(got, want, max_ulps));
}

::testing::AssertionResult Bf16BitsMatch(const ComparedValues& what, std::span<const uint16_t> got,
                                         std::span<const uint16_t> want, bool nan_equal) {
  // bf16 -> float is exact (the bits shifted up), so bitwise float equality is
  // bitwise bf16 equality; with nan_equal every NaN becomes one canonical NaN.
  auto widen = [nan_equal](std::span<const uint16_t> bits) {
    std::vector<float> values(bits.size());
    for (size_t i = 0; i < bits.size(); ++i) {
      const uint32_t word = static_cast<uint32_t>(bits[i]) << 16;
      std::memcpy(&values[i], &word, sizeof(float));
      if (nan_equal && std::isnan(values[i])) values[i] = std::numeric_limits<float>::quiet_NaN();
    }
    return values;
  };
  const std::vector<float> g = widen(got);
  const std::vector<float> w = widen(want);
  return ValuesMatch(what, g, w, 0);
}

}  // namespace hsx::testing
