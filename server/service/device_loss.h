// device_loss.h: what hsx-server does when its engine loses a device
// (server/runtime/engine.h, kernels/device_lost.h).
//
// The handler, given to EngineOptions::on_device_lost, logs the engine's
// status as an error, sets hsx_device_lost to 1 and turns both health names
// ("" and hsx.v1.HiddenStates) NOT_SERVING for good (Health::Shutdown), so
// that readiness takes the pod out of the Service and liveness restarts it
// (deploy/k8s). Extract calls then get the engine's UNAVAILABLE status at
// once (the batcher refuses them); the process stays up until it is
// restarted or signalled, so that probes, metrics and the log can say why.
#ifndef HSX_SERVER_SERVICE_DEVICE_LOSS_H_
#define HSX_SERVER_SERVICE_DEVICE_LOSS_H_

#include <functional>

#include "absl/status/status.h"
#include "server/service/health.h"
#include "server/service/metrics.h"

namespace hsx {

// `health` and `metrics` must outlive the handler.
std::function<void(const absl::Status&)> DeviceLossHandler(Health* health, Metrics* metrics);

}  // namespace hsx

#endif  // HSX_SERVER_SERVICE_DEVICE_LOSS_H_
