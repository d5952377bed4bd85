// Tensors DeferAndFuse hands out before their values exist
// (torch_tpu/defer.py): a tpu tensor with its sizes, strides and dtype and no
// memory yet; when its graph runs, the result's storage and geometry are set
// into the same TensorImpl, so every holder (Python, autograd) sees the value.

#include "TpuAllocator.h"
#include "TpuDevice.h"
#include "TpuHost.h"
#include "TpuStorage.h"

#include <ATen/EmptyTensor.h>
#include <c10/core/TensorImpl.h>
#include <torch/library.h>

namespace torch_tpu {
namespace {

at::Tensor deferred_empty(c10::IntArrayRef size, c10::IntArrayRef stride, c10::ScalarType dtype,
                          c10::Device device) {
  const auto index = resolve(index_of(device));
  c10::Storage storage(c10::Storage::use_byte_size_t(), 0,
                       c10::DataPtr(nullptr, c10::Device(c10::DeviceType::PrivateUse1, index)), &tpu_allocator(),
                       /*resizable=*/true);
  auto impl = c10::make_intrusive<c10::TensorImpl>(std::move(storage), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                                   c10::scalarTypeToTypeMeta(dtype));
  impl->set_sizes_and_strides(size, stride, 0);
  return at::Tensor(std::move(impl));
}

// Gives a deferred tensor's storage its memory: the value's buffer itself when
// nothing else holds it and its geometry is the deferred one (no copy), else
// a fresh buffer the caller copies the value into (returns true then). Every
// tensor on that storage - views, autograd's saved copies - sees it.
bool fill_deferred(const at::Tensor& self, const at::Tensor& value) {
  TORCH_CHECK(self.scalar_type() == value.scalar_type() && self.sizes().equals(value.sizes()) &&
                  self.device() == value.device(),
              "fill_deferred: the value (", value.scalar_type(), value.sizes(), " on ", value.device(),
              ") does not fit the deferred tensor (", self.scalar_type(), self.sizes(), " on ", self.device(), ")");
  auto* storage = self.storage().unsafeGetStorageImpl();
  TORCH_CHECK(storage->nbytes() == 0 && storage->data() == nullptr, "fill_deferred: the tensor has memory already");
  auto* source = value.storage().unsafeGetStorageImpl();
  const bool same_geometry = value.strides().equals(self.strides()) &&
      value.storage_offset() == self.storage_offset();
  // Only the caller's tensor (and this call's argument) holds the TensorImpl,
  // and only that TensorImpl its storage.
  if (same_geometry && value.use_count() <= 2 && value.storage().use_count() == 1 &&
      TpuAllocator::owns(source->data_ptr())) {
    const size_t nbytes = source->nbytes();
    storage->set_data_ptr_noswap(source->set_data_ptr(c10::DataPtr()));
    storage->set_nbytes(nbytes);
    source->set_nbytes(0);
    return false;
  }
  grow_storage(self, at::detail::computeStorageNbytes(self.sizes(), self.strides(), self.dtype().itemsize(),
                                                      self.storage_offset()));
  return true;
}

// [TensorImpl holders, storage holders] (the call holds one of the first).
std::vector<int64_t> holders(const at::Tensor& self) {
  return {static_cast<int64_t>(self.use_count()), static_cast<int64_t>(self.storage().use_count())};
}

} // namespace

TORCH_LIBRARY_FRAGMENT(torch_tpu, m) {
  m.def("_deferred_empty(int[] size, int[] stride, ScalarType dtype, Device device) -> Tensor", deferred_empty);
  // A deferred view: the base's (empty) storage with the view's geometry, so it sees the
  // base's memory once that is filled.
  m.def("_deferred_alias(Tensor base, int[] size, int[] stride, int offset) -> Tensor", alias_with);
  m.def("_fill_deferred(Tensor self, Tensor value) -> bool", fill_deferred);
  m.def("_is_deferred(Tensor self) -> bool", is_deferred);
  m.def("_holders(Tensor self) -> int[]", holders);
}

} // namespace torch_tpu
