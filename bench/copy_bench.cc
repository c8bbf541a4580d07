// copy_bench: CopyUncached (format/uncached_copy.h) against memcpy, the way
// the Python client's native path assembles a sample: 16 KiB pieces from a
// source that is in cache (a received slice just hashed and checked) into a
// destination far larger than the caches (the sample's block, already
// mapped, as a pooled block is).
//
// Not a test. Interleaved repeats; prints each method's CPU-ns per byte
// (median and range) and the ratio of the medians.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <memory>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "format/uncached_copy.h"

ABSL_FLAG(int64_t, bytes, int64_t{1} << 30, "destination size");
ABSL_FLAG(int64_t, piece, 16 << 10, "bytes per copy");
ABSL_FLAG(int, repeats, 9, "interleaved repeats of each method");

namespace {

double CpuSeconds() {
  timespec t{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

// CPU-ns per byte of one pass of `copy` over the destination.
template <typename Copy>
double Pass(char* to, size_t bytes, const char* from, size_t piece, Copy copy) {
  const double start = CpuSeconds();
  for (size_t at = 0; at + piece <= bytes; at += piece) copy(to + at, from, piece);
  hsx::FenceUncachedCopies();
  return (CpuSeconds() - start) * 1e9 / static_cast<double>(bytes);
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

void Print(const char* name, const std::vector<double>& v, double baseline) {
  const double median = Median(v);
  const auto [lo, hi] = std::minmax_element(v.begin(), v.end());
  std::printf("%-14s %.4f [%.4f-%.4f] ns/B  %.2fx memcpy\n", name, median, *lo, *hi, median / baseline);
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const size_t bytes = static_cast<size_t>(absl::GetFlag(FLAGS_bytes));
  const size_t piece = static_cast<size_t>(absl::GetFlag(FLAGS_piece));
  const int repeats = absl::GetFlag(FLAGS_repeats);
  if (piece == 0 || piece > bytes || repeats < 1) {
    std::fprintf(stderr, "copy_bench: need 0 < --piece <= --bytes and --repeats >= 1\n");
    return 2;
  }
  auto to = std::make_unique<char[]>(bytes);  // value-initialised: every page mapped before timing
  std::vector<char> from(piece, 'x');
  std::vector<double> plain, uncached;
  for (int r = 0; r < repeats; ++r) {
    plain.push_back(Pass(to.get(), bytes, from.data(), piece, [](char* d, const char* s, size_t n) { std::memcpy(d, s, n); }));
    uncached.push_back(Pass(to.get(), bytes, from.data(), piece, hsx::CopyUncached));
  }
  std::printf("copy_bench: %zu MiB in %zu-byte pieces, %d interleaved repeats\n", bytes >> 20, piece, repeats);
  const double baseline = Median(plain);
  Print("memcpy", plain, baseline);
  Print("CopyUncached", uncached, baseline);
  return 0;
}
