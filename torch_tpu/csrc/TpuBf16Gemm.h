#pragma once
// The medium-precision fast path for 2-D matmuls: bf16 operands, fp32
// accumulation and fp32 output in one GEMM (MKL's gemm_bf16bf16f32, shipped
// inside libtorch_cpu). It equals an fp32 GEMM over bf16-rounded operands up
// to accumulation order, reads half the operand bytes, and uses the CPU's
// bf16 dot-product units where it has them.

#include <ATen/core/Tensor.h>

namespace torch_tpu {

// alpha * bf16(a) @ bf16(b) + beta * bias (bias broadcast to (m, n), may be
// undefined). a: (m, k), b: (k, n), fp32 CPU tensors. Returns an undefined
// tensor when the shapes are outside what the kernel takes, so callers fall
// back to the rounding path.
at::Tensor bf16_gemm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& bias,
                     float beta, float alpha);

} // namespace torch_tpu
