// packing_bench: how full the batcher's batches are on a long-tailed length mix.
//
// Not a test. Draws sample lengths from a log-normal distribution clipped to
// [32, 4096] (many short chats, a tail of long documents), keeps a queue of
// --queue samples topped up as batches leave (a server under load), packs
// with the batcher's rule and prints the fill: real tokens over batch capacity.
// The baseline in the same run is first-come-first-served packing with no
// skipping (what a naive batcher does).
#include <cmath>
#include <cstdio>
#include <deque>
#include <random>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "server/runtime/batcher.h"

ABSL_FLAG(int64_t, budget, 16384, "max_batch_tokens");
ABSL_FLAG(int64_t, samples, 20000, "samples to pack");
ABSL_FLAG(int64_t, queue, 256, "samples waiting while the engine runs a batch");
ABSL_FLAG(int64_t, lookahead, 1024, "samples scanned per batch");
ABSL_FLAG(uint64_t, seed, 1, "random seed");

namespace {

struct Result {
  int64_t batches = 0;
  int64_t tokens = 0;
};

template <typename Pack>
Result Simulate(const std::vector<int64_t>& lengths, int64_t queue_size, int64_t budget, Pack pack) {
  std::deque<int64_t> queue;
  size_t next = 0;
  Result result;
  while (next < lengths.size() || !queue.empty()) {
    while (static_cast<int64_t>(queue.size()) < queue_size && next < lengths.size()) queue.push_back(lengths[next++]);
    std::vector<int64_t> waiting(queue.begin(), queue.end());
    std::vector<size_t> chosen = pack(waiting, budget);
    for (auto it = chosen.rbegin(); it != chosen.rend(); ++it) {
      result.tokens += queue[*it];
      queue.erase(queue.begin() + static_cast<std::ptrdiff_t>(*it));
    }
    ++result.batches;
  }
  return result;
}

std::vector<size_t> FirstComeFirstServed(const std::vector<int64_t>& lengths, int64_t budget) {
  std::vector<size_t> chosen;
  int64_t tokens = 0;
  for (size_t i = 0; i < lengths.size(); ++i) {
    if (!chosen.empty() && tokens + lengths[i] > budget) break;
    chosen.push_back(i);
    tokens += lengths[i];
  }
  return chosen;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  std::mt19937_64 random(absl::GetFlag(FLAGS_seed));
  std::lognormal_distribution<double> length(std::log(400.0), 1.0);
  std::vector<int64_t> lengths;
  int64_t total = 0;
  for (int64_t i = 0; i < absl::GetFlag(FLAGS_samples); ++i) {
    lengths.push_back(std::clamp<int64_t>(static_cast<int64_t>(length(random)), 32, 4096));
    total += lengths.back();
  }
  const int64_t budget = absl::GetFlag(FLAGS_budget);
  const size_t lookahead = static_cast<size_t>(absl::GetFlag(FLAGS_lookahead));
  const Result hsx = Simulate(lengths, absl::GetFlag(FLAGS_queue), budget,
                              [&](const std::vector<int64_t>& w, int64_t b) { return hsx::PackNext(w, b, lookahead); });
  const Result fcfs = Simulate(lengths, absl::GetFlag(FLAGS_queue), budget, FirstComeFirstServed);
  auto fill = [&](const Result& r) { return static_cast<double>(r.tokens) / (r.batches * budget); };
  std::printf("samples %zu, mean length %.0f, budget %lld tokens, queue %lld\n", lengths.size(),
              static_cast<double>(total) / lengths.size(), static_cast<long long>(budget),
              static_cast<long long>(absl::GetFlag(FLAGS_queue)));
  std::printf("%-28s %10s %10s\n", "packer", "batches", "fill");
  std::printf("%-28s %10lld %9.2f%%\n", "first-come-first-served", static_cast<long long>(fcfs.batches), 100 * fill(fcfs));
  std::printf("%-28s %10lld %9.2f%%\n", "hsx (skip-ahead, lookahead)", static_cast<long long>(hsx.batches), 100 * fill(hsx));
  std::printf("ratio hsx/fcfs fill = %.3f\n", fill(hsx) / fill(fcfs));
  return 0;
}
