#pragma once
// TensorCore (MXU) precision for fp32 matmul-family ops on tpu.
//   medium  (default): operands rounded to bf16, fp32 accumulation and output
//   high:    3-pass bf16 split: hi*hi + hi*lo + lo*hi
//   highest: exact fp32

#include <ATen/core/Tensor.h>
#include <ATen/ops/isfinite.h>
#include <ATen/ops/sub.h>
#include <c10/core/Scalar.h>

#include <cstdint>
#include <cstring>
#include <utility>

#include <immintrin.h>

namespace torch_tpu {

enum class Precision : int64_t { kHighest = 0, kHigh = 1, kMedium = 2 };

Precision matmul_precision();
void set_matmul_precision(Precision p);

// Runs a bilinear op `f(a, b, with_rest)` at the tpu precision. `f` returns
// the op on the given operands; with_rest=false asks for the product term
// alone (no bias / beta*self), used for the extra passes of `high`.
template <class F>
at::Tensor on_mxu(const at::Tensor& a, const at::Tensor& b, F f);

// on_mxu for an op whose product is scaled by alpha (addmm and kin). A product
// scaled by zero is not formed, as BLAS and ATen's CPU kernels do: the op runs
// on the operands as they are, so an inf or NaN in them does not become
// 0 * inf = NaN in the result, whatever the precision.
template <class F>
at::Tensor on_mxu_scaled(const at::Tensor& a, const at::Tensor& b, const c10::Scalar& alpha, F f);

// bf16 rounding that stays fp32: the value the MXU multiplies.
at::Tensor round_to_bf16(const at::Tensor& t);

// High precision's split of an operand: hi = round_to_bf16(t), lo =
// round_to_bf16(t - hi); the three passes are hi hi + hi lo + lo hi.
std::pair<at::Tensor, at::Tensor> split_bf16(const at::Tensor& t);

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

// bf16_bits of a float's value.
inline float bf16_round(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  bits = bf16_bits(bits);
  std::memcpy(&v, &bits, sizeof bits);
  return v;
}

// dst[i] = bf16_round(src[i]) for n floats, 8 at a time where the CPU has AVX2
// (one thread; round_to_bf16 shares a tensor out over threads).
void round_to_bf16(const float* src, float* dst, int64_t n);

// bf16_bits on 8 lanes, for code compiled for AVX2 (target attribute: the
// library is built for any x86-64 and picks AVX2 at run time).
__attribute__((target("avx2"))) inline __m256 bf16_round8(__m256 v) {
  const __m256i x = _mm256_castps_si256(v);
  const __m256i magnitude = _mm256_and_si256(x, _mm256_set1_epi32(0x7fffffff));
  const __m256i nan = _mm256_cmpgt_epi32(magnitude, _mm256_set1_epi32(0x7f800000));
  const __m256i subnormal =
      _mm256_cmpeq_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x7f800000)), _mm256_setzero_si256());
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_add_epi32(_mm256_add_epi32(x, _mm256_set1_epi32(0x7fff)), odd);
  r = _mm256_and_si256(r, _mm256_set1_epi32(static_cast<int>(0xffff0000u)));
  r = _mm256_blendv_epi8(r, _mm256_and_si256(x, _mm256_set1_epi32(static_cast<int>(0x80000000u))), subnormal);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc00000), nan);
  return _mm256_castsi256_ps(r);
}

// ---- implementation ----

Precision effective_precision(const at::Tensor& a, const at::Tensor& b);

inline bool is_zero(const c10::Scalar& s) {
  return s.toComplexDouble() == 0.0;
}

template <class F>
at::Tensor on_mxu_scaled(const at::Tensor& a, const at::Tensor& b, const c10::Scalar& alpha, F f) {
  if (is_zero(alpha)) {
    return f(a, b, true);
  }
  return on_mxu(a, b, f);
}

template <class F>
at::Tensor on_mxu(const at::Tensor& a, const at::Tensor& b, F f) {
  switch (effective_precision(a, b)) {
    case Precision::kHighest:
      return f(a, b, true);
    case Precision::kMedium:
      return f(round_to_bf16(a), round_to_bf16(b), true);
    case Precision::kHigh: {
      const auto [a_hi, a_lo] = split_bf16(a);
      const auto [b_hi, b_lo] = split_bf16(b);
      auto out = f(a_hi, b_hi, true);
      auto correction = f(a_hi, b_lo, false);
      correction.add_(f(a_lo, b_hi, false));
      // Where the first pass is already inf or NaN, so is an operand (an inf's low part,
      // inf - inf, is NaN, and an inf times a low part of 0 is NaN too): the corrections
      // there would turn an inf into NaN, where IEEE fp32 gives the inf.
      out.add_(correction.masked_fill_(out.isfinite().logical_not_(), 0));
      return out;
    }
  }
  TORCH_INTERNAL_ASSERT(false, "unknown precision");
}

} // namespace torch_tpu
