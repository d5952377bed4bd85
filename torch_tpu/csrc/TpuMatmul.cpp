// Matmul-family kernels: the CPU kernels on zero-copy views, with the
// operands the MXU would see at the current precision (TpuPrecision.h).

#include "TpuBf16Gemm.h"
#include "TpuFp32Gemm.h"
#include "TpuHost.h"
#include "TpuMxu.h"
#include "TpuOnednn.h"
#include "TpuPrecision.h"
#include "TpuSmallBmm.h"

#include <ATen/ops/addmm.h>
#include <ATen/ops/addbmm.h>
#include <ATen/ops/addmv.h>
#include <ATen/ops/baddbmm.h>
#include <ATen/ops/bmm.h>
#include <ATen/ops/convolution.h>
#include <ATen/ops/convolution_backward.h>
#include <ATen/ops/dot.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/relu.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/mv.h>
#include <ATen/ops/sum.h>
#include <torch/library.h>

#include <vector>

namespace torch_tpu {
namespace {

// The bf16 GEMM paths, when the shapes allow them: medium's single pass, and
// high's three on AMX tiles (elsewhere high runs them as fp32 GEMMs, on_mxu).
at::Tensor bf16_passes_gemm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& bias,
                            const c10::Scalar& beta, const c10::Scalar& alpha) {
  // A bias of another dtype goes on to the fp32 engine, which refuses it as ATen does; a
  // product scaled by zero, to on_mxu_scaled.
  if ((bias.defined() && bias.scalar_type() != a.scalar_type()) || is_zero(alpha)) {
    return {};
  }
  switch (effective_precision(a, b)) {
    case Precision::kMedium:
      return bf16_gemm(a, b, bias, beta.toFloat(), alpha.toFloat());
    case Precision::kHigh:
      return bf16x3_gemm(a, b, bias, beta.toFloat(), alpha.toFloat());
    case Precision::kHighest:
      return {};
  }
  return {};
}

// ATen's fp32 matmul kept exact: the user's CPU setting (for one,
// torch.set_float32_matmul_precision("medium")) would let ATen send it to
// oneDNN's bf16 mode, which is not the tpu's precision.
template <class F>
at::Tensor exact_aten(F f) {
  if (!onednn_math_is_inexact()) {
    return f();
  }
  OnednnMathMode exact(at::Float32Precision::IEEE);
  return f();
}

// An fp32 GEMM pass: oneDNN where it is the host's faster engine, else ATen's.
at::Tensor fp32_mm(const at::Tensor& a, const at::Tensor& b) {
  if (auto fast = fp32_gemm(a, b, {}, 0, 1); fast.defined()) {
    return fast;
  }
  return exact_aten([&] { return at::mm(a, b); });
}

at::Tensor fp32_addmm(const at::Tensor& bias, const at::Tensor& a, const at::Tensor& b, const c10::Scalar& beta,
                      const c10::Scalar& alpha) {
  if (bias.is_floating_point()) {
    if (auto fast = fp32_gemm(a, b, bias, beta.toFloat(), alpha.toFloat()); fast.defined()) {
      return fast;
    }
  }
  return exact_aten([&] { return at::addmm(bias, a, b, beta, alpha); });
}

} // namespace

