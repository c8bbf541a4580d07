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

constexpr double kWindowSeconds = 5.0;
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

Progress::Progress(const Options& options) : options_(options) {
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
                             bool bar) {
  const double fraction = total > 0 ? static_cast<double>(done) / total : 1.0;
  const double eta = tokens_per_s > 0 ? (total_tokens - tokens) / tokens_per_s
                     : done >= total  ? 0.0
                                      : NAN;
  if (!bar) {
    return absl::StrFormat("%d/%d samples (%.0f%%), %s, %s, elapsed %s, ETA %s", done, total, 100.0 * fraction,
                           Rate(tokens_per_s, "tokens/s"), Rate(bytes_per_s, "B/s"), Duration(elapsed_s),
                           Duration(eta));
  }
  const int digits = static_cast<int>(std::to_string(total).size());
  std::string text = absl::StrFormat(" %*d/%d %3.0f%% | %s | %s | ETA %s", digits, done, total, 100.0 * fraction,
                                     Rate(tokens_per_s, "tok/s"), Rate(bytes_per_s, "B/s"), Duration(eta));
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
  window_.push_back({0.0, 0, 0});
  if (options_.mode == ProgressMode::kNone || running_) return;
  running_ = true;
  thread_ = std::thread([this] { Loop(); });
}

void Progress::Add(int64_t samples, int64_t tokens, int64_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  samples_ += samples;
  tokens_ += tokens;
  bytes_ += bytes;
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
  if (bar_ && drew_) {
    std::fprintf(options_.stream, "\r\033[K");
    std::fflush(options_.stream);
  }
}

void Progress::Loop() {
  std::unique_lock<std::mutex> lock(mutex_);
  auto next_plain = start_ + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                 std::chrono::duration<double>(options_.interval_seconds));
  while (!stop_) {
    wake_.wait_for(lock, kBarPeriod, [&] { return stop_; });
    if (stop_) break;
    const auto now = std::chrono::steady_clock::now();
    const double t = std::chrono::duration<double>(now - start_).count();
    window_.push_back({t, tokens_, bytes_});
    while (window_.size() > 2 && window_.front().t < t - kWindowSeconds) window_.pop_front();
    if (bar_) {
      Report();
    } else if (now >= next_plain) {
      Report();
      next_plain = now + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                             std::chrono::duration<double>(options_.interval_seconds));
    }
  }
}

void Progress::Report() {
  const Point& first = window_.front();
  const Point& last = window_.back();
  const double span = last.t - first.t;
  const double tokens_per_s = span > 0 ? (last.tokens - first.tokens) / span : 0.0;
  const double bytes_per_s = span > 0 ? (last.bytes - first.bytes) / span : 0.0;
  const std::string text = Format(samples_, options_.total_samples, tokens_, options_.total_tokens,
                                  tokens_per_s, bytes_per_s, last.t,
                                  bar_ ? TerminalWidth(options_.stream) : 1 << 20, bar_);
  if (bar_) {
    std::fprintf(options_.stream, "\r%s\033[K", text.c_str());
    drew_ = true;
  } else {
    std::fprintf(options_.stream, "%s: %s\n", options_.label.c_str(), text.c_str());
  }
  std::fflush(options_.stream);
}

}  // namespace hsx
