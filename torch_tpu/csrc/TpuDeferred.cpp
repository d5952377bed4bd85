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

// dtype and device come as integers (dtype_code's, a tpu index): converting a
// torch.dtype and a torch.device from Python costs more than the rest of the
// call, and DeferAndFuse makes one of these per recorded op.
at::Tensor deferred_empty(c10::IntArrayRef size, c10::IntArrayRef stride, int64_t dtype, int64_t device) {
  TORCH_CHECK(dtype >= 0 && dtype < static_cast<int64_t>(c10::ScalarType::NumOptions), "_deferred_empty: dtype code ",
              dtype, " is not a ScalarType");
  TORCH_CHECK(device >= -1 && device < device_count(), "_deferred_empty: no tpu device ", device, " (", device_count(),
              " devices)");
  const auto index = resolve(static_cast<c10::DeviceIndex>(device));
  c10::Storage storage(c10::Storage::use_byte_size_t(), 0,
                       c10::DataPtr(nullptr, c10::Device(c10::DeviceType::PrivateUse1, index)), &tpu_allocator(),
                       /*resizable=*/true);
  auto impl = c10::make_intrusive<c10::TensorImpl>(std::move(storage), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                                   c10::scalarTypeToTypeMeta(static_cast<c10::ScalarType>(dtype)));
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

int64_t dtype_code(c10::ScalarType dtype) {
  return static_cast<int64_t>(dtype);
}

// Per tensor: [TensorImpl holders, storage holders] (the call holds one of the
// first). One call for all of a graph's pending tensors: DeferAndFuse asks at
// every materialization, and a call costs more than the counting.
std::vector<int64_t> holders(at::TensorList tensors) {
  std::vector<int64_t> counts;
  counts.reserve(2 * tensors.size());
  for (const auto& t : tensors) {
    counts.push_back(static_cast<int64_t>(t.use_count()));
    counts.push_back(static_cast<int64_t>(t.storage().use_count()));
  }
  return counts;
}

} // namespace

TORCH_LIBRARY_FRAGMENT(torch_tpu, m) {
  m.def("_deferred_empty(int[] size, int[] stride, int dtype, int device) -> Tensor", deferred_empty);
  m.def("_dtype_code(ScalarType dtype) -> int", dtype_code);
  // A deferred view: the base's (empty) storage with the view's geometry, so it sees the
  // base's memory once that is filled.
  m.def("_deferred_alias(Tensor base, int[] size, int[] stride, int offset) -> Tensor", alias_with);
  m.def("_fill_deferred(Tensor self, Tensor value) -> bool", fill_deferred);
  m.def("_is_deferred(Tensor self) -> bool", is_deferred);
  m.def("_holders(Tensor[] tensors) -> int[]", holders);
}

} // namespace torch_tpu
