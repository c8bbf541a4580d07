// progress.h: hsx-dump's progress report. On a terminal, one line redrawn in
// place (a bar, samples done/total, tokens/s, MB/s written, failures and
// retries, ETA); otherwise a plain line every `interval` seconds, so logs stay
// readable. Rates are exponentially weighted moving averages with a time
// constant of a minute (Ewma), so that a pause or a burst of a few seconds
// does not swing the ETA; the ETA is remaining tokens over the token rate.
// An observer, when given, gets a snapshot every interval and at Stop (the
// dump writes it to its status file).
#ifndef HSX_CLIENT_DUMP_PROGRESS_H_
#define HSX_CLIENT_DUMP_PROGRESS_H_

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

namespace hsx {

enum class ProgressMode { kAuto, kBar, kPlain, kNone };

// A rate smoothed over time: each second's amount weighs exp(-age / tau).
// Rate() is the weighted amount over the weighted time, which is exact for a
// steady rate from the first second on (no warm-up bias towards 0).
class Ewma {
 public:
  explicit Ewma(double tau_seconds) : tau_(tau_seconds) {}
  // `amount` happened over the last `seconds`.
  void Add(double amount, double seconds);
  double Rate() const { return time_ > 0 ? amount_ / time_ : 0.0; }

 private:
  double tau_;
  double amount_ = 0;
  double time_ = 0;
};

// What the observer receives.
struct ProgressSnapshot {
  int64_t samples = 0;
  int64_t tokens = 0;
  int64_t bytes = 0;
  int64_t failures = 0;
  int64_t retries = 0;
  double tokens_per_s = 0;  // smoothed
  double samples_per_s = 0;
  double bytes_per_s = 0;
  double elapsed_s = 0;
};

class Progress {
 public:
  struct Options {
    int64_t total_samples = 0;
    int64_t total_tokens = 0;
    ProgressMode mode = ProgressMode::kAuto;  // kAuto: kBar when the stream is a terminal
    double interval_seconds = 10.0;           // plain mode
    std::FILE* stream = stderr;
    std::string label = "hsx-dump";
    double tau_seconds = 60.0;  // of the rates' moving average
    std::function<int64_t()> retries;  // retries so far (none: not shown)
    std::function<void(const ProgressSnapshot&)> observer;  // every interval and at Stop
  };

  explicit Progress(const Options& options);
  // Stops (erasing the bar line) if still running.
  ~Progress();
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;

  void Start();
  void Add(int64_t samples, int64_t tokens, int64_t bytes);
  void AddFailure();
  // The final state; the bar is cleared so the summary that follows stands alone.
  void Stop();

  // Formats the report (exposed for tests): done/total, rates, ETA.
  static std::string Format(int64_t done, int64_t total, int64_t tokens, int64_t total_tokens,
                            double tokens_per_s, double bytes_per_s, double elapsed_s, int width,
                            bool bar, int64_t failures = 0, int64_t retries = 0);
  static std::string Duration(double seconds);

 private:
  void Loop();
  void Report();
  ProgressSnapshot Snapshot(double t);  // with mutex_ held

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
  int64_t failures_ = 0;
  // The rates, and what they had counted at the last tick.
  Ewma tokens_rate_, samples_rate_, bytes_rate_;
  double last_t_ = 0;
  int64_t last_tokens_ = 0, last_samples_ = 0, last_bytes_ = 0;
  bool drew_ = false;
};

}  // namespace hsx

#endif  // HSX_CLIENT_DUMP_PROGRESS_H_
