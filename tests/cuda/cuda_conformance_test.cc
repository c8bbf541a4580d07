// cuda_conformance_test.cc: the CUDA backend in the per-op conformance suite
// (tests/conformance/), in both precisions, skipping without a device.
//
// Tolerances, and why (max |got - want| / max(1, |want|)):
//  * linear, moe: cuBLASLt sums K in its own (pinned) order, not the
//    reference's sequential fma, so fp32 differs by float rounding (K <= 64
//    here: ~1e-6) and bf16 outputs can land one bf16 ulp apart (<= 2^-7).
//  * elementwise, attention: the kernels do the reference's float operations
//    in its order (ops.h), except that exp is CUDA's double exp rounded to
//    float where the CPU calls glibc's expf: both are within ~0.5 ulp, so a
//    value can differ in its last float bit, or one bf16 ulp after rounding.
// Row independence is checked bitwise by the suite regardless.
#include "kernels/cuda/cuda_backend.h"
#include "tests/conformance/backend_conformance.h"
#include "tests/cuda/cuda_test_util.h"

namespace hsx::conformance {
namespace {

std::vector<ConformanceCase> CudaCases() {
  std::vector<ConformanceCase> cases;
  for (const ElementType precision : {ElementType::kF32, ElementType::kBf16}) {
    const bool bf16 = precision == ElementType::kBf16;
    ConformanceCase c;
    c.name = bf16 ? "cuda_bf16" : "cuda_fp32";
    c.precision = precision;
    c.make = [precision]() { return MakeCudaBackend(0, precision); };
    // bf16: one bf16 ulp (at most 2^-7 of max(1, |value|)) plus margin; the
    // MoE rounds three times before its combine.
    c.tolerances.linear = bf16 ? 1e-2 : 1e-5;
    c.tolerances.moe = bf16 ? 2e-2 : 1e-5;
    c.tolerances.elementwise = bf16 ? 1e-2 : 1e-6;
    c.tolerances.attention = bf16 ? 1e-2 : 1e-5;
    c.reason = "cuBLASLt's summation order; CUDA exp vs glibc expf (see the file comment)";
    c.skip_reason = [] { return ::hsx::testing::NoCudaDeviceReason(); };
    cases.push_back(std::move(c));
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Cuda, BackendConformance, ::testing::ValuesIn(CudaCases()), ConformanceCaseName);

}  // namespace
}  // namespace hsx::conformance
