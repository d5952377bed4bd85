// torch.ops.torch_tpu.mxu_*: the matmul family at the MXU precision as ops on
// CPU tensors, for graphs compiled to run on host views (torch_tpu/inductor):
// Inductor calls them as extern kernels, so compiled matmuls give the eager
// tpu numbers at whatever precision is set when they run. The Meta kernels
// give shapes and strides to fake-tensor tracing: Inductor indexes an extern
// kernel's output by its Meta strides, so they must be the CPU kernel's.

#include "TpuMxu.h"

#include <ATen/ops/addmm.h>
#include <ATen/ops/baddbmm.h>
#include <ATen/ops/bmm.h>
#include <ATen/ops/convolution.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_strided.h>
#include <ATen/ops/mm.h>
#include <ATen/EmptyTensor.h>
#include <ATen/native/ConvUtils.h>
#include <c10/util/strides.h>
#include <torch/library.h>

#include <vector>

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

// A CPU tensor with the sizes, strides and dtype of a meta one and no memory (a null data
// pointer over as many bytes as they span, so views of it pass their bounds checks): ATen's
// choice of a convolution's backend and memory format reads nothing else.
at::Tensor cpu_geometry(const at::Tensor& t, bool contiguous) {
  const c10::DimVector strides = contiguous ? c10::contiguous_strides(t.sizes()) : c10::DimVector(t.strides());
  const size_t nbytes = at::detail::computeStorageNbytes(t.sizes(), strides, t.dtype().itemsize());
  c10::Storage storage(c10::Storage::use_byte_size_t(), nbytes, c10::DataPtr(nullptr, at::Device(at::kCPU)),
                       /*allocator=*/nullptr, /*resizable=*/false);
  at::Tensor cpu = at::detail::make_tensor<c10::TensorImpl>(
      std::move(storage), c10::DispatchKeySet(c10::DispatchKey::CPU), t.dtype());
  cpu.unsafeGetTensorImpl()->set_sizes_and_strides(t.sizes(), strides);
  return cpu;
}

bool has_symbolic_geometry(const at::Tensor& t) {
  return t.unsafeGetTensorImpl()->has_symbolic_sizes_strides();
}

// The memory format of the CPU convolution's outputs (the output, and in the backward
// grad_input and grad_weight), by ATen's own rule: the backend ATen picks for these operands
// on CPU (mkldnn, the slow kernels...) and the format that backend uses, channels_last when
// the input or the weight suggests it. ATen views a 1d convolution as 2d, its input made
// contiguous first: so here. Symbolic sizes (no CPU stand-ins): contiguous.
at::MemoryFormat cpu_convolution_format(const at::Tensor& input, const at::Tensor& weight,
                                        c10::IntArrayRef stride, c10::IntArrayRef padding,
                                        c10::IntArrayRef dilation, bool transposed,
                                        c10::IntArrayRef output_padding, int64_t groups) {
  if (has_symbolic_geometry(input) || has_symbolic_geometry(weight)) {
    return at::MemoryFormat::Contiguous;
  }
  const bool as_2d = weight.dim() == 3;
  // ATen makes a 1d input contiguous (a stand-in's contiguous() would read it): so here.
  const at::Tensor x = cpu_geometry(mxu::dense_operand(input), /*contiguous=*/as_2d);
  const at::Tensor w = cpu_geometry(mxu::dense_operand(weight), /*contiguous=*/false);
  // No bias: on CPU only its sizes are checked, which the meta function did.
  const auto backend = at::native::select_conv_backend(
      x, w, std::nullopt, c10::fromIntArrayRefSlow(stride), c10::fromIntArrayRefSlow(padding),
      c10::fromIntArrayRefSlow(dilation), transposed, c10::fromIntArrayRefSlow(output_padding), groups,
      std::nullopt);
  if (as_2d) {
    return at::native::_determine_backend_memory_format(x.unsqueeze(2), w.unsqueeze(2), backend);
  }
  return at::native::_determine_backend_memory_format(x, w, backend);
}

// An empty tensor of these sizes in `format`; a 3d one as ATen computes it, viewed as 2d
// (the format applied with a unit dimension at 2, then squeezed out): its strides, not a view.
at::Tensor empty_in_format(c10::SymIntArrayRef sizes, const at::TensorOptions& options, at::MemoryFormat format) {
  if (sizes.size() == 3 && format != at::MemoryFormat::Contiguous) {
    std::vector<c10::SymInt> as_2d(sizes.begin(), sizes.end());
    as_2d.insert(as_2d.begin() + 2, c10::SymInt(1));
    const at::Tensor view = at::empty_symint(as_2d, options, format).squeeze(2);
    return at::empty_strided_symint(view.sym_sizes(), view.sym_strides(), options);
  }
  return at::empty_symint(sizes, options, format);
}

at::Tensor meta_convolution(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                            c10::IntArrayRef stride, c10::IntArrayRef padding, c10::IntArrayRef dilation,
                            bool transposed, c10::IntArrayRef output_padding, int64_t groups) {
  // at::convolution's meta function gives the sizes and checks the arguments; its strides
  // are always contiguous (a meta tensor has no backend to pick a format by).
  const at::Tensor sized =
      at::convolution(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups);
  const auto format =
      cpu_convolution_format(input, weight, stride, padding, dilation, transposed, output_padding, groups);
  return empty_in_format(sized.sym_sizes(), sized.options(), format);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> meta_convolution_backward(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight,
    at::OptionalIntArrayRef /*bias_sizes*/, c10::IntArrayRef stride,
    c10::IntArrayRef padding, c10::IntArrayRef dilation, bool transposed, c10::IntArrayRef output_padding,
    int64_t groups, std::array<bool, 3> output_mask) {
  // ATen's CPU backward gives grad_input and grad_weight both in the forward's format.
  const auto format =
      cpu_convolution_format(input, weight, stride, padding, dilation, transposed, output_padding, groups);
  auto like = [&](const at::Tensor& t, bool wanted) {
    return wanted ? empty_in_format(t.sym_sizes(), t.options(), format) : at::Tensor();
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
  m.impl("mxu_convolution", meta_convolution);
  m.impl("mxu_convolution_backward", meta_convolution_backward);
}

} // namespace torch_tpu
