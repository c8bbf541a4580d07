// device_loss.cc: log, metric and health on a lost device.
#include "server/service/device_loss.h"

#include "server/service/log.h"

namespace hsx {

std::function<void(const absl::Status&)> DeviceLossHandler(Health* health, Metrics* metrics) {
  return [health, metrics](const absl::Status& lost) {
    LogError("%s; health NOT_SERVING (\"\" and %s) until the process is restarted", lost.message(), kServiceName);
    metrics->DeviceLost();
    health->Shutdown();
  };
}

}  // namespace hsx
