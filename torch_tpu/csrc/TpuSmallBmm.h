#pragma once
// Batched matmuls of small matrices, as DLRM's dot interaction makes them:
// the Gram matrices x @ x^T of (B, 27, 64) and their backward (B, 27, 27) @
// (B, 27, 64). Per matrix, MKL's batched GEMM spends more time getting ready
// than multiplying at these sizes (about 17 GFLOP/s on one core here, for
// about 50 at large shapes). This kernel packs each batch element's operands
// into small row-major blocks that stay in cache (rounding them to bf16 on the
// way at medium precision) and multiplies them in AVX2 registers.

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>

namespace torch_tpu {

// a (B, m, k) @ b (B, k, n), fp32 CPU tensors of any strides, accumulated in
// fp32 in k order; round_operands: each operand rounded to bf16 first (what
// the MXU multiplies at medium precision). Returns an undefined tensor when
// the shapes are not small, or the CPU has no AVX2 and FMA: callers then take
// the general path.
at::Tensor small_bmm(const at::Tensor& a, const at::Tensor& b, bool round_operands);

// The kernel's pieces, for other small-matrix kernels (TpuDotInteraction.cpp).
namespace small_gemm {

constexpr int64_t kLanes = 8;

// Whether this CPU runs them (AVX2 and FMA); nothing below may be called otherwise.
bool available();

// rows x cols of src (element strides s_row, s_col) into dst, row-major with
// ld >= cols columns, the columns past cols zeroed; rounded to bf16 if asked.
void pack(const float* src, int64_t rows, int64_t cols, int64_t s_row, int64_t s_col, float* dst, int64_t ld,
          bool round);

// c (m x n, row-major, ld n) = a (m x k, row-major) @ b (k x n, row-major with
// ld ldb, a multiple of kLanes, zero past n), fused multiply-adds in k order.
void multiply(const float* a, const float* b, int64_t m, int64_t k, int64_t n, int64_t ldb, float* c);

inline int64_t padded(int64_t n) {
  return (n + kLanes - 1) / kLanes * kLanes;
}

// Batch elements per parallel task for kernels of `multiply_adds` per element:
// about 64k multiply-adds a task, small enough to share out a DLRM batch.
inline int64_t grain(int64_t multiply_adds) {
  return std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(multiply_adds, 1));
}

} // namespace small_gemm

} // namespace torch_tpu
