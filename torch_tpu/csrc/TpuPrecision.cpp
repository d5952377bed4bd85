#include "TpuPrecision.h"

#include <ATen/Parallel.h>
#include <ATen/ops/_to_copy.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/sub.h>

#include <atomic>
#include <cstdint>
#include <cstring>

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

namespace {

// fp32 bits -> the fp32 bits of the nearest bf16 (ties to even), as
// c10::BFloat16's conversion rounds; NaN becomes the canonical quiet NaN and
// subnormals become zero, as the MXU flushes them (and so does the bf16
// dot-product instruction of TpuBf16Kernel: every medium path agrees).
inline uint32_t bf16_bits(uint32_t x) {
  if ((x & 0x7fffffffu) > 0x7f800000u) {
    return 0x7fc00000u;
  }
  if ((x & 0x7f800000u) == 0) {
    return x & 0x80000000u;
  }
  return (x + 0x7fffu + ((x >> 16) & 1u)) & 0xffff0000u;
}

} // namespace

at::Tensor round_to_bf16(const at::Tensor& t) {
  if (t.scalar_type() != at::kFloat) {
    return at::_to_copy(at::_to_copy(t, at::kBFloat16), at::kFloat);
  }
  if (!t.is_non_overlapping_and_dense()) {
    return round_to_bf16(t.contiguous());  // a bf16 round trip would keep subnormals
  }
  // One pass over the memory the tensor spans (dense: numel elements from
  // its data pointer), into a tensor of the same strides: the operands of
  // every medium matmul go through here, and a round trip through a bf16
  // tensor costs two passes and an allocation.
  at::Tensor out = at::empty_like(t);
  const auto* src = static_cast<const uint32_t*>(t.const_data_ptr());
  auto* dst = static_cast<uint32_t*>(out.mutable_data_ptr());
  at::parallel_for(0, t.numel(), 1 << 15, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      dst[i] = bf16_bits(src[i]);
    }
  });
  return out;
}

} // namespace torch_tpu
