// torch.ops.torch_tpu.mxu_*: the matmul family at the MXU precision as ops on
// CPU tensors, for graphs compiled to run on host views (torch_tpu/inductor):
// Inductor calls them as extern kernels, so compiled matmuls give the eager
// tpu numbers at whatever precision is set when they run. The Meta kernels
// give shapes to fake-tensor tracing.

#include "TpuMxu.h"

#include <ATen/ops/addmm.h>
#include <ATen/ops/baddbmm.h>
#include <ATen/ops/bmm.h>
#include <ATen/ops/convolution.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/mm.h>
#include <torch/library.h>

namespace torch_tpu {
namespace {

// aten's schema, bias_sizes included (the grad_bias shape follows grad_output).
std::tuple<at::Tensor, at::Tensor, at::Tensor> cpu_convolution_backward(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight,
    at::OptionalIntArrayRef /*bias_sizes*/, c10::IntArrayRef stride, c10::IntArrayRef padding,
    c10::IntArrayRef dilation, bool transposed, c10::IntArrayRef output_padding, int64_t groups,
    std::array<bool, 3> output_mask) {
  return mxu::convolution_backward(grad_output, input, weight, stride, padding, dilation, transposed,
                                   output_padding, groups, output_mask);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> meta_convolution_backward(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight,
    at::OptionalIntArrayRef /*bias_sizes*/, c10::IntArrayRef stride,
    c10::IntArrayRef padding, c10::IntArrayRef dilation, bool transposed, c10::IntArrayRef output_padding,
    int64_t groups, std::array<bool, 3> output_mask) {
  auto like = [](const at::Tensor& t, bool wanted) {
    return wanted ? at::empty_like(t, t.suggest_memory_format()) : at::Tensor();
  };
  const auto channels = grad_output.size(1);
  return {like(input, output_mask[0]), like(weight, output_mask[1]),
          output_mask[2] ? at::empty({channels}, grad_output.options()) : at::Tensor()};
}

} // namespace

TORCH_LIBRARY_FRAGMENT(torch_tpu, m) {
  m.def("mxu_mm(Tensor self, Tensor mat2) -> Tensor");
  m.def("mxu_bmm(Tensor self, Tensor mat2) -> Tensor");
  m.def("mxu_addmm(Tensor self, Tensor mat1, Tensor mat2, *, Scalar beta=1, Scalar alpha=1) -> Tensor");
  m.def("mxu_baddbmm(Tensor self, Tensor batch1, Tensor batch2, *, Scalar beta=1, Scalar alpha=1) -> Tensor");
  m.def(
      "mxu_convolution(Tensor input, Tensor weight, Tensor? bias, int[] stride, int[] padding, int[] dilation, "
      "bool transposed, int[] output_padding, int groups) -> Tensor");
  m.def(
      "mxu_convolution_backward(Tensor grad_output, Tensor input, Tensor weight, int[]? bias_sizes, "
      "int[] stride, int[] padding, "
      "int[] dilation, bool transposed, int[] output_padding, int groups, bool[3] output_mask) "
      "-> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(torch_tpu, CPU, m) {
  m.impl("mxu_mm", mxu::mm);
  m.impl("mxu_bmm", mxu::bmm);
  m.impl("mxu_addmm", mxu::addmm);
  m.impl("mxu_baddbmm", mxu::baddbmm);
  m.impl("mxu_convolution", mxu::convolution);
  m.impl("mxu_convolution_backward", cpu_convolution_backward);
}

TORCH_LIBRARY_IMPL(torch_tpu, Meta, m) {
  m.impl("mxu_mm", [](const at::Tensor& a, const at::Tensor& b) { return at::mm(a, b); });
  m.impl("mxu_bmm", [](const at::Tensor& a, const at::Tensor& b) { return at::bmm(a, b); });
  m.impl("mxu_addmm", [](const at::Tensor& bias, const at::Tensor& a, const at::Tensor& b, const c10::Scalar& beta,
                         const c10::Scalar& alpha) { return at::addmm(bias, a, b, beta, alpha); });
  m.impl("mxu_baddbmm", [](const at::Tensor& bias, const at::Tensor& a, const at::Tensor& b,
                           const c10::Scalar& beta, const c10::Scalar& alpha) {
    return at::baddbmm(bias, a, b, beta, alpha);
  });
  m.impl("mxu_convolution", [](const at::Tensor& input, const at::Tensor& weight,
                               const std::optional<at::Tensor>& bias, c10::IntArrayRef stride,
                               c10::IntArrayRef padding, c10::IntArrayRef dilation, bool transposed,
                               c10::IntArrayRef output_padding, int64_t groups) {
    return at::convolution(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups);
  });
  m.impl("mxu_convolution_backward", meta_convolution_backward);
}

} // namespace torch_tpu
