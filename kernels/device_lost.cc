// device_lost.cc: the device-lost mark, a status payload.
#include "kernels/device_lost.h"

#include "absl/strings/cord.h"
#include "absl/types/optional.h"

namespace hsx {
namespace {

// The payload's type URL (absl's convention: a URL naming the payload type).
constexpr absl::string_view kDeviceLostUrl = "type.googleapis.com/hsx.DeviceLost";

}  // namespace

absl::Status MarkDeviceLost(absl::Status status, absl::string_view device) {
  if (!status.ok()) status.SetPayload(kDeviceLostUrl, absl::Cord(device));
  return status;
}

bool IsDeviceLost(const absl::Status& status) { return status.GetPayload(kDeviceLostUrl).has_value(); }

std::string LostDevice(const absl::Status& status) {
  const absl::optional<absl::Cord> device = status.GetPayload(kDeviceLostUrl);
  return device.has_value() ? std::string(*device) : std::string();
}

}  // namespace hsx
