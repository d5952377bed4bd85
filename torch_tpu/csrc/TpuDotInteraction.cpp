// torch.ops.torch_tpu.dot_interaction: DLRM's dot interaction as one op.
//
// out = [dense, <x_i, x_j> for i < j] with x = [dense, sparse_0 .. sparse_F-1]
// per sample: TorchRec's InteractionArch, which concatenates x, takes the
// full Gram matrix x x^T by a batched matmul, gathers its upper triangle and
// concatenates again - four passes over memory around matmuls of 27x64
// matrices. Here each sample's rows are read in place (or packed once, in
// cache, bf16-rounded at medium as the MXU sees them), and only the pairs' dot
// products are computed, straight into the output row: 2x4 blocks of pairs,
// each dot as 8-lane partial sums over the dim added across lanes at the end,
// eight at a time. The backward
// builds the symmetric gradient (g + g^T) in cache and multiplies it by the
// packed x on the small-matrix kernel (TpuSmallBmm): the unfused form's
// operands, kernel and summation order, so its bits too where that form runs
// on the same kernel (medium or highest, no AVX512-BF16).
//
// The fused kernels take fp32 at medium and highest precision with up to
// kMaxVectors vectors of up to kMaxDim; anything else (high precision's three
// passes, other dtypes, a CPU without AVX2) runs the unfused form on mxu::bmm.

#include "TpuHost.h"
#include "TpuMxu.h"
#include "TpuPrecision.h"
#include "TpuSmallBmm.h"

#include <ATen/Parallel.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/triu_indices.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

