// cpu_conformance_test.cc: the CPU backend against the plain-loop reference,
// bitwise in both precisions (its arithmetic is the contract's order).
#include "kernels/backend.h"
#include "tests/conformance/backend_conformance.h"

namespace hsx::conformance {
namespace {

std::vector<ConformanceCase> CpuCases() {
  std::vector<ConformanceCase> cases;
  for (const ElementType precision : {ElementType::kF32, ElementType::kBf16}) {
    ConformanceCase c;
    c.name = precision == ElementType::kF32 ? "cpu_fp32" : "cpu_bf16";
    c.precision = precision;
    c.make = [precision]() -> absl::StatusOr<std::unique_ptr<Backend>> { return MakeCpuBackend(precision, 2); };
    c.reason = "bitwise: the CPU backend sums in the contract's order";
    cases.push_back(std::move(c));
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Cpu, BackendConformance, ::testing::ValuesIn(CpuCases()), ConformanceCaseName);

}  // namespace
}  // namespace hsx::conformance
