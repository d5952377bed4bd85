#pragma once
// A bf16-input, fp32-output GEMM on the CPU's AVX512-BF16 dot-product
// instruction (vdpbf16ps): the MXU's single pass. Operands are fp32, rounded
// to bf16 (ties to even, subnormals flushed as the MXU does) while they are
// packed; products of bf16 pairs are exact in fp32 and accumulate in fp32, so
// the result equals an fp32 GEMM over the rounded operands up to accumulation
// order. ATen reaches no such
// GEMM: its bf16 matmuls round their output to bf16, and MKL's
// gemm_bf16bf16f32 runs slower than fp32 on this AMD CPU.

#include <cstdint>

namespace torch_tpu {

// Whether this CPU has the instructions (checked once). Whether medium
// matmuls use the kernel is TpuBf16Gemm.cpp's choice.
bool bf16_kernel_available();

// c = alpha * a @ b + beta * c. a: m x k with strides (sam, sak); b: k x n
// with strides (sbk, sbn); c: m x n, row-major with leading dimension ldc.
// Parallel over blocks of rows. Only call when bf16_kernel_available().
void bf16_gemm_kernel(const float* a, int64_t sam, int64_t sak, const float* b, int64_t sbk, int64_t sbn,
                      float* c, int64_t ldc, int64_t m, int64_t n, int64_t k, float alpha, float beta);

// c[i] = a[i] @ b[i] for i < batch: a with strides (sab, sam, sak), b with
// (sbb, sbk, sbn), c contiguous (batch, m, n). Parallel over the batch.
void bf16_bmm_kernel(const float* a, int64_t sab, int64_t sam, int64_t sak, const float* b, int64_t sbb,
                     int64_t sbk, int64_t sbn, float* c, int64_t batch, int64_t m, int64_t n, int64_t k);

} // namespace torch_tpu
