#pragma once
// Emulated HBM: tpu tensors own host memory handed out here, counted per
// device against the chip's capacity. Freed blocks are cached for reuse
// (memory_reserved >= memory_allocated; empty_cache() releases them). A
// request that does not fit releases the cache and retries; if it still does
// not fit it raises torch.OutOfMemoryError and the process keeps working.

#include <c10/core/CachingDeviceAllocator.h>

namespace torch_tpu {

class TpuAllocator final : public c10::DeviceAllocator {
 public:
  // Allocates on the current device.
  c10::DataPtr allocate(size_t nbytes) override;
  c10::DataPtr allocate_on(size_t nbytes, c10::DeviceIndex device);
  c10::DeleterFnPtr raw_deleter() const override;
  void copy_data(void* dest, const void* src, std::size_t count) const override;

  bool initialized() override { return true; }
  // Returns every cached block to the host.
  void emptyCache(c10::MempoolId_t mempool_id = {0, 0}) override;
  // Work runs in order on the host, so a block is never in use by a stream
  // after its owner frees it.
  void recordStream(const c10::DataPtr& /*ptr*/, c10::Stream /*stream*/) override {}
  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(c10::DeviceIndex device) override;
  void resetAccumulatedStats(c10::DeviceIndex device) override;
  void resetPeakStats(c10::DeviceIndex device) override;
  // (free, total) bytes.
  std::pair<size_t, size_t> getMemoryInfo(c10::DeviceIndex device) override;

  // The device owning the block that contains ptr, or -1.
  c10::DeviceIndex device_of(const void* ptr) const;
  static bool owns(const c10::DataPtr& data_ptr);
};

TpuAllocator& tpu_allocator();

// While a HostRedirect is alive on a thread, CPU allocations made on that
// thread come from tpu memory (tagged as CPU). The fallback runs CPU kernels
// under it, so their fresh outputs already live in tpu memory and only need
// re-tagging, never copying.
class HostRedirect {
 public:
  explicit HostRedirect(c10::DeviceIndex device);
  ~HostRedirect();
  HostRedirect(const HostRedirect&) = delete;
  HostRedirect& operator=(const HostRedirect&) = delete;

 private:
  c10::DeviceIndex previous_;
};

// Sets this thread's redirect (-1: none) and returns the one it replaces, for
// code that cannot hold a HostRedirect (Python running compiled CPU graphs).
c10::DeviceIndex exchange_host_redirect(c10::DeviceIndex device);

// Page-locked host memory for DataLoader(pin_memory=True) and friends.
c10::Allocator* pinned_allocator();
bool is_pinned(const void* ptr);

} // namespace torch_tpu