namespace torch_tpu {
namespace {

constexpr int64_t kMaxVectors = 64;
constexpr int64_t kMaxDim = 512;

int64_t pairs(int64_t vectors) {
  return vectors * (vectors - 1) / 2;
}

// In SymInts, for the meta kernels too: a traced step with a symbolic batch keeps it
// symbolic (reading the batch as an int would specialize the graph to it: one compile
// per batch size).
void check_shapes(const char* op, const at::Tensor& dense, const at::Tensor& sparse) {
  TORCH_CHECK(dense.dim() == 2 && sparse.dim() == 3, op, ": expected dense (B, D) and sparse (B, F, D), got ",
              dense.sym_sizes(), " and ", sparse.sym_sizes());
  TORCH_SYM_CHECK(sparse.sym_size(0).sym_eq(dense.sym_size(0)).sym_and(sparse.sym_size(2).sym_eq(dense.sym_size(1))),
                  op, ": dense ", dense.sym_sizes(), " and sparse ", sparse.sym_sizes(), " disagree on B or D");
  TORCH_CHECK(dense.scalar_type() == sparse.scalar_type(), op, ": dense is ", dense.scalar_type(),
              " but sparse is ", sparse.scalar_type());
}

// Whether the fused kernels take these operands and, if so, whether they round
// them to bf16 (medium) or not (highest); nullopt: the unfused form runs.
std::optional<bool> fused_rounding(const at::Tensor& dense, const at::Tensor& sparse) {
  const Precision precision = effective_precision(dense, sparse);
  if (!small_gemm::available() || dense.scalar_type() != at::kFloat || precision == Precision::kHigh ||
      sparse.size(1) + 1 > kMaxVectors || dense.size(1) > kMaxDim || dense.size(1) == 0) {
    return std::nullopt;
  }
  return precision == Precision::kMedium;
}

// Sample e's x = [dense, sparse rows] packed row-major (ld columns), rounded if asked.
void pack_x(const at::Tensor& dense, const at::Tensor& sparse, int64_t e, float* x, int64_t ld, bool round) {
  const int64_t features = sparse.size(1), dim = dense.size(1);
  small_gemm::pack(dense.const_data_ptr<float>() + e * dense.stride(0), 1, dim, dim, dense.stride(1), x, ld, round);
  small_gemm::pack(sparse.const_data_ptr<float>() + e * sparse.stride(0), features, dim, sparse.stride(1),
                   sparse.stride(2), x + ld, ld, round);
}

// The dot products of rows i0, i0 + 1 with rows j0 .. j0 + 3 (rows[r]: row r of
// x, `depth` floats, a multiple of 8): 8-lane partial sums over k in registers -
// two rows of x loaded per step and four others, eight fused multiply-adds -
// then all eight sums reduced across lanes at once (pairwise adds, a lane
// transpose), returned as [(i0, j0 .. j0 + 3), (i0 + 1, j0 .. j0 + 3)].
__attribute__((target("avx2,fma"), always_inline)) inline __m256 dots_2x4(const float* const* rows, int64_t i0,
                                                                          int64_t j0, int64_t depth) {
  const float *a0 = rows[i0], *a1 = rows[i0 + 1];
  const float *b0 = rows[j0], *b1 = rows[j0 + 1], *b2 = rows[j0 + 2], *b3 = rows[j0 + 3];
  __m256 s00 = _mm256_setzero_ps(), s01 = s00, s02 = s00, s03 = s00, s10 = s00, s11 = s00, s12 = s00, s13 = s00;
  for (int64_t k = 0; k < depth; k += small_gemm::kLanes) {
    const __m256 x0 = _mm256_loadu_ps(a0 + k), x1 = _mm256_loadu_ps(a1 + k);
    __m256 y = _mm256_loadu_ps(b0 + k);
    s00 = _mm256_fmadd_ps(x0, y, s00);
    s10 = _mm256_fmadd_ps(x1, y, s10);
    y = _mm256_loadu_ps(b1 + k);
    s01 = _mm256_fmadd_ps(x0, y, s01);
    s11 = _mm256_fmadd_ps(x1, y, s11);
    y = _mm256_loadu_ps(b2 + k);
    s02 = _mm256_fmadd_ps(x0, y, s02);
    s12 = _mm256_fmadd_ps(x1, y, s12);
    y = _mm256_loadu_ps(b3 + k);
    s03 = _mm256_fmadd_ps(x0, y, s03);
    s13 = _mm256_fmadd_ps(x1, y, s13);
  }
  // hadd(hadd(s0, s1), hadd(s2, s3)) = [s0..s3 over lanes 0-3 | s0..s3 over lanes 4-7].
  const __m256 r0 = _mm256_hadd_ps(_mm256_hadd_ps(s00, s01), _mm256_hadd_ps(s02, s03));
  const __m256 r1 = _mm256_hadd_ps(_mm256_hadd_ps(s10, s11), _mm256_hadd_ps(s12, s13));
  return _mm256_add_ps(_mm256_permute2f128_ps(r0, r1, 0x20), _mm256_permute2f128_ps(r0, r1, 0x31));
}

// The strict upper triangle of x x^T (n rows, rows[n .. n + 3] zero rows for the
// blocks that reach past the last one) into out, pairs row by row.
__attribute__((target("avx2,fma"))) void upper_dots(const float* const* rows, int64_t n, int64_t depth,
                                                    float* out) {
  // out index of pair (i, j) is start(i) + j.
  auto start = [n](int64_t i) { return i * (2 * n - i - 1) / 2 - i - 1; };
  alignas(32) float dots[8];
  for (int64_t i0 = 0; i0 + 1 < n; i0 += 2) {
    const int64_t i1 = i0 + 1;
    float* out0 = out + start(i0);
    float* out1 = out + start(i1);  // row n - 1 has no pairs: then nothing is written through it
    for (int64_t j0 = i0 + 1; j0 < n; j0 += 4) {
      const __m256 d = dots_2x4(rows, i0, j0, depth);
      if (j0 + 4 <= n && j0 > i1) {  // the common case: all eight are pairs
        _mm_storeu_ps(out0 + j0, _mm256_castps256_ps128(d));
        _mm_storeu_ps(out1 + j0, _mm256_extractf128_ps(d, 1));
        continue;
      }
      _mm256_store_ps(dots, d);
      for (int64_t c = 0; c < 4 && j0 + c < n; ++c) {
        out0[j0 + c] = dots[c];
        if (j0 + c > i1) out1[j0 + c] = dots[4 + c];
      }
    }
  }
}

at::Tensor fused_forward(const at::Tensor& dense, const at::Tensor& sparse, bool round) {
  const int64_t batch = dense.size(0), dim = dense.size(1), n = sparse.size(1) + 1;
  const int64_t width = dim + pairs(n);
  at::Tensor out = at::empty({batch, width}, dense.options());
  float* po = out.mutable_data_ptr<float>();
  const float* pd = dense.const_data_ptr<float>();
  const int64_t ld = small_gemm::padded(dim);
  // Rows read in place where they are dense vectors of whole 8-float steps and
  // are not rounded; else packed (padded with zeros, rounded at medium).
  const bool in_place = !round && ld == dim && dense.stride(1) == 1 && sparse.stride(2) == 1;
  at::parallel_for(0, batch, small_gemm::grain(n * n * dim), [&](int64_t begin, int64_t end) {
    std::vector<float> x(in_place ? 0 : n * ld);
    const std::vector<float> zeros(ld * 4, 0.0f);
    std::vector<const float*> rows(n + 4);
    for (int64_t r = 0; r < 4; ++r) rows[n + r] = zeros.data() + r * ld;
    if (!in_place) {
      for (int64_t r = 0; r < n; ++r) rows[r] = x.data() + r * ld;  // repacked per sample
    }
    for (int64_t e = begin; e < end; ++e) {
      if (in_place) {
        rows[0] = pd + e * dense.stride(0);
        const float* ps = sparse.const_data_ptr<float>() + e * sparse.stride(0);
        for (int64_t r = 1; r < n; ++r) rows[r] = ps + (r - 1) * sparse.stride(1);
      } else {
        pack_x(dense, sparse, e, x.data(), ld, round);
      }
      float* row = po + e * width;
      // The dense part as given: the MXU rounds operands, not the tensors passed through.
      small_gemm::pack(pd + e * dense.stride(0), 1, dim, dim, dense.stride(1), row, dim, false);
      upper_dots(rows.data(), n, ld, row + dim);
    }
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> fused_backward(const at::Tensor& grad, const at::Tensor& dense,
                                                  const at::Tensor& sparse, bool round) {
  const int64_t batch = dense.size(0), dim = dense.size(1), features = sparse.size(1), n = features + 1;
  at::Tensor d_dense = at::empty({batch, dim}, dense.options());
  at::Tensor d_sparse = at::empty({batch, features, dim}, dense.options());
  const float* pg = grad.const_data_ptr<float>();
  float* pdd = d_dense.mutable_data_ptr<float>();
  float* pds = d_sparse.mutable_data_ptr<float>();
  const int64_t ldx = small_gemm::padded(dim);
  const int64_t g0 = grad.stride(0), g1 = grad.stride(1);
  const int64_t p = pairs(n);
  at::parallel_for(0, batch, small_gemm::grain(n * n * dim), [&](int64_t begin, int64_t end) {
    std::vector<float> s(n * n), g(p), x(n * ldx), dx(n * dim);
    for (int64_t e = begin; e < end; ++e) {
      // g + g^T of the Gram matrix's gradient: the pair's gradient on both sides, 0 on the
      // diagonal. The pairs' gradients are rounded in one vector pass first.
      small_gemm::pack(pg + e * g0 + dim * g1, 1, p, p * g1, g1, g.data(), p, round);
      const float* v = g.data();
      for (int64_t i = 0; i < n; ++i) {
        const int64_t later = n - 1 - i;  // pairs (i, j > i), next in the row
        float* row = s.data() + i * n + i;  // (i, i); (i, j) is row[j - i], (j, i) is row[(j - i) * n]
        row[0] = 0.0f;
        for (int64_t j = 1; j <= later; ++j) {  // a short loop, not a copy call per row
          row[j] = v[j - 1];
          row[j * n] = v[j - 1];
        }
        v += later;
      }
      pack_x(dense, sparse, e, x.data(), ldx, round);
      small_gemm::multiply(s.data(), x.data(), n, n, dim, ldx, dx.data());
      for (int64_t d = 0; d < dim; ++d) pdd[e * dim + d] = pg[e * g0 + d * g1] + dx[d];
      std::copy(dx.data() + dim, dx.data() + n * dim, pds + e * features * dim);
    }
  });
  return {d_dense, d_sparse};
}

// Flat indices of the Gram matrix's strict upper triangle, row by row.
at::Tensor upper_triangle(int64_t n, const at::TensorOptions& options) {
  at::Tensor rc = at::triu_indices(n, n, 1, options.dtype(at::kLong));
  return rc[0].mul(n).add_(rc[1]);
}

// The unfused form on mxu::bmm: any dtype and precision.
at::Tensor unfused_forward(const at::Tensor& dense, const at::Tensor& sparse) {
  const int64_t n = sparse.size(1) + 1;
  at::Tensor x = at::cat({dense.unsqueeze(1), sparse}, 1);
  at::Tensor gram = mxu::bmm(x, x.transpose(1, 2));
  return at::cat({dense, gram.flatten(1).index_select(1, upper_triangle(n, dense.options()))}, 1);
}

std::tuple<at::Tensor, at::Tensor> unfused_backward(const at::Tensor& grad, const at::Tensor& dense,
                                                    const at::Tensor& sparse) {
  const int64_t batch = dense.size(0), dim = dense.size(1), n = sparse.size(1) + 1;
  at::Tensor g = at::zeros({batch, n * n}, grad.options());
  g.index_copy_(1, upper_triangle(n, grad.options()), grad.narrow(1, dim, pairs(n)));
  g = g.view({batch, n, n});
  at::Tensor dx = mxu::bmm(g.add(g.transpose(1, 2)), at::cat({dense.unsqueeze(1), sparse}, 1));
  return {grad.narrow(1, 0, dim).add(dx.select(1, 0)), dx.narrow(1, 1, n - 1)};
}

// On CPU tensors (host views), at the current MXU precision.
at::Tensor interaction(const at::Tensor& dense, const at::Tensor& sparse) {
  check_shapes("dot_interaction", dense, sparse);
  const std::optional<bool> round = fused_rounding(dense, sparse);
  return round ? fused_forward(dense, sparse, *round) : unfused_forward(dense, sparse);
}

std::tuple<at::Tensor, at::Tensor> interaction_backward(const at::Tensor& grad, const at::Tensor& dense,
                                                        const at::Tensor& sparse) {
  check_shapes("dot_interaction_backward", dense, sparse);
  const int64_t n = sparse.size(1) + 1;
  TORCH_CHECK(grad.dim() == 2 && grad.size(0) == dense.size(0) && grad.size(1) == dense.size(1) + pairs(n),
              "dot_interaction_backward: grad ", grad.sizes(), " is not the output's shape (", dense.size(0), ", ",
              dense.size(1) + pairs(n), ")");
  const std::optional<bool> round = fused_rounding(dense, sparse);
  if (!round || grad.scalar_type() != at::kFloat) {
    return unfused_backward(grad, dense, sparse);
  }
  return fused_backward(grad, dense, sparse, *round);
}

at::Tensor tpu_interaction(const at::Tensor& dense, const at::Tensor& sparse) {
  return on_host("dot_interaction", {dense, sparse},
                 [&](HostScope& s) { return interaction(s.view(dense), s.view(sparse)); });
}

std::tuple<at::Tensor, at::Tensor> tpu_interaction_backward(const at::Tensor& grad, const at::Tensor& dense,
                                                            const at::Tensor& sparse) {
  HostScope scope(common_device("dot_interaction_backward", {grad, dense, sparse}));
  auto [d_dense, d_sparse] = interaction_backward(scope.view(grad), scope.view(dense), scope.view(sparse));
  scope.write_back();
  return {scope.adopt(d_dense), scope.adopt(d_sparse)};
}

at::Tensor meta_interaction(const at::Tensor& dense, const at::Tensor& sparse) {
  check_shapes("dot_interaction", dense, sparse);
  const int64_t features = sparse.sym_size(1).guard_int(__FILE__, __LINE__);  // the model's, not the batch's
  return at::empty_symint({dense.sym_size(0), dense.sym_size(1) + pairs(features + 1)}, dense.options());
}

std::tuple<at::Tensor, at::Tensor> meta_interaction_backward(const at::Tensor& grad, const at::Tensor& dense,
                                                             const at::Tensor& sparse) {
  check_shapes("dot_interaction_backward", dense, sparse);
  return {at::empty_symint(dense.sym_sizes(), dense.options()), at::empty_symint(sparse.sym_sizes(), sparse.options())};
}

} // namespace

TORCH_LIBRARY_FRAGMENT(torch_tpu, m) {
  m.def("dot_interaction(Tensor dense, Tensor sparse) -> Tensor");
  m.def("dot_interaction_backward(Tensor grad, Tensor dense, Tensor sparse) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(torch_tpu, PrivateUse1, m) {
  m.impl("dot_interaction", tpu_interaction);
  m.impl("dot_interaction_backward", tpu_interaction_backward);
}

TORCH_LIBRARY_IMPL(torch_tpu, CPU, m) {
  m.impl("dot_interaction", interaction);
  m.impl("dot_interaction_backward", interaction_backward);
}

TORCH_LIBRARY_IMPL(torch_tpu, Meta, m) {
  m.impl("dot_interaction", meta_interaction);
  m.impl("dot_interaction_backward", meta_interaction_backward);
}

} // namespace torch_tpu
