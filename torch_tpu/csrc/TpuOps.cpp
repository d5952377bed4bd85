// torch.ops.torch_tpu.*: the few entry points the Python layer needs.

#include "TpuDevice.h"
#include "TpuFallback.h"
#include "TpuGenerator.h"
#include "TpuHost.h"
#include "TpuPrecision.h"
#include "TpuStream.h"

#include <ATen/ops/_batch_norm_no_update.h>
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

// Compiled CPU graphs run on tpu tensors (torch_tpu/compiler): their inputs
// as host views, their allocations redirected to tpu memory, their results
// adopted back as tpu tensors - nothing is copied on the way in or out.
std::vector<at::Tensor> host_views_op(const std::vector<at::Tensor>& tensors) {
  std::vector<at::Tensor> views;
  views.reserve(tensors.size());
  c10::DeviceIndex waited = -1;
  for (const at::Tensor& t : tensors) {
    if (!is_tpu(t)) {
      views.push_back(t);
      continue;
    }
    if (t.device().index() != waited) {
      waited = t.device().index();
      wait_current_stream(waited);  // as every tpu op: queued work comes first
    }
    views.push_back(owning_host_view(t));
  }
  return views;
}

int64_t redirect_host_allocations_op(int64_t device) {
  TORCH_CHECK(device >= -1 && device < device_count(), "redirect to tpu:", device, ": no such device");
  return exchange_host_redirect(static_cast<c10::DeviceIndex>(device));
}

std::vector<at::Tensor> adopt_host_results_op(const std::vector<at::Tensor>& results, int64_t device) {
  HostScope scope(static_cast<c10::DeviceIndex>(device), /*redirect=*/false);
  std::vector<at::Tensor> adopted;
  adopted.reserve(results.size());
  for (const at::Tensor& r : results) {
    adopted.push_back(scope.adopt(r));
  }
  return adopted;
}

std::optional<at::Tensor> host_view(HostScope& scope, const std::optional<at::Tensor>& t) {
  return t.has_value() && t->defined() ? std::optional<at::Tensor>(scope.view(*t)) : std::nullopt;
}

at::Tensor or_undefined(const std::optional<at::Tensor>& t) {
  return t.value_or(at::Tensor());
}

// aten::_batch_norm_no_update (batch norm with nothing to update: eval mode, or the graphs
// AOTAutograd traces) has only a composite kernel, which calls ATen's CPU batch norm
// directly, not through the dispatcher: on tpu tensors it raised. Run on host views, so it
// gives the CPU kernel's results.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> batch_norm_no_update(
    const at::Tensor& input, const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    const std::optional<at::Tensor>& running_mean, const std::optional<at::Tensor>& running_var,
    double momentum, double eps) {
  HostScope scope(common_device("_batch_norm_no_update", {input, or_undefined(weight), or_undefined(bias),
                                                          or_undefined(running_mean), or_undefined(running_var)}));
  auto [output, mean, invstd, reserve] = at::_batch_norm_no_update(
      scope.view(input), host_view(scope, weight), host_view(scope, bias), host_view(scope, running_mean),
      host_view(scope, running_var), momentum, eps);
  scope.write_back();
  return {scope.adopt(output), scope.adopt(mean), scope.adopt(invstd), scope.adopt(reserve)};
}

} // namespace

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("_batch_norm_no_update", batch_norm_no_update);
}

TORCH_LIBRARY(torch_tpu, m) {
  m.def("_configure(int num_devices, int hbm_bytes) -> ()", configure_op);
  m.def("_set_matmul_precision(int mode) -> ()", set_precision_op);
  m.def("_get_matmul_precision() -> int", get_precision_op);
  m.def("_hbm_capacity() -> int", hbm_capacity_op);
  m.def("_default_generator(int device) -> Generator?", default_generator_op);
  m.def("_host_views(Tensor[] tensors) -> Tensor[]", host_views_op);
  m.def("_redirect_host_allocations(int device) -> int", redirect_host_allocations_op);
  m.def("_adopt_host_results(Tensor[] results, int device) -> Tensor[]", adopt_host_results_op);
}

} // namespace torch_tpu
