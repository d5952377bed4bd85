#pragma once
// The operands of a 2-D fp32 GEMM as every engine under mm/addmm takes them
// (TpuBf16Gemm, TpuFp32Gemm).

#include <ATen/core/Tensor.h>

namespace torch_tpu {

// Whether a and b are fp32 matrices with a product to compute; raises for
// shapes that cannot be multiplied.
inline bool plain_product(const at::Tensor& a, const at::Tensor& b) {
  if (a.dim() != 2 || b.dim() != 2 || a.scalar_type() != at::kFloat || b.scalar_type() != at::kFloat) {
    return false;
  }
  const int64_t m = a.size(0), k = a.size(1), n = b.size(1);
  TORCH_CHECK(b.size(0) == k, "mat1 and mat2 shapes cannot be multiplied (", m, "x", k, " and ", b.size(0), "x", n, ")");
  return m > 0 && n > 0 && k > 0;
}

} // namespace torch_tpu
