#pragma once
// The medium-precision fast path for 2-D matmuls: bf16 operands, fp32
// accumulation and fp32 output in one GEMM, through oneDNN (inside
// libtorch_cpu) in its bf16 math mode over operands rounded to bf16 values.
// It equals an fp32 GEMM over bf16-rounded operands up to accumulation order
// (measured at DLRM's shapes here: 0.9x the time of an fp32 GEMM; MKL's
// gemm_bf16bf16f32, the earlier path, took 1.1-1.3x on this AMD CPU). A
// bf16-output GEMM runs 2-2.6x faster than fp32 here, but rounds the output,
// which the MXU does not; a bf16-input, fp32-output kernel of our own is what
// would reach that speed.

#include <ATen/core/Tensor.h>

namespace torch_tpu {

// alpha * bf16(a) @ bf16(b) + beta * bias (bias broadcast to (m, n), may be
// undefined). a: (m, k), b: (k, n), fp32 CPU tensors. Returns an undefined
// tensor when the shapes are outside what the kernel takes, so callers fall
// back to the rounding path.
at::Tensor bf16_gemm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& bias,
                     float beta, float alpha);

// bf16(a) @ bf16(b) per batch: a (B, m, k), b (B, k, n), fp32. Undefined
// when the CPU lacks the bf16 instructions (callers use the rounding path).
at::Tensor bf16_bmm(const at::Tensor& a, const at::Tensor& b);

} // namespace torch_tpu
