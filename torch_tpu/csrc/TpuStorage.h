#pragma once
// Storage and view helpers the tpu kernels share (defined in TpuMinimalOps.cpp).

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <optional>

namespace torch_tpu {

// The tpu device index of `device` (the current device when it has none); raises for a non-tpu device.
c10::DeviceIndex index_of(std::optional<c10::Device> device);

// A fresh strided tpu tensor on tpu:`device` (the empty_strided kernel's allocation).
at::Tensor empty_strided_on(c10::DeviceIndex device, c10::IntArrayRef size, c10::IntArrayRef stride,
                            c10::ScalarType dtype);

// A view of `self`'s storage with the given geometry (no bounds check).
at::Tensor alias_with(const at::Tensor& self, c10::IntArrayRef size, c10::IntArrayRef stride,
                      int64_t storage_offset);

// Grows `self`'s storage to at least `nbytes` (keeping its bytes); no-op when it is big enough.
void grow_storage(const at::Tensor& self, size_t nbytes);

} // namespace torch_tpu
