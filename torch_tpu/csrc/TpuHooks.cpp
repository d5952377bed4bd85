// PrivateUse1 hooks: what generic PyTorch code asks of the accelerator
// (availability, generators, pinned memory, devices of pointers).

#include "TpuAllocator.h"
#include "TpuDevice.h"
#include "TpuGenerator.h"

#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <c10/core/StorageImpl.h>

#include <cstring>

namespace torch_tpu {
namespace {

struct TpuHooks final : public at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return device_count() > 0; }
  bool hasPrimaryContext(c10::DeviceIndex /*index*/) const override { return true; }
  c10::DeviceIndex deviceCount() const override { return device_count(); }
  void setCurrentDevice(c10::DeviceIndex index) const override { set_device(index); }
  c10::DeviceIndex getCurrentDevice() const override { return current_device(); }
  c10::DeviceIndex exchangeDevice(c10::DeviceIndex index) const override {
    return torch_tpu::exchange_device(index);
  }
  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex index) const override {
    return torch_tpu::exchange_device(index);
  }

  const at::Generator& getDefaultGenerator(c10::DeviceIndex index) const override {
    return default_generator(index);
  }
  at::Generator getNewGenerator(c10::DeviceIndex index) const override {
    return new_generator(index);
  }

  c10::Allocator* getPinnedMemoryAllocator() const override { return pinned_allocator(); }
  bool isPinnedPtr(const void* data) const override { return is_pinned(data); }

  at::Device getDeviceFromPtr(void* data) const override {
    const auto device = tpu_allocator().device_of(data);
    TORCH_CHECK(device >= 0, "Pointer ", data, " is not in tpu memory");
    return {c10::DeviceType::PrivateUse1, device};
  }

  // storage.resize_() from Python on a tpu storage.
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t newsize) const override {
    auto* impl = storage.unsafeGetStorageImpl();
    TORCH_CHECK(impl->resizable(), "Trying to resize a tpu storage that is not resizable");
    const auto device = impl->device().index();
    auto fresh = tpu_allocator().allocate_on(newsize, device);
    const size_t keep = std::min(newsize, impl->nbytes());
    if (keep > 0) {
      std::memcpy(fresh.get(), impl->data(), keep);
    }
    impl->set_data_ptr_noswap(std::move(fresh));
    impl->set_nbytes(newsize);
  }
};

struct Registration {
  Registration() { at::RegisterPrivateUse1HooksInterface(new TpuHooks()); }
};
Registration g_registration;

} // namespace
} // namespace torch_tpu
