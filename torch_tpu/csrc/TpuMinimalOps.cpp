// Kernels every backend must provide itself: allocation, metadata-only views,
// resizing, storage swaps, cross-device copies and reading a scalar.

#include "TpuStorage.h"
#include "TpuHost.h"

#include <ATen/EmptyTensor.h>
#include <ATen/InferSize.h>
#include <ATen/TensorUtils.h>
#include <ATen/ops/_local_scalar_dense.h>
#include <c10/core/TensorImpl.h>
#include <torch/library.h>

#include <cstring>

namespace torch_tpu {

// Shared with the other tpu kernels (TpuStorage.h).

c10::DeviceIndex index_of(std::optional<c10::Device> device) {
  if (device.has_value()) {
    TORCH_CHECK(
        device->type() == c10::DeviceType::PrivateUse1,
        "Expected a tpu device, got ", *device);
    if (device->has_index()) {
      return device->index();
    }
  }
  return current_device();
}

at::Tensor alias_with(const at::Tensor& self, c10::IntArrayRef size, c10::IntArrayRef stride,
                      int64_t storage_offset) {
  auto impl = c10::make_intrusive<c10::TensorImpl>(
      c10::TensorImpl::VIEW, c10::Storage(self.storage()), self.key_set(), self.dtype());
  impl->set_sizes_and_strides(size, stride, storage_offset);
  return at::Tensor(std::move(impl));
}

void grow_storage(const at::Tensor& self, size_t nbytes) {
  auto* storage = self.storage().unsafeGetStorageImpl();
  if (nbytes <= storage->nbytes()) {
    return;
  }
  TORCH_CHECK(storage->resizable(), "Trying to resize a tpu storage that is not resizable");
  auto fresh = tpu_allocator().allocate_on(nbytes, self.device().index());
  if (storage->nbytes()) {
    std::memcpy(fresh.get(), storage->data(), storage->nbytes());
  }
  storage->set_data_ptr_noswap(std::move(fresh));
  storage->set_nbytes(nbytes);
}

namespace {

constexpr auto kTpuKeys = c10::DispatchKeySet(c10::DispatchKey::PrivateUse1);

} // namespace

at::Tensor empty_strided_on(c10::DeviceIndex device, c10::IntArrayRef size, c10::IntArrayRef stride,
                            c10::ScalarType dtype) {
  DeviceScope scope(device);
  return at::detail::empty_strided_generic(size, stride, &tpu_allocator(), kTpuKeys, dtype);
}

namespace {

at::Tensor empty_memory_format(
    c10::IntArrayRef size, std::optional<c10::ScalarType> dtype,
    std::optional<c10::Layout> layout, std::optional<c10::Device> device,
    std::optional<bool> /*pin_memory*/, std::optional<c10::MemoryFormat> memory_format) {
  TORCH_CHECK(!layout.has_value() || *layout == c10::kStrided, "tpu supports strided tensors only");
  DeviceScope scope(index_of(device));
  return at::detail::empty_generic(
      size, &tpu_allocator(), kTpuKeys, c10::dtype_or_default(dtype), memory_format);
}

at::Tensor empty_strided(
    c10::IntArrayRef size, c10::IntArrayRef stride, std::optional<c10::ScalarType> dtype,
    std::optional<c10::Layout> layout, std::optional<c10::Device> device,
    std::optional<bool> /*pin_memory*/) {
  TORCH_CHECK(!layout.has_value() || *layout == c10::kStrided, "tpu supports strided tensors only");
  return empty_strided_on(index_of(device), size, stride, c10::dtype_or_default(dtype));
}

// ATen's checks of a geometry set on a storage (as_strided, set_): CPU's messages.
void check_geometry(c10::IntArrayRef stride, int64_t storage_offset) {
  TORCH_CHECK(storage_offset >= 0, "Tensor: invalid storage offset ", storage_offset);
  for (const int64_t s : stride) {
    TORCH_CHECK(s >= 0, "as_strided: Negative strides are not supported at the moment, got strides: ", stride);
  }
}

at::Tensor as_strided(const at::Tensor& self, c10::IntArrayRef size, c10::IntArrayRef stride,
                      std::optional<int64_t> storage_offset) {
  const int64_t offset = storage_offset.value_or(self.storage_offset());
  check_geometry(stride, offset);
  const auto needed = at::detail::computeStorageNbytes(size, stride, self.dtype().itemsize(), offset);
  TORCH_CHECK(
      needed <= self.storage().nbytes(), "as_strided: size ", size, ", stride ", stride,
      " and storage offset ", offset, " need ", needed, " bytes, but the storage has ",
      self.storage().nbytes());
  return alias_with(self, size, stride, offset);
}

at::Tensor view(const at::Tensor& self, c10::IntArrayRef size) {
  const auto shape = at::infer_size_dv(size, self.numel());
  const auto stride = at::detail::computeStride(self.sizes(), self.strides(), shape);
  TORCH_CHECK(
      stride.has_value(),
      "view size is not compatible with input tensor's size and stride (at least one dimension"
      " spans across two contiguous subspaces). Use .reshape(...) instead.");
  return alias_with(self, shape, *stride, self.storage_offset());
}

at::Tensor reshape_alias(const at::Tensor& self, c10::IntArrayRef size, c10::IntArrayRef stride) {
  return alias_with(self, size, stride, self.storage_offset());
}

const at::Tensor& resize_(const at::Tensor& self, c10::IntArrayRef size,
                          std::optional<c10::MemoryFormat> memory_format) {
  auto* impl = self.unsafeGetTensorImpl();
  // As on CPU: the same sizes keep the strides (a transposed tensor stays so).
  if (!self.sizes().equals(size)) {
    impl->set_sizes_contiguous(size);
    const auto nbytes = at::detail::computeStorageNbytesContiguous(
        size, self.dtype().itemsize(), self.storage_offset());
    grow_storage(self, nbytes);
  }
  if (memory_format.has_value()) {
    TORCH_CHECK(*memory_format != c10::MemoryFormat::Preserve, "Unsupported memory format Preserve");
    impl->empty_tensor_restride(*memory_format);
  }
  return self;
}

at::Tensor& set_storage(at::Tensor& self, c10::Storage source, int64_t offset,
                        c10::IntArrayRef size, c10::IntArrayRef stride) {
  TORCH_CHECK(source.device() == self.device(), "Attempted to set the storage of a tensor on device \"",
              self.device(), "\" to a storage on different device \"", source.device(),
              "\".  This is no longer allowed; the devices must match.");
  check_geometry(stride, offset);
  auto* impl = self.unsafeGetTensorImpl();
  if (self.storage().unsafeGetStorageImpl() != source.unsafeGetStorageImpl()) {
    impl->set_storage_keep_dtype(std::move(source));
  }
  impl->set_sizes_and_strides(size, stride, offset);
  return self;
}

at::Tensor& set_source_storage(at::Tensor& self, c10::Storage source) {
  const int64_t numel = static_cast<int64_t>(source.nbytes() / self.dtype().itemsize());
  return set_storage(self, std::move(source), 0, {numel}, {1});
}

at::Tensor& set_source_storage_offset(at::Tensor& self, c10::Storage source, c10::SymInt offset,
                                      c10::SymIntArrayRef size, c10::SymIntArrayRef stride) {
  set_storage(self, std::move(source), offset.expect_int(), C10_AS_INTARRAYREF_SLOW(size),
              C10_AS_INTARRAYREF_SLOW(stride));
  const auto nbytes = at::detail::computeStorageNbytes(
      self.sizes(), self.strides(), self.dtype().itemsize(), self.storage_offset());
  grow_storage(self, nbytes);
  return self;
}

at::Tensor& set_source_tensor(at::Tensor& self, const at::Tensor& source) {
  return set_storage(self, source.storage(), source.storage_offset(), source.sizes(),
                     source.strides());
}

at::Tensor& set_empty(at::Tensor& self) {
  c10::Storage empty(
      c10::Storage::use_byte_size_t(), 0, tpu_allocator().allocate_on(0, self.device().index()),
      &tpu_allocator(), /*resizable=*/true);
  return set_storage(self, std::move(empty), 0, {0}, {1});
}

// copy_ between devices lands here when either side is a tpu tensor.
at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool /*non_blocking*/) {
  const auto device = is_tpu(dst) ? dst.device().index() : self.device().index();
  // A copy to the cpu allocates nothing of its own; no redirect needed.
  HostScope scope(device, /*redirect=*/is_tpu(dst));
  scope.view(dst).copy_(scope.view(self));
  return dst;
}

at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  dst.resize_(self.sizes());
  return copy_from(self, dst, false);
}

