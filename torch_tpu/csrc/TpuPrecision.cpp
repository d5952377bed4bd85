#include "TpuPrecision.h"

#include <ATen/ops/_to_copy.h>
#include <ATen/ops/sub.h>

#include <atomic>

namespace torch_tpu {
namespace {
std::atomic<int64_t> g_precision{static_cast<int64_t>(Precision::kMedium)};
} // namespace

Precision matmul_precision() {
  return static_cast<Precision>(g_precision.load(std::memory_order_relaxed));
}

void set_matmul_precision(Precision p) {
  g_precision.store(static_cast<int64_t>(p), std::memory_order_relaxed);
}

Precision effective_precision(const at::Tensor& a, const at::Tensor& b) {
  // Only fp32 operands are rounded: bf16/fp16 inputs already are MXU inputs,
  // and integer or double matmuls do not run on the MXU.
  if (a.scalar_type() != at::kFloat || b.scalar_type() != at::kFloat) {
    return Precision::kHighest;
  }
  return matmul_precision();
}

at::Tensor round_to_bf16(const at::Tensor& t) {
  return at::_to_copy(at::_to_copy(t, at::kBFloat16), at::kFloat);
}

} // namespace torch_tpu
