#include "TpuSmallBmm.h"

#include "TpuPrecision.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace torch_tpu {
namespace {

// What counts as small: a batch element's packed operands stay in L2 (DLRM's
// Gram matrix packs 14 KB, in L1).
constexpr int64_t kMaxRows = 64;
constexpr int64_t kMaxCols = 128;
constexpr int64_t kMaxDepth = 512;

// A register block of C: up to kRows rows x kVectors 8-float vectors, 12
// accumulators, plus kVectors loads of b and a broadcast of a: the 16 ymm
// registers of AVX2.
constexpr int64_t kRows = 4;
constexpr int64_t kVectors = 3;
using small_gemm::kLanes;

} // namespace

namespace small_gemm {

bool available() {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return has;
}

__attribute__((target("avx2,fma"))) void pack(const float* src, int64_t rows, int64_t cols, int64_t s_row,
                                               int64_t s_col, float* dst, int64_t ld, bool round) {
  if (s_row == 1 && s_col != 1) {
    // A transposed source (b = x^T): read down its contiguous columns.
    for (int64_t c = 0; c < cols; ++c) {
      const float* in = src + c * s_col;
      int64_t r = 0;
      for (; r + kLanes <= rows; r += kLanes) {
        alignas(32) float lanes[kLanes];
        const __m256 v = _mm256_loadu_ps(in + r);
        _mm256_store_ps(lanes, round ? bf16_round8(v) : v);
        for (int64_t l = 0; l < kLanes; ++l) dst[(r + l) * ld + c] = lanes[l];
      }
      for (; r < rows; ++r) dst[r * ld + c] = round ? bf16_round(in[r]) : in[r];
    }
    for (int64_t r = 0; r < rows; ++r) std::fill(dst + r * ld + cols, dst + (r + 1) * ld, 0.0f);
    return;
  }
  if (s_col == 1 && s_row == cols && ld == cols) {
    // Dense rows into dense rows (the DLRM interaction's sparse block at a dim of whole
    // 8-float steps): one pass, not a call per short row.
    if (round) {
      round_to_bf16(src, dst, rows * cols);
    } else {
      std::copy(src, src + rows * cols, dst);
    }
    return;
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float* in = src + r * s_row;
    float* out = dst + r * ld;
    if (s_col == 1 && round) {
      round_to_bf16(in, out, cols);
    } else if (s_col == 1) {
      std::copy(in, in + cols, out);
    } else {
      for (int64_t c = 0; c < cols; ++c) out[c] = round ? bf16_round(in[c * s_col]) : in[c * s_col];
    }
    std::fill(out + cols, out + ld, 0.0f);
  }
}

} // namespace small_gemm

