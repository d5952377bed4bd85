#pragma once
// The medium-precision fast path for matmuls: bf16 operands, fp32
// accumulation and fp32 output in one GEMM - the MXU's single pass. It equals
// an fp32 GEMM over bf16-rounded operands up to accumulation order. Two
// engines: our AVX512-BF16 kernel (TpuBf16Kernel.h), and oneDNN (inside
// libtorch_cpu) in its bf16 math mode over operands rounded to bf16 values,
// which runs on AMX tiles where the CPU has them. ATen's own bf16 matmuls
// round their output to bf16, which the MXU does not.

#include <ATen/core/Tensor.h>

namespace torch_tpu {

// alpha * bf16(a) @ bf16(b) + beta * bias (bias broadcast to (m, n), may be
// undefined). a: (m, k), b: (k, n), fp32 CPU tensors. Returns an undefined
// tensor when the shapes are outside what the kernel takes, so callers fall
// back to the rounding path.
at::Tensor bf16_gemm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& bias,
                     float beta, float alpha);

// High precision's three passes, hi(a) hi(b) + hi(a) lo(b) + lo(a) hi(b)
// with hi = bf16(x), lo = bf16(x - hi), each on the tiles, plus beta * bias as
// bf16_gemm. Undefined where the tiles do not take the operands (callers run
// the passes as fp32 GEMMs).
at::Tensor bf16x3_gemm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& bias, float beta, float alpha);

// bf16(a) @ bf16(b) per batch: a (B, m, k), b (B, k, n), fp32. Undefined
// when the CPU has neither AVX512-BF16 nor AMX (callers use the rounding path).
at::Tensor bf16_bmm(const at::Tensor& a, const at::Tensor& b);

} // namespace torch_tpu
