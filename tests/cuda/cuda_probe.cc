// hsx_cuda_probe: prints, as one JSON object on stdout, what the CUDA runtime
// linked into hsx sees: its own version, the driver's, and each device (name,
// compute capability, multiprocessors, memory). The device check
// (scripts/device-check.sh) puts this at the top of its report.
//
// "No device" is an answer, not a failure: the object then carries "error"
// with the runtime's reason and the exit status is still 0. Exit status 1
// means the probe itself could not run (e.g. a bad flag).
#include <cuda_runtime_api.h>

#include <cstdio>
#include <string>

#include <nlohmann/json.hpp>

namespace {

// "13.0" from the runtime's 13000-style integers.
std::string VersionString(int version) {
  if (version <= 0) return "";
  return std::to_string(version / 1000) + "." + std::to_string((version % 1000) / 10);
}

nlohmann::json DescribeDevice(int index) {
  nlohmann::json device = {{"index", index}};
  cudaDeviceProp prop{};
  cudaError_t status = cudaGetDeviceProperties(&prop, index);
  if (status != cudaSuccess) {
    device["error"] = std::string("cudaGetDeviceProperties: ") + cudaGetErrorString(status);
    return device;
  }
  device["name"] = prop.name;
  device["compute_capability"] = std::to_string(prop.major) + "." + std::to_string(prop.minor);
  device["multiprocessors"] = prop.multiProcessorCount;
  device["memory_total_bytes"] = prop.totalGlobalMem;
  device["l2_bytes"] = prop.l2CacheSize;
  // Free memory needs a context on the device: this is also the first real use
  // of the driver, so an error here says the device is visible but unusable.
  size_t free_bytes = 0, total_bytes = 0;
  status = cudaSetDevice(index);
  if (status == cudaSuccess) status = cudaMemGetInfo(&free_bytes, &total_bytes);
  if (status != cudaSuccess) {
    device["error"] = std::string("cudaMemGetInfo: ") + cudaGetErrorString(status);
  } else {
    device["memory_free_bytes"] = free_bytes;
  }
  return device;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1) {
    std::fprintf(stderr,
                 "hsx_cuda_probe takes no arguments; it prints the CUDA runtime and driver\n"
                 "versions and the devices they see as one JSON object.\n");
    return std::string(argv[1]) == "--help" ? 0 : 1;
  }
  nlohmann::json out;
  int runtime_version = 0, driver_version = 0;
  cudaRuntimeGetVersion(&runtime_version);
  // 0 when no driver is installed: reported as such rather than as an error.
  cudaDriverGetVersion(&driver_version);
  out["runtime_version"] = VersionString(runtime_version);
  out["driver_version"] = VersionString(driver_version);
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  out["devices"] = nlohmann::json::array();
  if (status != cudaSuccess) {
    out["device_count"] = 0;
    out["error"] = std::string("cudaGetDeviceCount: ") + cudaGetErrorString(status);
  } else {
    out["device_count"] = count;
    if (count == 0) out["error"] = "cudaGetDeviceCount: 0 devices";
    for (int i = 0; i < count; ++i) out["devices"].push_back(DescribeDevice(i));
  }
  std::printf("%s\n", out.dump().c_str());
  return 0;
}
