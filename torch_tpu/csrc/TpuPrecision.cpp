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

bool avx2_available() {
  static const bool available = __builtin_cpu_supports("avx2");
  return available;
}

// dst[i] = bf16_bits(src[i]) for whole vectors of [begin, end) (a scalar loop
// is about 10x slower: its branches keep the compiler from vectorizing it);
// returns where the vectors stop.
__attribute__((target("avx2"))) int64_t round_span_avx2(const uint32_t* src, uint32_t* dst, int64_t begin,
                                                         int64_t end) {
  for (; begin + 8 <= end; begin += 8) {
    const __m256 v = _mm256_loadu_ps(reinterpret_cast<const float*>(src + begin));
    _mm256_storeu_ps(reinterpret_cast<float*>(dst + begin), bf16_round8(v));
  }
  return begin;
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
    if (avx2_available()) {
      begin = round_span_avx2(src, dst, begin, end);
    }
    for (int64_t i = begin; i < end; ++i) {
      dst[i] = bf16_bits(src[i]);
    }
  });
  return out;
}

} // namespace torch_tpu
