// fp8_encode_bench: the fp8 row encoding's CPU cost per value, the AVX-512
// loops (format/fp8_kernels.h) against the portable ones (plain loops GCC
// vectorises, as in its AVX-512 clone), on rows of hidden size 7168 from
// bf16 and from float32 activations. "rows" is the row loops alone (largest
// |value|, then the quantisation); "tensor" is EncodeFp8Tensor as the server
// runs it (checks and the xxh3 checksum of the encoded bytes included);
// "dequantize" is the receiving side's DequantizeFp8ToBf16 loop (the Python
// client's native path) over the encoded rows; "dequantize, uncached" the
// same with non-temporal stores where the loop has them (the portable loop
// has none: its line is the cached loop again).
//
// Not a test. Interleaved repeats; prints CPU-ns per value (median and
// range) and each AVX-512 median over the portable one from the same run.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "format/fp8.h"
#include "format/fp8_kernels.h"
#include "format/uncached_copy.h"

ABSL_FLAG(int64_t, tokens, 512, "rows per pass");
ABSL_FLAG(int64_t, hidden, 7168, "values per row");
ABSL_FLAG(int, repeats, 9, "interleaved repeats of each case");

namespace {

using hsx::ElementType;
using hsx::Fp8RowKernels;

double CpuSeconds() {
  timespec t{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct Input {
  std::vector<uint32_t> f32;
  std::vector<uint16_t> bf16;
};

// Activation-like rows: normal values, each row at its own magnitude.
Input MakeInput(int64_t tokens, int64_t hidden) {
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  Input in;
  in.f32.resize(tokens * hidden);
  in.bf16.resize(in.f32.size());
  for (size_t i = 0; i < in.f32.size(); ++i) {
    const float x = normal(rng) * std::exp2(static_cast<float>(i / hidden % 16) - 8.0f);
    std::memcpy(&in.f32[i], &x, sizeof(x));
    in.bf16[i] = static_cast<uint16_t>(in.f32[i] >> 16);
  }
  return in;
}

// One pass of the row loops alone.
void Rows(const Fp8RowKernels& k, const Input& in, ElementType type, int64_t tokens, int64_t hidden, char* out) {
  const int64_t row_bytes = hidden + hsx::kFp8ScaleBytes;
  for (int64_t t = 0; t < tokens; ++t) {
    auto* payload = reinterpret_cast<uint8_t*>(out + t * row_bytes + hsx::kFp8ScaleBytes);
    float amax;
    if (type == ElementType::kBf16) {
      const uint32_t bits = k.abs_max_bf16(in.bf16.data() + t * hidden, hidden);
      std::memcpy(&amax, &bits, sizeof(amax));
      k.quantize_bf16(in.bf16.data() + t * hidden, hidden, hsx::Fp8RowScale(amax), payload);
    } else {
      const uint32_t bits = k.abs_max_f32(in.f32.data() + t * hidden, hidden);
      std::memcpy(&amax, &bits, sizeof(amax));
      k.quantize_f32(in.f32.data() + t * hidden, hidden, hsx::Fp8RowScale(amax), payload);
    }
  }
}

struct Case {
  std::string name;
  std::function<void(const Fp8RowKernels&)> pass;
  std::vector<double> portable, avx512;
};

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const int64_t tokens = absl::GetFlag(FLAGS_tokens), hidden = absl::GetFlag(FLAGS_hidden);
  const int repeats = absl::GetFlag(FLAGS_repeats);
  const Fp8RowKernels* avx512 = hsx::Avx512Fp8Kernels();
  if (tokens < 1 || hidden < 1 || repeats < 1 || avx512 == nullptr) {
    std::fprintf(stderr, "fp8_encode_bench: need --tokens, --hidden, --repeats >= 1 and an AVX-512 CPU\n");
    return 2;
  }
  const Input in = MakeInput(tokens, hidden);
  std::string out(tokens * (hidden + hsx::kFp8ScaleBytes), '\0');
  std::vector<Case> cases;
  for (ElementType type : {ElementType::kBf16, ElementType::kF32}) {
    const char* from = type == ElementType::kBf16 ? "bf16" : "f32";
    const void* src = type == ElementType::kBf16 ? static_cast<const void*>(in.bf16.data()) : in.f32.data();
    cases.push_back({std::string("rows   ") + from,
                     [&, type](const Fp8RowKernels& k) { Rows(k, in, type, tokens, hidden, out.data()); }, {}, {}});
    cases.push_back({std::string("tensor ") + from, [&, type, src](const Fp8RowKernels& k) {
                       hsx::EncodeFp8TensorWith(k, src, type, tokens, hidden, out.data(), hsx::ChecksumKind::kXxh3);
                     }, {}, {}});
  }
  std::vector<uint16_t> bf16_out(tokens * hidden);
  for (const bool uncached : {false, true}) {
    cases.push_back({uncached ? "dequantize, uncached" : "dequantize", [&, uncached](const Fp8RowKernels& k) {
                       const int64_t row_bytes = hidden + hsx::kFp8ScaleBytes;
                       for (int64_t t = 0; t < tokens; ++t) {
                         const auto* row = reinterpret_cast<const uint8_t*>(out.data() + t * row_bytes);
                         float scale;
                         std::memcpy(&scale, row, sizeof(scale));
                         k.dequantize_bf16(row + hsx::kFp8ScaleBytes, hidden, scale, bf16_out.data() + t * hidden,
                                           uncached);
                       }
                       hsx::FenceUncachedCopies();
                     }, {}, {}});
  }
  const double values = static_cast<double>(tokens * hidden);
  for (int r = 0; r < repeats; ++r) {
    for (Case& c : cases) {
      for (bool fast : {r % 2 == 0, r % 2 != 0}) {  // alternate which set goes first
        const double start = CpuSeconds();
        c.pass(fast ? *avx512 : hsx::PortableFp8Kernels());
        (fast ? c.avx512 : c.portable).push_back((CpuSeconds() - start) * 1e9 / values);
      }
    }
  }
  std::printf("fp8_encode_bench: %lld rows of %lld values, %d interleaved repeats; CPU-ns per value\n",
              static_cast<long long>(tokens), static_cast<long long>(hidden), repeats);
  for (const Case& c : cases) {
    const auto [plo, phi] = std::minmax_element(c.portable.begin(), c.portable.end());
    const auto [alo, ahi] = std::minmax_element(c.avx512.begin(), c.avx512.end());
    std::printf("%-20s portable %.3f [%.3f-%.3f]  avx512 %.3f [%.3f-%.3f]  avx512/portable %.2f\n", c.name.c_str(),
                Median(c.portable), *plo, *phi, Median(c.avx512), *alo, *ahi, Median(c.avx512) / Median(c.portable));
  }
  return 0;
}
