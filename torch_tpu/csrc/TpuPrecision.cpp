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

// The whole vectors of round_to_bf16's span (a scalar loop is about 10x
// slower: its branches keep the compiler from vectorizing it); returns how
// many floats they covered.
__attribute__((target("avx2"))) int64_t round_vectors_avx2(const float* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, bf16_round8(_mm256_loadu_ps(src + i)));
  return i;
}

} // namespace

void round_to_bf16(const float* src, float* dst, int64_t n) {
  const int64_t done = avx2_available() ? round_vectors_avx2(src, dst, n) : 0;
  for (int64_t i = done; i < n; ++i) dst[i] = bf16_round(src[i]);
}

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
  const float* src = t.const_data_ptr<float>();
  float* dst = out.mutable_data_ptr<float>();
  at::parallel_for(0, t.numel(), 1 << 15, [&](int64_t begin, int64_t end) {
    round_to_bf16(src + begin, dst + begin, end - begin);
  });
  return out;
}

std::pair<at::Tensor, at::Tensor> split_bf16(const at::Tensor& t) {
  at::Tensor hi = round_to_bf16(t);
  at::Tensor lo = round_to_bf16(at::sub(t, hi));
  return {std::move(hi), std::move(lo)};
}

} // namespace torch_tpu
