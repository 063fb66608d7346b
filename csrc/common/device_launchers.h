#pragma once
// The per-device launchers of an op whose ATen glue is shared by every device. The glue is one
// function, registered for each dispatch key, that checks the arguments, builds the kernels'
// plain struct and calls the launcher that the device's source file registered here. So each
// op's signature is written once, and a build without CUDA simply has no CUDA launcher.

#include <c10/core/DeviceType.h>
#include <c10/util/Exception.h>

#include <array>

namespace torch_bigbatch {

template <typename Launcher>
class DeviceLaunchers {
 public:
  // A static object of this type in a device's source file registers its launcher.
  struct Register {
    Register(c10::DeviceType device, Launcher launcher) { slot(device) = launcher; }
  };

  // The launcher of `device`, or nullptr where this build has none.
  static Launcher find(c10::DeviceType device) { return slot(device); }

  static Launcher get(c10::DeviceType device, const char* op) {
    const Launcher launcher = slot(device);
    TORCH_CHECK(launcher != nullptr, op, ": this build of torch_bigbatch has no kernel for ",
                c10::DeviceTypeName(device), " tensors");
    return launcher;
  }

 private:
  static Launcher& slot(c10::DeviceType device) {
    constexpr auto kDevices = static_cast<size_t>(c10::DeviceType::COMPILE_TIME_MAX_DEVICE_TYPES);
    static std::array<Launcher, kDevices> table{};
    return table.at(static_cast<size_t>(device));
  }
};

}  // namespace torch_bigbatch
