#pragma once
// The matmul-family kernels at the MXU precision (TpuPrecision.h), on CPU
// tensors. The tpu kernels (TpuMatmul.cpp) run them on host views; compiled
// graphs call them as torch.ops.torch_tpu.mxu_* (TpuMxuOps.cpp), so a matmul
// gives the same numbers eager or compiled.

#include <ATen/core/Tensor.h>

#include <array>
#include <optional>
#include <tuple>

namespace torch_tpu::mxu {

at::Tensor mm(const at::Tensor& a, const at::Tensor& b);
at::Tensor bmm(const at::Tensor& a, const at::Tensor& b);
at::Tensor addmm(const at::Tensor& bias, const at::Tensor& a, const at::Tensor& b, const c10::Scalar& beta,
                 const c10::Scalar& alpha);
at::Tensor baddbmm(const at::Tensor& bias, const at::Tensor& a, const at::Tensor& b, const c10::Scalar& beta,
                   const c10::Scalar& alpha);
// A convolution operand as the kernels read it and their Meta kernels lay the outputs out by:
// one that is not dense (a slice) copied dense in the layout its strides suggest. Medium and
// high precision round an operand to bf16 through a copy, which made a channels_last slice
// contiguous, and the output with it, where ATen's rule (the operands' suggested format) says
// channels_last. Not a copy more: ATen's CPU kernels, and the rounding, copy a non-dense
// operand anyway.
at::Tensor dense_operand(const at::Tensor& t);
at::Tensor convolution(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                       c10::IntArrayRef stride, c10::IntArrayRef padding, c10::IntArrayRef dilation,
                       bool transposed, c10::IntArrayRef output_padding, int64_t groups);
std::tuple<at::Tensor, at::Tensor, at::Tensor> convolution_backward(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight, c10::IntArrayRef stride,
    c10::IntArrayRef padding, c10::IntArrayRef dilation, bool transposed, c10::IntArrayRef output_padding,
    int64_t groups, std::array<bool, 3> output_mask);

} // namespace torch_tpu::mxu
