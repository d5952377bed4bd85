#pragma once
// TensorCore (MXU) precision for fp32 matmul-family ops on tpu.
//   medium  (default): operands rounded to bf16, fp32 accumulation and output
//   high:    3-pass bf16 split: hi*hi + hi*lo + lo*hi
//   highest: exact fp32

#include <ATen/core/Tensor.h>
#include <ATen/ops/sub.h>

namespace torch_tpu {

enum class Precision : int64_t { kHighest = 0, kHigh = 1, kMedium = 2 };

Precision matmul_precision();
void set_matmul_precision(Precision p);

// Runs a bilinear op `f(a, b, with_rest)` at the tpu precision. `f` returns
// the op on the given operands; with_rest=false asks for the product term
// alone (no bias / beta*self), used for the extra passes of `high`.
template <class F>
at::Tensor on_mxu(const at::Tensor& a, const at::Tensor& b, F f);

// bf16 rounding that stays fp32: the value the MXU multiplies.
at::Tensor round_to_bf16(const at::Tensor& t);

// ---- implementation ----

Precision effective_precision(const at::Tensor& a, const at::Tensor& b);

template <class F>
at::Tensor on_mxu(const at::Tensor& a, const at::Tensor& b, F f) {
  switch (effective_precision(a, b)) {
    case Precision::kHighest:
      return f(a, b, true);
    case Precision::kMedium:
      return f(round_to_bf16(a), round_to_bf16(b), true);
    case Precision::kHigh: {
      const auto a_hi = round_to_bf16(a);
      const auto b_hi = round_to_bf16(b);
      const auto a_lo = round_to_bf16(at::sub(a, a_hi));
      const auto b_lo = round_to_bf16(at::sub(b, b_hi));
      auto out = f(a_hi, b_hi, true);
      out.add_(f(a_hi, b_lo, false));
      out.add_(f(a_lo, b_hi, false));
      return out;
    }
  }
  TORCH_INTERNAL_ASSERT(false, "unknown precision");
}

} // namespace torch_tpu
