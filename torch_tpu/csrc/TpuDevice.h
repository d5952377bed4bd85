#pragma once
// Emulated topology: how many tpu devices exist and how much HBM each has.
// Python (torch_tpu/chips.py) resolves the chip profile and calls configure()
// once, before the first tensor is created.

#include <c10/core/Device.h>

#include <cstdint>

namespace torch_tpu {

void configure(int64_t num_devices, int64_t hbm_bytes_per_device);
c10::DeviceIndex device_count() noexcept;
int64_t hbm_capacity() noexcept;

// Raises a clear error naming the valid range.
void check_device_index(c10::DeviceIndex index);

// The calling thread's current tpu device (like cudaSetDevice: per thread).
c10::DeviceIndex current_device() noexcept;
void set_device(c10::DeviceIndex index);
c10::DeviceIndex exchange_device(c10::DeviceIndex index);

// Resolves -1 ("current") to a concrete index.
inline c10::DeviceIndex resolve(c10::DeviceIndex index) noexcept {
  return index < 0 ? current_device() : index;
}

// Sets the current device for a scope and restores it afterwards.
class DeviceScope {
 public:
  explicit DeviceScope(c10::DeviceIndex index)
      : previous_(exchange_device(resolve(index))) {}
  ~DeviceScope() { set_device(previous_); }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  c10::DeviceIndex previous_;
};

} // namespace torch_tpu
