#pragma once
// The fp32 GEMM under the MXU kernels: highest precision's one pass, high's
// three where the CPU has no AMX tiles, and medium's when neither bf16 engine
// takes the operands. Two engines compute it, both exact fp32 (products and
// sums in fp32, summation order their own): the BLAS ATen links (MKL), and
// oneDNN's JIT kernels inside libtorch_cpu.

#include <ATen/core/Tensor.h>

namespace torch_tpu {

// alpha * a @ b + beta * bias (bias broadcast to (m, n), may be undefined)
// through oneDNN, for 2-D fp32 CPU tensors. Undefined when oneDNN is not the
// engine in use or the operands are outside what it takes; callers then run
// ATen's mm/addmm.
at::Tensor fp32_gemm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& bias, float beta, float alpha);

} // namespace torch_tpu