namespace mxu {

at::Tensor mm(const at::Tensor& a, const at::Tensor& b) {
  if (auto fast = bf16_passes_gemm(a, b, {}, 0, 1); fast.defined()) {
    return fast;
  }
  return on_mxu(a, b, [](const at::Tensor& x, const at::Tensor& y, bool) { return fp32_mm(x, y); });
}

at::Tensor bmm(const at::Tensor& a, const at::Tensor& b) {
  const Precision precision = effective_precision(a, b);
  if (precision == Precision::kMedium) {
    if (auto fast = bf16_bmm(a, b); fast.defined()) {
      return fast;
    }
  }
  if (precision != Precision::kHigh) {
    if (auto small = small_bmm(a, b, precision == Precision::kMedium); small.defined()) {
      return small;
    }
  }
  return on_mxu(a, b, [](const at::Tensor& a, const at::Tensor& b, bool) {
    return exact_aten([&] { return at::bmm(a, b); });
  });
}

at::Tensor addmm(const at::Tensor& bias, const at::Tensor& a, const at::Tensor& b, const c10::Scalar& beta,
                 const c10::Scalar& alpha) {
  if (auto fast = bf16_passes_gemm(a, b, bias, beta, alpha); fast.defined()) {
    return fast;
  }
  return on_mxu_scaled(a, b, alpha, [&](const at::Tensor& a, const at::Tensor& b, bool rest) {
    return rest ? fp32_addmm(bias, a, b, beta, alpha) : fp32_mm(a, b).mul_(alpha);
  });
}

at::Tensor baddbmm(const at::Tensor& bias, const at::Tensor& a, const at::Tensor& b, const c10::Scalar& beta,
                   const c10::Scalar& alpha) {
  return on_mxu_scaled(a, b, alpha, [&](const at::Tensor& a, const at::Tensor& b, bool rest) {
    return exact_aten([&] { return rest ? at::baddbmm(bias, a, b, beta, alpha) : at::bmm(a, b).mul_(alpha); });
  });
}

at::Tensor dense_operand(const at::Tensor& t) {
  return t.is_non_overlapping_and_dense() ? t : t.contiguous(t.suggest_memory_format());
}

at::Tensor convolution(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                       c10::IntArrayRef stride, c10::IntArrayRef padding, c10::IntArrayRef dilation,
                       bool transposed, c10::IntArrayRef output_padding, int64_t groups) {
  return on_mxu(dense_operand(input), dense_operand(weight), [&](const at::Tensor& x, const at::Tensor& w, bool rest) {
    return at::convolution(x, w, rest ? bias : std::nullopt, stride, padding, dilation, transposed,
                           output_padding, groups);
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> convolution_backward(
    const at::Tensor& go, const at::Tensor& input, const at::Tensor& weight, c10::IntArrayRef stride,
    c10::IntArrayRef padding, c10::IntArrayRef dilation, bool transposed, c10::IntArrayRef output_padding,
    int64_t groups, std::array<bool, 3> output_mask) {
  const at::Tensor x = dense_operand(input), w = dense_operand(weight);
  // grad_input is bilinear in (grad_output, weight), grad_weight in
  // (grad_output, input): one pass per (grad_output, {input, weight}) pair.
  const std::array<bool, 3> mask{output_mask[0], output_mask[1], false};
  auto pass = [&](const at::Tensor& g, const at::Tensor& xi, const at::Tensor& wi) {
    return at::convolution_backward(g, xi, wi, std::nullopt, stride, padding, dilation, transposed,
                                    output_padding, groups, mask);
  };
  auto accumulate = [&](std::tuple<at::Tensor, at::Tensor, at::Tensor>& acc,
                        const std::tuple<at::Tensor, at::Tensor, at::Tensor>& more) {
    if (std::get<0>(acc).defined()) std::get<0>(acc).add_(std::get<0>(more));
    if (std::get<1>(acc).defined()) std::get<1>(acc).add_(std::get<1>(more));
  };
  std::tuple<at::Tensor, at::Tensor, at::Tensor> result;
  switch (effective_precision(go, w)) {
    case Precision::kHighest:
      result = pass(go, x, w);
      break;
    case Precision::kMedium:
      result = pass(round_to_bf16(go), round_to_bf16(x), round_to_bf16(w));
      break;
    case Precision::kHigh: {
      const auto [go_hi, go_lo] = split_bf16(go);
      const auto [x_hi, x_lo] = split_bf16(x);
      const auto [w_hi, w_lo] = split_bf16(w);
      result = pass(go_hi, x_hi, w_hi);
      accumulate(result, pass(go_hi, x_lo, w_lo));
      accumulate(result, pass(go_lo, x_hi, w_hi));
      break;
    }
  }
  if (output_mask[2]) {
    // Not an MXU op: the exact sum over everything but channels.
    std::vector<int64_t> dims{0};
    for (int64_t d = 2; d < go.dim(); ++d) dims.push_back(d);
    std::get<2>(result) = at::sum(go, dims);
  }
  return result;
}

} // namespace mxu

namespace {

// out= variants: compute, then resize and fill `out` in place.
at::Tensor& into(at::Tensor& out, const at::Tensor& result) {
  TORCH_CHECK(
      out.scalar_type() == result.scalar_type(), "Expected out tensor to have dtype ",
      result.scalar_type(), ", but got ", out.scalar_type(), " instead");
  common_device("out=", {out, result});
  out.resize_(result.sizes());
  out.copy_(result);
  return out;
}

at::Tensor tpu_mm(const at::Tensor& self, const at::Tensor& mat2) {
  return on_host("mm", {self, mat2}, [&](HostScope& s) {
    return mxu::mm(s.view(self), s.view(mat2));
  });
}

at::Tensor tpu_bmm(const at::Tensor& self, const at::Tensor& mat2) {
  return on_host("bmm", {self, mat2}, [&](HostScope& s) {
    return mxu::bmm(s.view(self), s.view(mat2));
  });
}

at::Tensor tpu_mv(const at::Tensor& self, const at::Tensor& vec) {
  return on_host("mv", {self, vec}, [&](HostScope& s) {
    return on_mxu(s.view(self), s.view(vec),
                  [](const at::Tensor& a, const at::Tensor& b, bool) {
                    return exact_aten([&] { return at::mv(a, b); });
                  });
  });
}

at::Tensor tpu_dot(const at::Tensor& self, const at::Tensor& other) {
  return on_host("dot", {self, other}, [&](HostScope& s) {
    return on_mxu(s.view(self), s.view(other),
                  [](const at::Tensor& a, const at::Tensor& b, bool) {
                    return exact_aten([&] { return at::dot(a, b); });
                  });
  });
}

at::Tensor tpu_addmm(const at::Tensor& self, const at::Tensor& mat1, const at::Tensor& mat2,
                 const c10::Scalar& beta, const c10::Scalar& alpha) {
  return on_host("addmm", {self, mat1, mat2}, [&](HostScope& s) {
    return mxu::addmm(s.view(self), s.view(mat1), s.view(mat2), beta, alpha);
  });
}

at::Tensor tpu_baddbmm(const at::Tensor& self, const at::Tensor& batch1, const at::Tensor& batch2,
                   const c10::Scalar& beta, const c10::Scalar& alpha) {
  return on_host("baddbmm", {self, batch1, batch2}, [&](HostScope& s) {
    return mxu::baddbmm(s.view(self), s.view(batch1), s.view(batch2), beta, alpha);
  });
}

at::Tensor tpu_addmv(const at::Tensor& self, const at::Tensor& mat, const at::Tensor& vec,
                 const c10::Scalar& beta, const c10::Scalar& alpha) {
  return on_host("addmv", {self, mat, vec}, [&](HostScope& s) {
    const auto bias = s.view(self);
    return on_mxu_scaled(s.view(mat), s.view(vec), alpha, [&](const at::Tensor& a, const at::Tensor& b, bool rest) {
      return rest ? at::addmv(bias, a, b, beta, alpha) : at::mv(a, b).mul_(alpha);
    });
  });
}

at::Tensor tpu_addbmm(const at::Tensor& self, const at::Tensor& batch1, const at::Tensor& batch2,
                      const c10::Scalar& beta, const c10::Scalar& alpha) {
  return on_host("addbmm", {self, batch1, batch2}, [&](HostScope& s) {
    const auto bias = s.view(self);
    return on_mxu_scaled(s.view(batch1), s.view(batch2), alpha, [&](const at::Tensor& a, const at::Tensor& b, bool rest) {
      return rest ? at::addbmm(bias, a, b, beta, alpha) : at::bmm(a, b).sum(0).mul_(alpha);
    });
  });
}

// In-place forms: the same MXU numbers, written into self.
at::Tensor& into_self(at::Tensor& self, const at::Tensor& result) {
  return self.copy_(result);
}
at::Tensor& tpu_addmm_(at::Tensor& self, const at::Tensor& mat1, const at::Tensor& mat2,
                       const c10::Scalar& beta, const c10::Scalar& alpha) {
  return into_self(self, tpu_addmm(self, mat1, mat2, beta, alpha));
}
at::Tensor& tpu_baddbmm_(at::Tensor& self, const at::Tensor& b1, const at::Tensor& b2,
                         const c10::Scalar& beta, const c10::Scalar& alpha) {
  return into_self(self, tpu_baddbmm(self, b1, b2, beta, alpha));
}
at::Tensor& tpu_addmv_(at::Tensor& self, const at::Tensor& mat, const at::Tensor& vec,
                       const c10::Scalar& beta, const c10::Scalar& alpha) {
  return into_self(self, tpu_addmv(self, mat, vec, beta, alpha));
}
at::Tensor& tpu_addbmm_(at::Tensor& self, const at::Tensor& b1, const at::Tensor& b2,
                        const c10::Scalar& beta, const c10::Scalar& alpha) {
  return into_self(self, tpu_addbmm(self, b1, b2, beta, alpha));
}

// linear + activation fusion some paths take (e.g. TransformerEncoderLayer).
at::Tensor tpu_addmm_activation(const at::Tensor& self, const at::Tensor& mat1,
                                const at::Tensor& mat2, const c10::Scalar& beta,
                                const c10::Scalar& alpha, bool use_gelu) {
  auto out = tpu_addmm(self, mat1, mat2, beta, alpha);
  return use_gelu ? at::gelu_(out) : at::relu_(out);  // the exact GELU, as ATen's CPU kernel (CUDA's is tanh)
}

at::Tensor& tpu_mm_out(const at::Tensor& self, const at::Tensor& mat2, at::Tensor& out) {
  return into(out, tpu_mm(self, mat2));
}
at::Tensor& tpu_bmm_out(const at::Tensor& self, const at::Tensor& mat2, at::Tensor& out) {
  return into(out, tpu_bmm(self, mat2));
}
at::Tensor& tpu_addmm_out(const at::Tensor& self, const at::Tensor& mat1, const at::Tensor& mat2,
                      const c10::Scalar& beta, const c10::Scalar& alpha, at::Tensor& out) {
  return into(out, tpu_addmm(self, mat1, mat2, beta, alpha));
}
at::Tensor& tpu_baddbmm_out(const at::Tensor& self, const at::Tensor& b1, const at::Tensor& b2,
                        const c10::Scalar& beta, const c10::Scalar& alpha, at::Tensor& out) {
  return into(out, tpu_baddbmm(self, b1, b2, beta, alpha));
}

// at::convolution on a non-CPU/CUDA device routes here.
at::Tensor convolution(const at::Tensor& input, const at::Tensor& weight,
                       const std::optional<at::Tensor>& bias, c10::IntArrayRef stride,
                       c10::IntArrayRef padding, c10::IntArrayRef dilation, bool transposed,
                       c10::IntArrayRef output_padding, int64_t groups) {
  return on_host("convolution", {input, weight, bias.value_or(at::Tensor())}, [&](HostScope& s) {
    std::optional<at::Tensor> b;
    if (bias.has_value() && bias->defined()) {
      b = s.view(*bias);
    }
    return mxu::convolution(s.view(input), s.view(weight), b, stride, padding, dilation, transposed,
                            output_padding, groups);
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> convolution_backward(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight,
    c10::IntArrayRef stride, c10::IntArrayRef padding, c10::IntArrayRef dilation, bool transposed,
    c10::IntArrayRef output_padding, int64_t groups, std::array<bool, 3> output_mask) {
  HostScope scope(common_device("convolution_backward", {grad_output, input, weight}));
  auto result = mxu::convolution_backward(scope.view(grad_output), scope.view(input), scope.view(weight), stride,
                                          padding, dilation, transposed, output_padding, groups, output_mask);
  scope.write_back();
  return {scope.adopt(std::get<0>(result)), scope.adopt(std::get<1>(result)), scope.adopt(std::get<2>(result))};
}

// torch.ops.torch_tpu.mxu_convolution_backward's schema (bias_sizes unused).
std::tuple<at::Tensor, at::Tensor, at::Tensor> mxu_convolution_backward(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight,
    at::OptionalIntArrayRef /*bias_sizes*/, c10::IntArrayRef stride, c10::IntArrayRef padding,
    c10::IntArrayRef dilation, bool transposed, c10::IntArrayRef output_padding, int64_t groups,
    std::array<bool, 3> output_mask) {
  return convolution_backward(grad_output, input, weight, stride, padding, dilation, transposed, output_padding,
                              groups, output_mask);
}

} // namespace

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("mm", tpu_mm);
  m.impl("mm.out", tpu_mm_out);
  m.impl("bmm", tpu_bmm);
  m.impl("bmm.out", tpu_bmm_out);
  m.impl("mv", tpu_mv);
  m.impl("dot", tpu_dot);
  m.impl("addmm", tpu_addmm);
  m.impl("addmm.out", tpu_addmm_out);
  m.impl("baddbmm", tpu_baddbmm);
  m.impl("baddbmm.out", tpu_baddbmm_out);
  m.impl("addmv", tpu_addmv);
  m.impl("addbmm", tpu_addbmm);
  m.impl("addmm_", tpu_addmm_);
  m.impl("baddbmm_", tpu_baddbmm_);
  m.impl("addmv_", tpu_addmv_);
  m.impl("addbmm_", tpu_addbmm_);
  m.impl("_addmm_activation", tpu_addmm_activation);
  m.impl("convolution_overrideable", convolution);
  m.impl("convolution_backward_overrideable", convolution_backward);
}

// torch.ops.torch_tpu.mxu_* on tpu tensors: compiled graphs that run directly
// on tpu tensors (TpuDirectRun.cpp) call them as the tpu kernels above.
TORCH_LIBRARY_IMPL(torch_tpu, PrivateUse1, m) {
  m.impl("mxu_mm", tpu_mm);
  m.impl("mxu_bmm", tpu_bmm);
  m.impl("mxu_addmm", tpu_addmm);
  m.impl("mxu_baddbmm", tpu_baddbmm);
  m.impl("mxu_convolution", convolution);
  m.impl("mxu_convolution_backward", mxu_convolution_backward);
}

} // namespace torch_tpu
