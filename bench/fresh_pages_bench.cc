// fresh_pages_bench: what this machine charges for memory a process has not
// touched yet, the cost a client's first samples pay for its pool's blocks
// and gRPC's buffers (and later samples, written into the same pages, do
// not): a first write to fresh 4 KiB pages and to fresh transparent huge
// pages (a page fault in which the kernel zeroes the page, and on a virtual
// machine perhaps a fault on its host), against writing the same bytes into
// pages already mapped.
//
// Not a test. Interleaved repeats, each on a new mapping; prints CPU-ns per
// byte (median and range) and the ratio of the medians to the mapped pages'.
// A first pass of bench/stream_cost.py's Python sides is only comparable
// between machines whose fresh pages cost alike (docs/BENCHMARKS.md).
#include <sys/mman.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"

ABSL_FLAG(int64_t, mib, 256, "memory per repeat, MiB");
ABSL_FLAG(int, repeats, 7, "interleaved repeats of each kind");

namespace {

constexpr size_t kHuge = size_t{2} << 20;

double CpuSeconds() {
  timespec t{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

// A new anonymous mapping of `bytes` (a multiple of kHuge) starting on a
// huge page, with `advice` for all of it; munmap'ed by the caller.
char* Map(size_t bytes, int advice, char** mapping, size_t* mapped) {
  *mapped = bytes + kHuge;
  void* at = mmap(nullptr, *mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (at == MAP_FAILED) return nullptr;
  *mapping = static_cast<char*>(at);
  char* aligned = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(at) + kHuge - 1) & ~(kHuge - 1));
  madvise(aligned, bytes, advice);
  return aligned;
}

// CPU-ns per byte of writing all `bytes` of a new mapping with `advice`;
// `mapped_first`: write them once before timing, so that the timed write
// finds every page mapped. Negative when mmap fails.
double WritePass(size_t bytes, int advice, bool mapped_first) {
  char* mapping = nullptr;
  size_t mapped = 0;
  char* block = Map(bytes, advice, &mapping, &mapped);
  if (block == nullptr) return -1;
  if (mapped_first) std::memset(block, 1, bytes);
  const double start = CpuSeconds();
  std::memset(block, 2, bytes);
  const double seconds = CpuSeconds() - start;
  munmap(mapping, mapped);
  return seconds * 1e9 / static_cast<double>(bytes);
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

void Print(const char* name, const std::vector<double>& v, double baseline) {
  const auto [lo, hi] = std::minmax_element(v.begin(), v.end());
  std::printf("%-26s %.3f [%.3f-%.3f] ns/B  %.1fx\n", name, Median(v), *lo, *hi, Median(v) / baseline);
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const int64_t mib = absl::GetFlag(FLAGS_mib);
  const int repeats = absl::GetFlag(FLAGS_repeats);
  if (mib < 2 || mib % 2 != 0 || repeats < 1) {
    std::fprintf(stderr, "fresh_pages_bench: need an even --mib >= 2 and --repeats >= 1\n");
    return 2;
  }
  const size_t bytes = static_cast<size_t>(mib) << 20;
  std::vector<double> mapped, small, huge;
  for (int r = 0; r < repeats; ++r) {
    mapped.push_back(WritePass(bytes, MADV_NOHUGEPAGE, true));
    small.push_back(WritePass(bytes, MADV_NOHUGEPAGE, false));
    huge.push_back(WritePass(bytes, MADV_HUGEPAGE, false));
    if (mapped.back() < 0 || small.back() < 0 || huge.back() < 0) {
      std::fprintf(stderr, "fresh_pages_bench: mmap of %lld MiB failed\n", static_cast<long long>(mib));
      return 1;
    }
  }
  std::printf("fresh_pages_bench: %lld MiB per pass, %d interleaved repeats, memset's CPU-ns per byte\n",
              static_cast<long long>(mib), repeats);
  const double baseline = Median(mapped);
  Print("pages already mapped", mapped, baseline);
  Print("fresh 4 KiB pages", small, baseline);
  Print("fresh huge pages (THP)", huge, baseline);
  return 0;
}
