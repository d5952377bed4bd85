#pragma once
// The operands and result of a 2-D fp32 GEMM as every engine under mm/addmm
// takes them (TpuBf16Gemm, TpuFp32Gemm).

#include <ATen/core/Tensor.h>
#include <ATen/ops/_to_copy.h>
#include <ATen/ops/empty.h>

#include <utility>

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

// The result's starting value and the beta the GEMM applies to it: bias
// broadcast to (m, n) when beta is not 0 (a copy: the GEMM writes it), else
// uninitialized memory (beta 0).
inline std::pair<at::Tensor, float> initial_result(const at::Tensor& a, const at::Tensor& b, const at::Tensor& bias,
                                                   float beta) {
  const int64_t m = a.size(0), n = b.size(1);
  if (bias.defined() && beta != 0.0f) {
    return {at::_to_copy(bias.expand({m, n}), at::kFloat, std::nullopt, std::nullopt, std::nullopt, false,
                         c10::MemoryFormat::Contiguous),
            beta};
  }
  return {at::empty({m, n}, a.options()), 0.0f};
}

} // namespace torch_tpu
