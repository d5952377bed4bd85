// torch.ops.torch_tpu.*: the few entry points the Python layer needs.

#include "TpuDevice.h"
#include "TpuFallback.h"
#include "TpuGenerator.h"
#include "TpuPrecision.h"
#include "TpuStream.h"

#include <torch/library.h>

namespace torch_tpu {
namespace {

void configure_op(int64_t num_devices, int64_t hbm_bytes) {
  configure(num_devices, hbm_bytes);
  route_composites_to_cpu();
}

void set_precision_op(int64_t mode) {
  TORCH_CHECK(mode >= 0 && mode <= 2, "precision mode must be 0 (highest), 1 (high) or 2 (medium)");
  set_matmul_precision(static_cast<Precision>(mode));
}

int64_t get_precision_op() {
  return static_cast<int64_t>(matmul_precision());
}

int64_t hbm_capacity_op() {
  return hbm_capacity();
}

std::optional<at::Generator> default_generator_op(int64_t device) {
  return default_generator(static_cast<c10::DeviceIndex>(device));
}

} // namespace

TORCH_LIBRARY(torch_tpu, m) {
  m.def("_configure(int num_devices, int hbm_bytes) -> ()", configure_op);
  m.def("_set_matmul_precision(int mode) -> ()", set_precision_op);
  m.def("_get_matmul_precision() -> int", get_precision_op);
  m.def("_hbm_capacity() -> int", hbm_capacity_op);
  m.def("_default_generator(int device) -> Generator?", default_generator_op);
}

} // namespace torch_tpu