namespace {

// C[0:R, 0:8V] = A[0:R, :] @ B[:, 0:8V] over `depth`, as fused multiply-adds
// in k order; only the first `cols` columns of C are stored.
template <int R, int V>
__attribute__((target("avx2,fma"))) void block(const float* a, int64_t lda, const float* b, int64_t ldb,
                                               int64_t depth, float* c, int64_t ldc, int64_t cols) {
  // Every loop over r and v unrolled: constant indices keep acc in registers.
  __m256 acc[R][V];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 3
    for (int v = 0; v < V; ++v) acc[r][v] = _mm256_setzero_ps();
  for (int64_t k = 0; k < depth; ++k) {
    __m256 bv[V];
#pragma GCC unroll 3
    for (int v = 0; v < V; ++v) bv[v] = _mm256_loadu_ps(b + k * ldb + v * kLanes);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m256 av = _mm256_broadcast_ss(a + r * lda + k);
#pragma GCC unroll 3
      for (int v = 0; v < V; ++v) acc[r][v] = _mm256_fmadd_ps(av, bv[v], acc[r][v]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 3
    for (int v = 0; v < V; ++v) {
      const int64_t left = cols - v * kLanes;
      float* out = c + r * ldc + v * kLanes;
      if (left >= kLanes) {
        _mm256_storeu_ps(out, acc[r][v]);
      } else if (left > 0) {
        alignas(32) float lanes[kLanes];
        _mm256_store_ps(lanes, acc[r][v]);
        std::copy(lanes, lanes + left, out);
      }
    }
  }
}

using BlockFn = void (*)(const float*, int64_t, const float*, int64_t, int64_t, float*, int64_t, int64_t);

// kBlocks[R - 1][V - 1] = block<R, V>: the edge blocks of C are smaller.
constexpr BlockFn kBlocks[kRows][kVectors] = {
    {block<1, 1>, block<1, 2>, block<1, 3>},
    {block<2, 1>, block<2, 2>, block<2, 3>},
    {block<3, 1>, block<3, 2>, block<3, 3>},
    {block<4, 1>, block<4, 2>, block<4, 3>},
};

} // namespace

// One batch element: c (m x n, row-major) = a_packed (m x k) @ b_packed (k x ldb).
void small_gemm::multiply(const float* a, const float* b, int64_t m, int64_t k, int64_t n, int64_t ldb, float* c) {
  for (int64_t j = 0; j < n; j += kVectors * kLanes) {
    const int64_t vectors = std::min(kVectors, (ldb - j) / kLanes);
    for (int64_t i = 0; i < m; i += kRows) {
      const int64_t rows = std::min(kRows, m - i);
      kBlocks[rows - 1][vectors - 1](a + i * k, k, b + j, ldb, k, c + i * n + j, n, n - j);
    }
  }
}

at::Tensor small_bmm(const at::Tensor& a, const at::Tensor& b, bool round_operands) {
  if (!small_gemm::available() || a.dim() != 3 || b.dim() != 3 || a.scalar_type() != at::kFloat ||
      b.scalar_type() != at::kFloat || !a.device().is_cpu() || !b.device().is_cpu()) {
    return {};
  }
  const int64_t batch = a.size(0), m = a.size(1), k = a.size(2), n = b.size(2);
  // Mismatched shapes go to the general path, which reports them.
  if (b.size(0) != batch || b.size(1) != k || batch == 0 || m == 0 || k == 0 || n == 0 || m > kMaxRows ||
      n > kMaxCols || k > kMaxDepth) {
    return {};
  }
  at::Tensor out = at::empty({batch, m, n}, a.options());
  const float* pa = a.const_data_ptr<float>();
  const float* pb = b.const_data_ptr<float>();
  float* pc = out.mutable_data_ptr<float>();
  const int64_t ldb = small_gemm::padded(n);
  at::parallel_for(0, batch, small_gemm::grain(m * n * k), [&](int64_t begin, int64_t end) {
    std::vector<float> a_packed(m * k), b_packed(k * ldb);
    for (int64_t e = begin; e < end; ++e) {
      small_gemm::pack(pa + e * a.stride(0), m, k, a.stride(1), a.stride(2), a_packed.data(), k, round_operands);
      small_gemm::pack(pb + e * b.stride(0), k, n, b.stride(1), b.stride(2), b_packed.data(), ldb, round_operands);
      small_gemm::multiply(a_packed.data(), b_packed.data(), m, k, n, ldb, pc + e * m * n);
    }
  });
  return out;
}

namespace {

// torch.ops.torch_tpu._small_bmm: the kernel alone on CPU tensors, for tests
// (which path a tpu bmm took is otherwise invisible).
at::Tensor small_bmm_op(const at::Tensor& a, const at::Tensor& b, bool round_operands) {
  at::Tensor out = small_bmm(a, b, round_operands);
  TORCH_CHECK(out.defined(), "_small_bmm: the kernel does not take a ", a.sizes(), " ", a.scalar_type(), " @ ",
              b.sizes(), " ", b.scalar_type(), " bmm on this CPU (fp32, 3-D, m <= ", kMaxRows, ", k <= ", kMaxDepth,
              ", n <= ", kMaxCols, ", AVX2 and FMA)");
  return out;
}

} // namespace

TORCH_LIBRARY_FRAGMENT(torch_tpu, m) {
  m.def("_small_bmm(Tensor a, Tensor b, bool round_operands) -> Tensor");
}

TORCH_LIBRARY_IMPL(torch_tpu, CPU, m) {
  m.impl("_small_bmm", small_bmm_op);
}

} // namespace torch_tpu
