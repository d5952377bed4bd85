#include "TpuDevice.h"

#include <c10/util/Exception.h>

#include <atomic>

namespace torch_tpu {
namespace {
std::atomic<c10::DeviceIndex> g_num_devices{1};
std::atomic<int64_t> g_hbm_bytes{int64_t{1} << 30};
thread_local c10::DeviceIndex t_current = 0;
} // namespace

void configure(int64_t num_devices, int64_t hbm_bytes_per_device) {
  TORCH_CHECK(
      num_devices >= 1 && num_devices <= 64,
      "TORCH_TPU_NUM_DEVICES must be between 1 and 64, got ", num_devices);
  TORCH_CHECK(
      hbm_bytes_per_device > 0,
      "HBM capacity per device must be positive, got ", hbm_bytes_per_device);
  g_num_devices = static_cast<c10::DeviceIndex>(num_devices);
  g_hbm_bytes = hbm_bytes_per_device;
}

c10::DeviceIndex device_count() noexcept {
  return g_num_devices.load();
}

int64_t hbm_capacity() noexcept {
  return g_hbm_bytes.load();
}

void check_device_index(c10::DeviceIndex index) {
  TORCH_CHECK(
      index >= 0 && index < device_count(),
      "Invalid tpu device index ", static_cast<int>(index),
      ": valid indices are 0..", device_count() - 1,
      " (set TORCH_TPU_NUM_DEVICES for more devices)");
}

c10::DeviceIndex current_device() noexcept {
  return t_current;
}

void set_device(c10::DeviceIndex index) {
  check_device_index(index);
  t_current = index;
}

c10::DeviceIndex exchange_device(c10::DeviceIndex index) {
  const auto previous = t_current;
  if (index != previous) {
    set_device(index);
  }
  return previous;
}

} // namespace torch_tpu
