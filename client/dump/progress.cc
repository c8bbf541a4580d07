// progress.cc: a hand-written progress line (no progress library in Debian for C++).
#include "client/dump/progress.h"

#include <sys/ioctl.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace hsx {
namespace {

constexpr auto kBarPeriod = std::chrono::milliseconds(250);

int TerminalWidth(std::FILE* stream) {
  struct winsize ws;
  if (::ioctl(::fileno(stream), TIOCGWINSZ, &ws) == 0 && ws.ws_col > 0) return ws.ws_col;
  return 80;
}

std::string Rate(double value, const char* unit) {
  if (value >= 1e9) return absl::StrFormat("%.2f G%s", value / 1e9, unit);
  if (value >= 1e6) return absl::StrFormat("%.2f M%s", value / 1e6, unit);
  if (value >= 1e3) return absl::StrFormat("%.1f k%s", value / 1e3, unit);
  return absl::StrFormat("%.0f %s", value, unit);
}

}  // namespace

void Ewma::Add(double amount, double seconds) {
  if (!(seconds > 0)) {
    amount_ += amount;
    return;
  }
  const double decay = std::exp(-seconds / tau_);
  amount_ = amount_ * decay + amount;
  time_ = time_ * decay + seconds;
}

Progress::Progress(const Options& options)
    : options_(options),
      tokens_rate_(options.tau_seconds),
      samples_rate_(options.tau_seconds),
      bytes_rate_(options.tau_seconds) {
  switch (options_.mode) {
    case ProgressMode::kAuto: bar_ = ::isatty(::fileno(options_.stream)) != 0; break;
    case ProgressMode::kBar: bar_ = true; break;
    default: bar_ = false; break;
  }
}

Progress::~Progress() { Stop(); }

std::string Progress::Duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  const int64_t s = static_cast<int64_t>(std::llround(seconds));
  if (s >= 3600) return absl::StrFormat("%d:%02d:%02d", s / 3600, s / 60 % 60, s % 60);
  return absl::StrFormat("%d:%02d", s / 60, s % 60);
}

std::string Progress::Format(int64_t done, int64_t total, int64_t tokens, int64_t total_tokens,
                             double tokens_per_s, double bytes_per_s, double elapsed_s, int width,
                             bool bar, int64_t failures, int64_t retries) {
  const double fraction = total > 0 ? static_cast<double>(done) / total : 1.0;
  const double eta = tokens_per_s > 0 ? (total_tokens - tokens) / tokens_per_s
                     : done >= total  ? 0.0
                                      : NAN;
  if (!bar) {
    return absl::StrFormat("%d/%d samples (%.0f%%), %d failed, %d retries, %s, %s, elapsed %s, ETA %s", done, total,
                           100.0 * fraction, failures, retries, Rate(tokens_per_s, "tokens/s"),
                           Rate(bytes_per_s, "B/s"), Duration(elapsed_s), Duration(eta));
  }
  const int digits = static_cast<int>(std::to_string(total).size());
  std::string text = absl::StrFormat(" %*d/%d %3.0f%% | %d failed %d retries | %s | %s | ETA %s", digits, done, total,
                                     100.0 * fraction, failures, retries, Rate(tokens_per_s, "tok/s"),
                                     Rate(bytes_per_s, "B/s"), Duration(eta));
  const int room = width - 1 - static_cast<int>(text.size()) - 2;
  if (room >= 5) {
    const int cells = std::min(room, 50);
    const int full = std::min(cells, static_cast<int>(fraction * cells));
    std::string cells_text(static_cast<size_t>(full), '=');
    if (full < cells) cells_text += '>';
    cells_text.resize(static_cast<size_t>(cells), ' ');
    text = absl::StrCat("[", cells_text, "]", text);
  }
  if (static_cast<int>(text.size()) >= width) text.resize(static_cast<size_t>(std::max(width - 1, 0)));
  return text;
}

void Progress::Start() {
  std::lock_guard<std::mutex> lock(mutex_);
  start_ = std::chrono::steady_clock::now();
  if ((options_.mode == ProgressMode::kNone && !options_.observer) || running_) return;
  running_ = true;
  thread_ = std::thread([this] { Loop(); });
}

void Progress::Add(int64_t samples, int64_t tokens, int64_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  samples_ += samples;
  tokens_ += tokens;
  bytes_ += bytes;
}

void Progress::AddFailure() {
  std::lock_guard<std::mutex> lock(mutex_);
  ++failures_;
}

ProgressSnapshot Progress::Snapshot(double t) {
  ProgressSnapshot s;
  s.samples = samples_;
  s.tokens = tokens_;
  s.bytes = bytes_;
  s.failures = failures_;
  s.retries = options_.retries ? options_.retries() : 0;
  s.tokens_per_s = tokens_rate_.Rate();
  s.samples_per_s = samples_rate_.Rate();
  s.bytes_per_s = bytes_rate_.Rate();
  s.elapsed_s = t;
  return s;
}

void Progress::Stop() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!running_) return;
    running_ = false;
    stop_ = true;
  }
  wake_.notify_all();
  thread_.join();
  std::lock_guard<std::mutex> lock(mutex_);
  if (options_.observer) {
    options_.observer(Snapshot(std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count()));
  }
  if (bar_ && drew_) {
    std::fprintf(options_.stream, "\r\033[K");
    std::fflush(options_.stream);
  }
}

void Progress::Loop() {
  std::unique_lock<std::mutex> lock(mutex_);
  const auto interval = std::chrono::duration_cast<std::chrono::steady_clock::duration>(
      std::chrono::duration<double>(options_.interval_seconds));
  auto next_plain = start_ + interval;
  while (!stop_) {
    wake_.wait_for(lock, kBarPeriod, [&] { return stop_; });
    if (stop_) break;
    const auto now = std::chrono::steady_clock::now();
    const double t = std::chrono::duration<double>(now - start_).count();
    const double dt = t - last_t_;
    tokens_rate_.Add(static_cast<double>(tokens_ - last_tokens_), dt);
    samples_rate_.Add(static_cast<double>(samples_ - last_samples_), dt);
    bytes_rate_.Add(static_cast<double>(bytes_ - last_bytes_), dt);
    last_t_ = t;
    last_tokens_ = tokens_;
    last_samples_ = samples_;
    last_bytes_ = bytes_;
    const bool plain_due = now >= next_plain;
    if (plain_due) next_plain = now + interval;
    if (options_.mode != ProgressMode::kNone && (bar_ || plain_due)) Report();
    if (plain_due && options_.observer) options_.observer(Snapshot(t));
  }
}

void Progress::Report() {
  const ProgressSnapshot s = Snapshot(last_t_);
  const std::string text = Format(s.samples, options_.total_samples, s.tokens, options_.total_tokens,
                                  s.tokens_per_s, s.bytes_per_s, s.elapsed_s,
                                  bar_ ? TerminalWidth(options_.stream) : 1 << 20, bar_, s.failures, s.retries);
  if (bar_) {
    std::fprintf(options_.stream, "\r%s\033[K", text.c_str());
    drew_ = true;
  } else {
    std::fprintf(options_.stream, "%s: %s\n", options_.label.c_str(), text.c_str());
  }
  std::fflush(options_.stream);
}

}  // namespace hsx
