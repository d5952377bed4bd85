#pragma once
// Batched matmuls of small matrices, as DLRM's dot interaction makes them:
// the Gram matrices x @ x^T of (B, 27, 64) and their backward (B, 27, 27) @
// (B, 27, 64). Per matrix, MKL's batched GEMM spends more time getting ready
// than multiplying at these sizes (about 17 GFLOP/s on one core here, for
// about 50 at large shapes). This kernel packs each batch element's operands
// into small row-major blocks that stay in cache (rounding them to bf16 on the
// way at medium precision) and multiplies them in AVX2 registers.

#include <ATen/core/Tensor.h>

namespace torch_tpu {

// a (B, m, k) @ b (B, k, n), fp32 CPU tensors of any strides, accumulated in
// fp32 in k order; round_operands: each operand rounded to bf16 first (what
// the MXU multiplies at medium precision). Returns an undefined tensor when
// the shapes are not small, or the CPU has no AVX2 and FMA: callers then take
// the general path.
at::Tensor small_bmm(const at::Tensor& a, const at::Tensor& b, bool round_operands);

} // namespace torch_tpu
