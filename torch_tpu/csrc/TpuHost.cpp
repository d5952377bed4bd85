#include "TpuHost.h"
#include "TpuStream.h"

#include <c10/core/CPUAllocator.h>
#include <c10/core/TensorImpl.h>

#include <cstring>

namespace torch_tpu {
namespace {

at::Tensor make_tensor(c10::Storage storage, c10::DispatchKey key, const at::Tensor& like) {
  auto impl = c10::make_intrusive<c10::TensorImpl>(
      std::move(storage), c10::DispatchKeySet(key), like.dtype());
  impl->set_sizes_and_strides(like.sizes(), like.strides(), like.storage_offset());
  impl->_set_conj(like.is_conj());
  impl->_set_neg(like.is_neg());
  return at::Tensor(std::move(impl));
}

void release_tpu_storage(void* owner) {
  delete static_cast<c10::Storage*>(owner);
}

// The tpu storage an owning host view's memory belongs to, or nullptr.
const c10::Storage* viewed_tpu_storage(const c10::DataPtr& data) {
  return data.get_deleter() == &release_tpu_storage ? static_cast<const c10::Storage*>(data.get_context())
                                                    : nullptr;
}

// Host views of a pending tensor would point CPU kernels at no memory.
void check_materialized(const at::Tensor& t) {
  TORCH_CHECK(!is_deferred(t), "a tpu tensor of sizes ", t.sizes(),
              " has no memory yet: it is pending under DeferAndFuse, and this thread does not run DeferAndFuse; "
              "call torch_tpu.defer.materialize() before handing tensors to it");
}

bool same_geometry(const at::Tensor& a, const at::Tensor& b) {
  return a.sizes().equals(b.sizes()) && a.strides().equals(b.strides()) &&
      a.storage_offset() == b.storage_offset();
}

} // namespace

void check_operand_device(const char* op, const at::Tensor& t, c10::DeviceIndex* device,
                          bool allow_cpu_tensors) {
  if (!t.defined()) {
    return;
  }
  if (is_tpu(t)) {
    const auto index = t.device().index();
    TORCH_CHECK(
        *device < 0 || *device == index,
        "Expected all tensors to be on the same device, but found at least two devices, tpu:",
        static_cast<int>(*device), " and tpu:", static_cast<int>(index), "! (in ", op, ")");
    *device = index;
    return;
  }
  TORCH_CHECK(
      allow_cpu_tensors || t.dim() == 0,
      "Expected all tensors to be on the same device, but found at least two devices, ",
      t.device(), " and tpu! (in ", op, "; only 0-dim cpu tensors mix with tpu tensors)");
}

c10::DeviceIndex common_device(const char* op, c10::ArrayRef<at::Tensor> tensors,
                               bool allow_cpu_tensors) {
  c10::DeviceIndex device = -1;
  for (const auto& t : tensors) {
    check_operand_device(op, t, &device, allow_cpu_tensors);
  }
  return device < 0 ? current_device() : device;
}

at::Tensor make_tpu_tensor(c10::Storage storage, const at::Tensor& like) {
  return make_tensor(std::move(storage), c10::DispatchKey::PrivateUse1, like);
}

bool is_deferred(const at::Tensor& t) {
  return t.numel() > 0 && t.storage().nbytes() == 0 && t.storage().data() == nullptr;
}

at::Tensor owning_host_view(const at::Tensor& t) {
  TORCH_CHECK(t.layout() == c10::kStrided, "tpu supports strided tensors only, got ", t.layout());
  check_materialized(t);
  c10::Storage tpu = t.storage();
  void* data = tpu.mutable_data();
  auto* owner = new c10::Storage(std::move(tpu));
  c10::DataPtr ptr(data, owner, &release_tpu_storage, c10::Device(c10::DeviceType::CPU));
  c10::Storage cpu(c10::Storage::use_byte_size_t(), owner->nbytes(), std::move(ptr), /*allocator=*/nullptr,
                   /*resizable=*/false);
  return make_tensor(std::move(cpu), c10::DispatchKey::CPU, t);
}

HostScope::HostScope(c10::DeviceIndex device, bool redirect)
    : device_(resolve(device)), device_scope_(device_), redirect_(redirect ? device_ : -1) {
  // As every tpu op: work queued on the current stream comes first (a copy, an .item(), a
  // kernel of our own as much as the boxed fallback's ops).
  wait_current_stream(device_);
}

at::Tensor HostScope::view(const at::Tensor& t) {
  if (!is_tpu(t)) {
    return t;
  }
  TORCH_CHECK(t.layout() == c10::kStrided, "tpu supports strided tensors only, got ", t.layout());
  check_materialized(t);
  for (const auto& v : views_) {
    if (v.tpu.unsafeGetTensorImpl() == t.unsafeGetTensorImpl()) {
      return v.cpu;
    }
  }
  auto* tpu_impl = t.storage().unsafeGetStorageImpl();
  c10::Storage cpu_storage;
  for (const auto& s : storages_) {
    if (s.tpu.unsafeGetStorageImpl() == tpu_impl) {
      cpu_storage = s.cpu;
      break;
    }
  }
  if (!cpu_storage) {
    // Non-owning: the tpu storage keeps the memory alive (storages_ holds it).
    // Resizable through the CPU allocator, which the redirect points at tpu
    // memory, so out= kernels may grow it; write_back() moves the new buffer.
    cpu_storage = c10::Storage(
        c10::Storage::use_byte_size_t(), tpu_impl->nbytes(),
        c10::DataPtr(tpu_impl->mutable_data(), c10::Device(c10::DeviceType::CPU)),
        c10::GetCPUAllocator(), /*resizable=*/true);
    storages_.push_back({t.storage(), cpu_storage});
  }
  auto cpu = make_tensor(std::move(cpu_storage), c10::DispatchKey::CPU, t);
  views_.push_back({t, cpu});
  return cpu;
}

void HostScope::write_back() {
  for (auto& s : storages_) {
    auto* cpu = s.cpu.unsafeGetStorageImpl();
    auto* tpu = s.tpu.unsafeGetStorageImpl();
    if (cpu->data() == tpu->data() && cpu->nbytes() == tpu->nbytes()) {
      continue;
    }
    // The kernel resized the storage: take over its new buffer.
    c10::DataPtr fresh = cpu->set_data_ptr(c10::DataPtr());
    const size_t nbytes = cpu->nbytes();
    if (!TpuAllocator::owns(fresh)) {
      auto copy = tpu_allocator().allocate_on(nbytes, device_);
      if (nbytes) {
        std::memcpy(copy.get(), fresh.get(), nbytes);
      }
      fresh = std::move(copy);
    }
    fresh.unsafe_set_device(tpu->device());
    tpu->set_data_ptr_noswap(std::move(fresh));
    tpu->set_nbytes(nbytes);
    // Later reads through the view see the tpu storage's (same) buffer.
    cpu->set_data_ptr_noswap(c10::DataPtr(tpu->mutable_data(), c10::Device(c10::DeviceType::CPU)));
  }
  for (auto& v : views_) {
    auto* tpu_impl = v.tpu.unsafeGetTensorImpl();
    const auto& cpu_storage = v.cpu.storage();
    bool restored = false;
    for (const auto& s : storages_) {
      if (s.cpu.unsafeGetStorageImpl() == cpu_storage.unsafeGetStorageImpl()) {
        if (s.tpu.unsafeGetStorageImpl() != v.tpu.storage().unsafeGetStorageImpl()) {
          tpu_impl->set_storage_keep_dtype(s.tpu);
        }
        restored = true;
        break;
      }
    }
    if (!restored) {
      // The kernel pointed the tensor at storage of its own (set_).
      tpu_impl->set_storage_keep_dtype(tpu_storage_for(cpu_storage));
    }
    if (!same_geometry(v.tpu, v.cpu)) {
      tpu_impl->set_sizes_and_strides(v.cpu.sizes(), v.cpu.strides(), v.cpu.storage_offset());
    }
  }
}

c10::Storage HostScope::tpu_storage_for(const c10::Storage& cpu) {
  const c10::SmallVectorImpl<StoragePair>* lists[] = {&storages_, &adopted_};
  for (const auto* pairs : lists) {
    for (const auto& s : *pairs) {
      if (s.cpu.unsafeGetStorageImpl() == cpu.unsafeGetStorageImpl()) {
        return s.tpu;
      }
    }
  }
  auto* impl = cpu.unsafeGetStorageImpl();
  if (const c10::Storage* viewed = viewed_tpu_storage(impl->data_ptr())) {
    return *viewed;  // a result aliasing an owning host view's tpu tensor
  }
  const size_t nbytes = impl->nbytes();
  c10::DataPtr data;
  if (TpuAllocator::owns(impl->data_ptr())) {
    // Allocated in tpu memory under the redirect: re-tag, no copy. The CPU
    // storage is left empty; it was only ever visible to the kernel.
    data = impl->set_data_ptr(c10::DataPtr());
    data.unsafe_set_device(c10::Device(c10::DeviceType::PrivateUse1, device_));
  } else {
    data = tpu_allocator().allocate_on(nbytes, device_);
    if (nbytes && impl->data()) {
      std::memcpy(data.get(), impl->data(), nbytes);
    }
  }
  c10::Storage tpu(
      c10::Storage::use_byte_size_t(), nbytes, std::move(data), &tpu_allocator(),
      /*resizable=*/true);
  adopted_.push_back({tpu, cpu});
  return tpu;
}

at::Tensor HostScope::adopt(const at::Tensor& result) {
  if (!result.defined() || result.device().type() != c10::DeviceType::CPU) {
    return result;
  }
  for (const auto& v : views_) {
    if (v.cpu.unsafeGetTensorImpl() == result.unsafeGetTensorImpl()) {
      return v.tpu;  // in-place and out= ops return their argument
    }
  }
  return make_tpu_tensor(tpu_storage_for(result.storage()), result);
}

} // namespace torch_tpu