// A ZeroTensor owns no memory: every element is zero by definition.
class NoMemoryAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t /*nbytes*/) override {
    return {nullptr, c10::Device(c10::DeviceType::PrivateUse1, current_device())};
  }
  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }
  void copy_data(void* /*dest*/, const void* /*src*/, std::size_t count) const override {
    TORCH_CHECK(count == 0, "a ZeroTensor has no memory to copy");
  }
};

at::Tensor efficient_zero_tensor(
    c10::IntArrayRef size, std::optional<c10::ScalarType> dtype, std::optional<c10::Layout> layout,
    std::optional<c10::Device> device, std::optional<bool> /*pin_memory*/) {
  static NoMemoryAllocator allocator;
  DeviceScope scope(index_of(device));
  return at::detail::empty_generic(
      size, &allocator, kTpuKeys | c10::DispatchKeySet(c10::DispatchKey::ZeroTensor),
      c10::dtype_or_default(dtype), std::nullopt);
}

c10::Scalar local_scalar_dense(const at::Tensor& self) {
  HostScope scope(self.device().index());
  return at::_local_scalar_dense(scope.view(self));
}

} // namespace

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", empty_memory_format);
  m.impl("empty_strided", empty_strided);
  m.impl("as_strided", as_strided);
  m.impl("view", view);
  m.impl("_reshape_alias", reshape_alias);
  m.impl("resize_", resize_);
  m.impl("set_.source_Storage", set_source_storage);
  m.impl("set_.source_Storage_storage_offset", set_source_storage_offset);
  m.impl("set_.source_Tensor", set_source_tensor);
  m.impl("set_", set_empty);
  m.impl("_copy_from", copy_from);
  m.impl("_copy_from_and_resize", copy_from_and_resize);
  m.impl("_local_scalar_dense", local_scalar_dense);
  m.impl("_efficientzerotensor", efficient_zero_tensor);
  // A tpu tensor's memory goes back to the allocator when its last reference goes, and work
  // queued on a stream holds references to its tensors: nothing to record (as the guard's
  // recordDataPtrOnStream). Else the fallback would send it to CPU, which has no kernel.
  m.impl("record_stream", [](at::Tensor&, c10::Stream) {});
}

// Our cross-device copy reads conjugate and negative views as they are (the
// CPU copy kernel resolves the bits), so those keys must not materialize its
// arguments first: materializing is a clone, which copies, which recurses.
TORCH_LIBRARY_IMPL(aten, Conjugate, m) {
  m.impl("_copy_from", torch::CppFunction::makeFallthrough());
  m.impl("_copy_from_and_resize", torch::CppFunction::makeFallthrough());
}

TORCH_LIBRARY_IMPL(aten, Negative, m) {
  m.impl("_copy_from", torch::CppFunction::makeFallthrough());
  m.impl("_copy_from_and_resize", torch::CppFunction::makeFallthrough());
}

} // namespace torch_tpu
