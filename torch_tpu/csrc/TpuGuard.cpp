// Device guard: device switching, streams and events for the generic
// torch.Stream / torch.Event / torch.accelerator APIs.

#include "TpuDevice.h"
#include "TpuStream.h"

#include <c10/core/impl/DeviceGuardImplInterface.h>

namespace torch_tpu {
namespace {

struct TpuGuardImpl final : public c10::impl::DeviceGuardImplInterface {
  static constexpr c10::DeviceType kType = c10::DeviceType::PrivateUse1;

  TpuGuardImpl() = default;
  explicit TpuGuardImpl(c10::DeviceType t) {
    TORCH_CHECK(t == kType, "TpuGuardImpl got device type ", t);
  }

  c10::DeviceType type() const override { return kType; }

  c10::Device exchangeDevice(c10::Device d) const override {
    TORCH_CHECK(d.type() == kType, "Expected a tpu device, got ", d);
    return {kType, torch_tpu::exchange_device(d.index())};
  }
  c10::Device getDevice() const override { return {kType, current_device()}; }
  void setDevice(c10::Device d) const override {
    TORCH_CHECK(d.type() == kType, "Expected a tpu device, got ", d);
    set_device(d.index());
  }
  void uncheckedSetDevice(c10::Device d) const noexcept override {
    if (d.index() >= 0 && d.index() < device_count()) {
      set_device(d.index());
    }
  }
  c10::DeviceIndex deviceCount() const noexcept override { return device_count(); }

  c10::Stream getStream(c10::Device d) const override { return current_stream(d.index()); }
  c10::Stream getDefaultStream(c10::Device d) const override { return default_stream(d.index()); }
  c10::Stream getNewStream(c10::Device d, int /*priority*/) const override {
    return new_stream(d.index());
  }
  c10::Stream getStreamFromGlobalPool(c10::Device d, bool /*high_priority*/) const override {
    return new_stream(d.index());
  }
  c10::Stream exchangeStream(c10::Stream s) const override { return exchange_stream(s); }
  bool queryStream(const c10::Stream& s) const override { return query_stream(s); }
  void synchronizeStream(const c10::Stream& s) const override { synchronize_stream(s); }
  void synchronizeDevice(const c10::DeviceIndex index) const override {
    synchronize_device(index);
  }

  void record(void** event, const c10::Stream& s, const c10::DeviceIndex index,
              const c10::EventFlag /*flag*/) const override {
    TORCH_CHECK(
        index == -1 || index == s.device_index(), "Event device index ",
        static_cast<int>(index), " does not match the recording stream's device ",
        static_cast<int>(s.device_index()));
    *event = record_event(*event, s);
  }
  void block(void* event, const c10::Stream& s) const override { block_on_event(event, s); }
  bool queryEvent(void* event) const override { return query_event(event); }
  void synchronizeEvent(void* event) const override { synchronize_event(event); }
  double elapsedTime(void* start, void* end, const c10::DeviceIndex /*index*/) const override {
    return elapsed_ms(start, end);
  }
  void destroyEvent(void* event, const c10::DeviceIndex /*index*/) const noexcept override {
    destroy_event(event);
  }
  // Blocks are freed in program order on the host; nothing to record.
  void recordDataPtrOnStream(const c10::DataPtr& /*ptr*/, const c10::Stream& /*s*/) const override {}
};

C10_REGISTER_GUARD_IMPL(PrivateUse1, TpuGuardImpl);

} // namespace
} // namespace torch_tpu
