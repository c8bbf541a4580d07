// log.cc: the stderr line writer.
#include "server/service/log.h"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace hsx {
namespace {

// The length of the valid UTF-8 sequence starting at text[i], or 0.
size_t Utf8Length(absl::string_view text, size_t i) {
  const auto byte = [&](size_t k) { return static_cast<unsigned char>(text[k]); };
  const unsigned char lead = byte(i);
  size_t length;
  uint32_t min;
  if (lead < 0x80) return 1;
  if ((lead & 0xe0) == 0xc0) {
    length = 2;
    min = 0x80;
  } else if ((lead & 0xf0) == 0xe0) {
    length = 3;
    min = 0x800;
  } else if ((lead & 0xf8) == 0xf0) {
    length = 4;
    min = 0x10000;
  } else {
    return 0;
  }
  if (i + length > text.size()) return 0;
  uint32_t code = lead & (0x7f >> length);
  for (size_t k = 1; k < length; ++k) {
    if ((byte(i + k) & 0xc0) != 0x80) return 0;
    code = (code << 6) | (byte(i + k) & 0x3f);
  }
  if (code < min || code > 0x10ffff || (code >= 0xd800 && code <= 0xdfff)) return 0;  // overlong, surrogate
  return length;
}

}  // namespace

std::string TruncateForLog(absl::string_view text, size_t max_bytes) {
  size_t i = 0;
  while (i < text.size()) {
    const size_t length = std::max<size_t>(Utf8Length(text, i), 1);
    if (i + length > max_bytes) return absl::StrCat(text.substr(0, i), "...");
    i += length;
  }
  return std::string(text);
}

std::string EscapeForLog(absl::string_view text, size_t max_bytes) {
  std::string out;
  size_t i = 0;
  while (i < text.size()) {
    const size_t length = Utf8Length(text, i);
    if (i + std::max<size_t>(length, 1) > max_bytes) {
      out += "...";
      break;
    }
    const unsigned char c = static_cast<unsigned char>(text[i]);
    if (length == 0 || c < 0x20 || c == 0x7f) {
      absl::StrAppendFormat(&out, "\\x%02x", c);
      ++i;
    } else if (c == '\\') {
      out += "\\\\";
      ++i;
    } else {
      out.append(text.data() + i, length);
      i += length;
    }
  }
  return out;
}

void LogLine(LogLevel level, const std::string& message) {
  static std::mutex mutex;
  const char tag = level == LogLevel::kInfo ? 'I' : level == LogLevel::kWarning ? 'W' : 'E';
  const std::string line =
      absl::StrFormat("%s %c hsx-server: %s\n",
                      absl::FormatTime("%Y-%m-%dT%H:%M:%E3SZ", absl::Now(), absl::UTCTimeZone()), tag,
                      EscapeForLog(message, 16384));
  std::lock_guard<std::mutex> lock(mutex);
  std::fwrite(line.data(), 1, line.size(), stderr);
  std::fflush(stderr);
}

}  // namespace hsx
