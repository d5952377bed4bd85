#pragma once
// tpu random number generator. It wraps a CPU (mt19937) generator: CPU kernels
// run the random ops, and the fallback hands them this inner generator, so tpu
// randomness is reproducible under torch.tpu.manual_seed and independent of
// the CPU's default generator.

#include <ATen/core/Generator.h>
#include <c10/core/GeneratorImpl.h>

namespace torch_tpu {

class TpuGeneratorImpl final : public c10::GeneratorImpl {
 public:
  explicit TpuGeneratorImpl(c10::DeviceIndex device, uint64_t seed);
  TpuGeneratorImpl(c10::DeviceIndex device, at::Generator inner);

  void set_current_seed(uint64_t seed) override;
  void set_offset(uint64_t offset) override;
  uint64_t get_offset() const override;
  uint64_t current_seed() const override;
  uint64_t seed() override;
  void set_state(const c10::TensorImpl& new_state) override;
  c10::intrusive_ptr<c10::TensorImpl> get_state() const override;

  const at::Generator& inner() const { return inner_; }
  static c10::DeviceType device_type() { return c10::DeviceType::PrivateUse1; }

 private:
  TpuGeneratorImpl* clone_impl() const override;
  at::Generator inner_;
};

const at::Generator& default_generator(c10::DeviceIndex device);
at::Generator new_generator(c10::DeviceIndex device);

// The CPU generator a CPU kernel should draw from for this tpu generator
// (or for the device's default generator when gen is undefined).
at::Generator host_generator(const std::optional<at::Generator>& gen, c10::DeviceIndex device);

} // namespace torch_tpu
