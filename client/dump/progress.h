// progress.h: hsx-dump's progress report. On a terminal, one line redrawn in
// place (a bar, samples done/total, tokens/s, MB/s written, ETA); otherwise a
// plain line every `interval` seconds, so logs stay readable. Rates are over
// the last few seconds; the ETA is remaining tokens over the token rate.
#ifndef HSX_CLIENT_DUMP_PROGRESS_H_
#define HSX_CLIENT_DUMP_PROGRESS_H_

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <mutex>
#include <string>
#include <thread>

namespace hsx {

enum class ProgressMode { kAuto, kBar, kPlain, kNone };

class Progress {
 public:
  struct Options {
    int64_t total_samples = 0;
    int64_t total_tokens = 0;
    ProgressMode mode = ProgressMode::kAuto;  // kAuto: kBar when the stream is a terminal
    double interval_seconds = 10.0;           // plain mode
    std::FILE* stream = stderr;
    std::string label = "hsx-dump";
  };

  explicit Progress(const Options& options);
  // Stops (erasing the bar line) if still running.
  ~Progress();
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;

  void Start();
  void Add(int64_t samples, int64_t tokens, int64_t bytes);
  // The final state; the bar is cleared so the summary that follows stands alone.
  void Stop();

  // Formats the report (exposed for tests): done/total, rates, ETA.
  static std::string Format(int64_t done, int64_t total, int64_t tokens, int64_t total_tokens,
                            double tokens_per_s, double bytes_per_s, double elapsed_s, int width,
                            bool bar);
  static std::string Duration(double seconds);

 private:
  void Loop();
  void Report();

  Options options_;
  bool bar_ = false;
  std::mutex mutex_;
  std::condition_variable wake_;
  bool running_ = false;
  bool stop_ = false;
  std::thread thread_;
  std::chrono::steady_clock::time_point start_;
  int64_t samples_ = 0;
  int64_t tokens_ = 0;
  int64_t bytes_ = 0;
  struct Point {
    double t;
    int64_t tokens;
    int64_t bytes;
  };
  std::deque<Point> window_;  // recent (time, tokens, bytes) for the rates
  bool drew_ = false;
};

}  // namespace hsx

#endif  // HSX_CLIENT_DUMP_PROGRESS_H_
