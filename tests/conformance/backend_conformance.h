// backend_conformance.h: the per-op conformance suite of kernels/backend.h,
// parameterised by a backend factory.
//
// Every op of a backend is run on random inputs and compared with the
// plain-loop reference of kernels/reference/: bitwise where a case's
// tolerance is 0 (the CPU backend: its arithmetic is the contract's), else
// within the stated per-op tolerance (max |got - want| / max(1, |want|)). Row
// independence is checked bitwise for every backend: a row computed alone
// equals the same row inside a larger ragged batch at another position.
//
// A backend joins by instantiating the suite with its cases:
//
//   INSTANTIATE_TEST_SUITE_P(Cuda, BackendConformance,
//                            ::testing::ValuesIn(CudaConformanceCases()),
//                            ConformanceCaseName);
#ifndef HSX_TESTS_CONFORMANCE_BACKEND_CONFORMANCE_H_
#define HSX_TESTS_CONFORMANCE_BACKEND_CONFORMANCE_H_

#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"

namespace hsx::conformance {

// Allowed error per op class; 0 means bitwise. Each non-zero value should say
// why in the case's `reason`.
struct Tolerances {
  double linear = 0;      // GEMMs (dense and INT4), router logits
  double elementwise = 0; // RmsNorm, Add, SiluMul, Round, Rope, Embed
  double attention = 0;
  double moe = 0;
};

struct ConformanceCase {
  std::string name;  // a gtest-safe identifier, e.g. "cpu_bf16"
  ElementType precision = ElementType::kF32;
  std::function<absl::StatusOr<std::unique_ptr<Backend>>()> make;
  Tolerances tolerances;
  std::string reason;  // why the tolerances are what they are
  // Non-empty: the backend cannot run here (e.g. no GPU); tests skip saying so.
  std::function<std::string()> skip_reason;
};

// gtest prints a case by its name, not its bytes.
inline void PrintTo(const ConformanceCase& c, std::ostream* os) { *os << c.name; }

inline std::string ConformanceCaseName(const ::testing::TestParamInfo<ConformanceCase>& info) {
  return info.param.name;
}

class Harness;  // random inputs, uploads and downloads (backend_conformance.cc)

// The fixture every conformance test runs in: one fresh backend per test.
class BackendConformance : public ::testing::TestWithParam<ConformanceCase> {
 protected:
  BackendConformance();
  ~BackendConformance() override;
  void SetUp() override;
  void TearDown() override;

  Backend& b() { return *backend_; }
  Harness& h() { return *harness_; }
  const Tolerances& tol() const { return GetParam().tolerances; }
  bool bf16() const { return GetParam().precision == ElementType::kBf16; }

 private:
  std::unique_ptr<Backend> backend_;
  std::unique_ptr<Harness> harness_;
};

}  // namespace hsx::conformance

#endif  // HSX_TESTS_CONFORMANCE_BACKEND_CONFORMANCE_H_
