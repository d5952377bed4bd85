// Random ops whose schema has no generator argument: the CPU kernel would
// draw from the CPU default generator, so route them to the tpu generator.

#include "TpuGenerator.h"
#include "TpuHost.h"

#include <ATen/ops/bernoulli.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/ones_like.h>
#include <torch/library.h>

namespace torch_tpu {
namespace {

std::tuple<at::Tensor, at::Tensor> native_dropout(
    const at::Tensor& input, double p, std::optional<bool> train) {
  if (input.numel() == 0) {
    return {input, at::empty_like(input)};  // as ATen's CPU kernel: the input itself, a mask of its dtype
  }
  HostScope scope(input.device().index());
  const auto x = scope.view(input);
  at::Tensor out, mask;
  if (!train.value_or(true) || p == 0) {
    out = x.clone();
    mask = at::ones_like(x, x.options().dtype(at::kBool));
  } else {
    const auto gen = host_generator(std::nullopt, scope.device());
    const double keep = 1 - p;
    mask = at::empty_like(x, x.options().dtype(at::kBool)).bernoulli_(keep, gen);
    // p = 1 scales by 0, as ATen's CPU kernel: an inf or NaN input gives NaN, not 0.
    out = at::mul(at::mul(x, mask), keep == 0 ? 0.0 : 1.0 / keep);
  }
  scope.write_back();
  return {scope.adopt(out), scope.adopt(mask)};
}

} // namespace

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("native_dropout", native_dropout);
}

} // namespace torch_tpu
