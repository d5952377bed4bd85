#include "TpuGenerator.h"

#include "TpuDevice.h"

#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/DispatchKeySet.h>

#include <mutex>
#include <vector>

namespace torch_tpu {

TpuGeneratorImpl::TpuGeneratorImpl(c10::DeviceIndex device, uint64_t seed)
    : TpuGeneratorImpl(device, at::detail::createCPUGenerator(seed)) {}

TpuGeneratorImpl::TpuGeneratorImpl(c10::DeviceIndex device, at::Generator inner)
    : c10::GeneratorImpl(
          c10::Device(c10::DeviceType::PrivateUse1, device),
          c10::DispatchKeySet(c10::DispatchKey::PrivateUse1)),
      inner_(std::move(inner)) {}

void TpuGeneratorImpl::set_current_seed(uint64_t seed) { inner_.set_current_seed(seed); }
// The CPU generator underneath says "CPU Generator does not use offset": name the tpu's own.
constexpr const char* kNoOffset =
    "tpu generators draw from an mt19937 stream, as CPU ones do: they have no Philox offset; save and restore "
    "them with get_state() / set_state()";
void TpuGeneratorImpl::set_offset(uint64_t /*offset*/) { TORCH_CHECK(false, kNoOffset); }
uint64_t TpuGeneratorImpl::get_offset() const { TORCH_CHECK(false, kNoOffset); }
uint64_t TpuGeneratorImpl::current_seed() const { return inner_.current_seed(); }
uint64_t TpuGeneratorImpl::seed() { return inner_.seed(); }

void TpuGeneratorImpl::set_state(const c10::TensorImpl& new_state) {
  inner_.unsafeGetGeneratorImpl()->set_state(new_state);
}

c10::intrusive_ptr<c10::TensorImpl> TpuGeneratorImpl::get_state() const {
  return inner_.unsafeGetGeneratorImpl()->get_state();
}

TpuGeneratorImpl* TpuGeneratorImpl::clone_impl() const {
  return new TpuGeneratorImpl(device().index(), inner_.clone());
}

const at::Generator& default_generator(c10::DeviceIndex device) {
  static std::once_flag once;
  static std::vector<at::Generator>* generators = nullptr;
  std::call_once(once, [] {
    generators = new std::vector<at::Generator>();
    for (c10::DeviceIndex i = 0; i < device_count(); ++i) {
      generators->push_back(
          at::make_generator<TpuGeneratorImpl>(i, c10::default_rng_seed_val));
    }
  });
  device = resolve(device);
  check_device_index(device);
  return (*generators)[device];
}

at::Generator new_generator(c10::DeviceIndex device) {
  device = resolve(device);
  check_device_index(device);
  return at::make_generator<TpuGeneratorImpl>(device, c10::default_rng_seed_val);
}

at::Generator host_generator(const std::optional<at::Generator>& gen, c10::DeviceIndex device) {
  if (!gen.has_value() || !gen->defined()) {
    return at::check_generator<TpuGeneratorImpl>(default_generator(device))->inner();
  }
  TORCH_CHECK(gen->device().type() == c10::DeviceType::PrivateUse1,
              "Expected a 'tpu' device type for generator but found '", gen->device().type(), "'");
  return at::check_generator<TpuGeneratorImpl>(*gen)->inner();
}

} // namespace torch_tpu
