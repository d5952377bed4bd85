#include "TpuBf16Gemm.h"

#include <ATen/ops/_to_copy.h>
#include <ATen/ops/empty.h>

#include <cstdint>
#include <limits>

extern "C" void cblas_gemm_bf16bf16f32(
    int layout, int transa, int transb, int m, int n, int k, float alpha, const uint16_t* a,
    int lda, const uint16_t* b, int ldb, float beta, float* c, int ldc);

namespace torch_tpu {
namespace {

constexpr int kRowMajor = 101;
constexpr int kNoTrans = 111;
constexpr int kTrans = 112;

// A bf16 copy of an fp32 matrix, with the transpose flag and leading
// dimension the GEMM needs. The copy keeps the source's layout, so a
// transposed weight stays transposed instead of being reordered.
struct Operand {
  at::Tensor data;
  int trans;
  int64_t ld;
};

Operand as_operand(const at::Tensor& t) {
  auto data = at::_to_copy(t, at::kBFloat16);
  const int64_t rows = data.size(0), cols = data.size(1);
  if (data.stride(1) == 1 && data.stride(0) >= std::max<int64_t>(cols, 1)) {
    return {data, kNoTrans, data.stride(0)};
  }
  if (data.stride(0) == 1 && data.stride(1) >= std::max<int64_t>(rows, 1)) {
    return {data, kTrans, data.stride(1)};
  }
  data = data.contiguous();
  return {data, kNoTrans, cols};
}

bool fits_int(int64_t v) {
  return v >= 0 && v <= std::numeric_limits<int>::max();
}

} // namespace

at::Tensor bf16_gemm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& bias,
                     float beta, float alpha) {
  if (a.dim() != 2 || b.dim() != 2 || a.scalar_type() != at::kFloat ||
      b.scalar_type() != at::kFloat) {
    return {};
  }
  const int64_t m = a.size(0), k = a.size(1), n = b.size(1);
  if (m == 0 || n == 0 || k == 0 || !fits_int(m * k) || !fits_int(k * n) || !fits_int(m * n)) {
    return {};
  }
  const Operand lhs = as_operand(a);
  const Operand rhs = as_operand(b);
  at::Tensor out;
  float gemm_beta = 0.0f;
  if (bias.defined() && beta != 0.0f) {
    out = at::_to_copy(bias.expand({m, n}), at::kFloat, std::nullopt, std::nullopt, std::nullopt,
                       false, c10::MemoryFormat::Contiguous);
    gemm_beta = beta;
  } else {
    out = at::empty({m, n}, a.options());
  }
  cblas_gemm_bf16bf16f32(
      kRowMajor, lhs.trans, rhs.trans, static_cast<int>(m), static_cast<int>(n),
      static_cast<int>(k), alpha, reinterpret_cast<const uint16_t*>(lhs.data.const_data_ptr()),
      static_cast<int>(lhs.ld), reinterpret_cast<const uint16_t*>(rhs.data.const_data_ptr()),
      static_cast<int>(rhs.ld), gemm_beta, out.mutable_data_ptr<float>(), static_cast<int>(n));
  return out;
}

} // namespace torch_tpu
