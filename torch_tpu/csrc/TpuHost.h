#pragma once
// Running CPU kernels on tpu memory without copies.
//
// A HostScope lends CPU kernels zero-copy CPU views of tpu tensors and turns
// the kernels' CPU results back into tpu tensors. While it is alive, CPU
// allocations on this thread come from the tpu allocator (HostRedirect), so a
// fresh result is re-tagged, never copied; a result that aliases an input is
// rebuilt on the input's tpu storage; an out= tensor the kernel resized gets
// its new buffer and shape carried back.

#include "TpuAllocator.h"
#include "TpuDevice.h"

#include <ATen/core/Tensor.h>
#include <c10/util/SmallVector.h>

#include <initializer_list>

namespace torch_tpu {

inline bool is_tpu(const at::Tensor& t) {
  return t.defined() && t.device().type() == c10::DeviceType::PrivateUse1;
}

class HostScope {
 public:
  // redirect=false keeps CPU allocations in CPU memory: for kernels whose
  // results are meant to be CPU tensors (copies to cpu).
  explicit HostScope(c10::DeviceIndex device, bool redirect = true);
  HostScope(const HostScope&) = delete;
  HostScope& operator=(const HostScope&) = delete;

  // Zero-copy CPU view of a tpu tensor; other tensors pass through.
  at::Tensor view(const at::Tensor& t);
  // Carries resizes and re-storing done by the kernel back to the tpu
  // tensors that were viewed. Call once, after the kernel, before adopt().
  void write_back();
  // The tpu tensor for a CPU result of a kernel run in this scope.
  at::Tensor adopt(const at::Tensor& result);

  c10::DeviceIndex device() const { return device_; }

 private:
  c10::Storage tpu_storage_for(const c10::Storage& cpu);

  struct StoragePair {
    c10::Storage tpu;
    c10::Storage cpu;
  };
  struct ViewPair {
    at::Tensor tpu;
    at::Tensor cpu;
  };
  c10::DeviceIndex device_;
  DeviceScope device_scope_;
  HostRedirect redirect_;
  c10::SmallVector<StoragePair, 4> storages_;  // storages of viewed tensors
  c10::SmallVector<StoragePair, 2> adopted_;   // storages of fresh results
  c10::SmallVector<ViewPair, 4> views_;
};

// The device all tpu operands share. Raises, as CUDA does, when they sit on
// different devices or when a CPU tensor that is not a 0-dim scalar is mixed
// in (unless allow_cpu_tensors: indices of index/index_put may be on the CPU).
c10::DeviceIndex common_device(const char* op, c10::ArrayRef<at::Tensor> tensors,
                               bool allow_cpu_tensors = false);

// A tpu kernel's body: `compute(scope)` on views of the operands inside a
// HostScope of their common device, its CPU result returned as a tpu tensor.
template <class F>
at::Tensor on_host(const char* op, std::initializer_list<at::Tensor> operands, F compute) {
  HostScope scope(common_device(op, operands));
  at::Tensor result = compute(scope);
  scope.write_back();
  return scope.adopt(result);
}

// Checks one operand against the device found so far (-1: none yet).
void check_operand_device(const char* op, const at::Tensor& t, c10::DeviceIndex* device,
                          bool allow_cpu_tensors);

// Whether a tpu tensor is pending under DeferAndFuse: sizes, no memory yet.
bool is_deferred(const at::Tensor& t);

// A CPU tensor on the memory of a tpu tensor that holds a reference to the
// tpu storage, so it may outlive the call that made it (HostScope's views
// borrow the storage instead). HostScope::adopt turns a result on such a view
// back into a tensor on the tpu storage.
at::Tensor owning_host_view(const at::Tensor& t);

// A tpu tensor with the geometry of `like` on the given tpu storage.
at::Tensor make_tpu_tensor(c10::Storage storage, const at::Tensor& like);

} // namespace torch_tpu
