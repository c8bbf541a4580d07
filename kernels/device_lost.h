// device_lost.h: how a backend or communicator says "this device is lost",
// as opposed to "this batch failed".
//
// Most errors belong to one batch: a bad size, out of memory for this batch's
// activations, a graph cuDNN cannot build for this shape. The engine fails
// the batch and serves the next one. Some leave the device (or its context,
// or the communicator joining it to the others) unusable for every later
// batch: on CUDA the sticky errors (an illegal address, a launch failure, an
// uncorrectable ECC error, ...; kernels/cuda/cuda_errors.h lists them), after
// which every CUDA call of the process returns the same error. Running on
// would fail every batch, or worse, so the engine stops serving and the
// server turns NOT_SERVING (server/runtime/engine.h).
//
// The mark is a status payload, not a code or a message pattern: the status
// keeps its code and message (what failed, as the backend said it), and
// IsDeviceLost() reads the payload wherever the status travels (the forward
// pass and the communicators pass statuses on unchanged).
#ifndef HSX_KERNELS_DEVICE_LOST_H_
#define HSX_KERNELS_DEVICE_LOST_H_

#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace hsx {

// `status` (not OK) marked as a lost device; `device` names it ("cuda:1").
// An OK status stays OK.
absl::Status MarkDeviceLost(absl::Status status, absl::string_view device);

// Whether `status` carries the mark.
bool IsDeviceLost(const absl::Status& status);

// The device named by the mark; empty when there is none.
std::string LostDevice(const absl::Status& status);

}  // namespace hsx

#endif  // HSX_KERNELS_DEVICE_LOST_H_
