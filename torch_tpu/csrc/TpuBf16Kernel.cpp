#include "TpuBf16Kernel.h"

#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

namespace torch_tpu {
namespace {

constexpr int64_t kRows = 8;       // microkernel rows (8 x 2 accumulators)
constexpr int64_t kCols = 32;      // microkernel columns: two 16-lane fp32 vectors
constexpr int64_t kRowBlock = 64;  // rows a task takes: its A block stays in L2

inline uint32_t pair(uint16_t lo, uint16_t hi) {
  return static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
}

// count fp32 values -> bf16 (ties to even; subnormals flushed, as the
// instruction does), 16 at a time.
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
void convert_run(const float* src, int64_t count, uint16_t* dst) {
  int64_t i = 0;
  for (; i + 16 <= count; i += 16) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + i)));
  }
  if (i < count) {
    const __mmask16 mask = static_cast<__mmask16>((1u << (count - i)) - 1);
    const __m256i v = (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(mask, src + i));
    _mm256_mask_storeu_epi16(dst + i, mask, v);
  }
}

// A strided run (a row or column of an operand) as bf16, through a
// contiguous copy when the run is not contiguous.
void convert_strided(const float* src, int64_t stride, int64_t count, uint16_t* dst, std::vector<float>& gather) {
  if (stride == 1) {
    convert_run(src, count, dst);
    return;
  }
  gather.resize(count);
  for (int64_t i = 0; i < count; ++i) gather[i] = src[i * stride];
  convert_run(gather.data(), count, dst);
}

// Two runs of floats (k and k + 1 of one operand; hi null past the end of k)
// as bf16 pairs lo | hi << 16, element i to dst[i / 8 * group_stride + i % 8]:
// the packed layouts take pairs in groups of 8 rows (a) or 32 columns (b).
// Rounds as convert_run; writes whole groups of 8 (zeros past count).
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
void pair_runs(const float* lo, const float* hi, int64_t count, uint32_t* dst, int64_t group_stride) {
  for (int64_t i = 0; i < count; i += 8, dst += group_stride) {
    const auto live = static_cast<__mmask8>(count - i >= 8 ? 0xff : (1u << (count - i)) - 1);
    const __m256i l = _mm256_cvtepu16_epi32((__m128i)_mm256_cvtneps_pbh(_mm256_maskz_loadu_ps(live, lo + i)));
    __m256i both = l;
    if (hi != nullptr) {
      const __m256i h = _mm256_cvtepu16_epi32((__m128i)_mm256_cvtneps_pbh(_mm256_maskz_loadu_ps(live, hi + i)));
      both = _mm256_or_si256(l, _mm256_slli_epi32(h, 16));
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), both);
  }
}

// Panel p (32 columns) of the k x n right operand as bf16 pairs along k:
// dst[k/2][32] (the layout vdpbf16ps multiplies), zero-padded.
void pack_b_panel(const float* b, int64_t sk, int64_t sn, int64_t k, int64_t n, int64_t pairs, int64_t p,
                  uint32_t* dst, std::vector<uint16_t>& scratch, std::vector<float>& gather) {
  std::fill(dst, dst + pairs * kCols, 0u);
  const int64_t j0 = p * kCols, cols = std::min(kCols, n - j0);
  if (sk == 1 && sn != 1) {  // a transposed b: its columns are contiguous runs along k
    scratch.assign(2 * pairs, 0);
    const auto* pairs_of = reinterpret_cast<const uint32_t*>(scratch.data());
    for (int64_t c = 0; c < cols; ++c) {
      convert_run(b + (j0 + c) * sn, k, scratch.data());
      for (int64_t kk = 0; kk < pairs; ++kk) dst[kk * kCols + c] = pairs_of[kk];
    }
    return;
  }
  if (sn == 1) {  // rows k0, k1 of the panel: contiguous runs, paired in vectors
    for (int64_t kk = 0; kk < pairs; ++kk) {
      const float* row = b + 2 * kk * sk + j0;
      pair_runs(row, 2 * kk + 1 < k ? row + sk : nullptr, cols, dst + kk * kCols, 8);
    }
    return;
  }
  scratch.assign(2 * kCols, 0);
  uint16_t* lo = scratch.data();
  uint16_t* hi = scratch.data() + kCols;
  for (int64_t kk = 0; kk < pairs; ++kk) {  // rows k0, k1 of the panel, interleaved
    const int64_t k0 = 2 * kk, k1 = 2 * kk + 1;
    convert_strided(b + k0 * sk + j0 * sn, sn, cols, lo, gather);
    if (k1 < k) {
      convert_strided(b + k1 * sk + j0 * sn, sn, cols, hi, gather);
    } else {
      std::fill(hi, hi + kCols, 0);
    }
    for (int64_t c = 0; c < cols; ++c) dst[kk * kCols + c] = pair(lo[c], hi[c]);
  }
}

// Rows [r0, r0 + rows) of the m x k left operand as bf16 pairs along k, in
// groups of kRows rows: block[group][k/2][kRows], zero-padded.
void pack_a(const float* a, int64_t sm, int64_t sk, int64_t k, int64_t r0, int64_t rows, int64_t pairs,
            uint32_t* block, std::vector<uint16_t>& scratch, std::vector<float>& gather) {
  const int64_t padded = (rows + kRows - 1) / kRows * kRows;
  std::fill(block, block + padded * pairs, 0u);
  auto at = [&](int64_t r, int64_t kk) -> uint32_t& { return block[(r / kRows) * pairs * kRows + kk * kRows + r % kRows]; };
  if (sm == 1 && sk != 1) {  // a transposed a: runs along the rows, two k at a time
    for (int64_t kk = 0; kk < pairs; ++kk) {
      const float* run = a + 2 * kk * sk + r0;
      pair_runs(run, 2 * kk + 1 < k ? run + sk : nullptr, rows, &at(0, kk), pairs * kRows);
    }
    return;
  }
  scratch.assign(2 * pairs, 0);
  const auto* pairs_of = reinterpret_cast<const uint32_t*>(scratch.data());
  for (int64_t r = 0; r < rows; ++r) {  // each row a run along k
    convert_strided(a + (r0 + r) * sm, sk, k, scratch.data(), gather);
    for (int64_t kk = 0; kk < pairs; ++kk) at(r, kk) = pairs_of[kk];
  }
}

// c[8 x 32] = alpha * a[group: k/2 x 8 pairs] . b[panel] + beta * c, masked
// to the valid rows and columns.
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
void microkernel(const uint32_t* a, int64_t pairs, const uint32_t* b, float* c, int64_t ldc, int64_t rows,
                 int64_t cols, float alpha, float beta) {
  __m512 acc[kRows][2];
  for (int r = 0; r < kRows; ++r) {
    acc[r][0] = _mm512_setzero_ps();
    acc[r][1] = _mm512_setzero_ps();
  }
  for (int64_t kk = 0; kk < pairs; ++kk) {
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(b + kk * kCols);
    const __m512bh b1 = (__m512bh)_mm512_loadu_si512(b + kk * kCols + 16);
#pragma GCC unroll 8
    for (int r = 0; r < kRows; ++r) {
      const __m512bh x = (__m512bh)_mm512_set1_epi32(static_cast<int>(a[kk * kRows + r]));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], x, b0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], x, b1);
    }
  }
  const __mmask16 m0 = cols >= 16 ? 0xffff : static_cast<__mmask16>((1u << cols) - 1);
  const __mmask16 m1 = cols >= 32 ? 0xffff : cols <= 16 ? 0 : static_cast<__mmask16>((1u << (cols - 16)) - 1);
  const __m512 va = _mm512_set1_ps(alpha), vb = _mm512_set1_ps(beta);
  for (int64_t r = 0; r < rows; ++r) {
    float* row = c + r * ldc;
    __m512 out0 = _mm512_mul_ps(acc[r][0], va), out1 = _mm512_mul_ps(acc[r][1], va);
    if (beta != 0.0f) {
      out0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m0, row), vb, out0);
      out1 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m1, row + 16), vb, out1);
    }
    _mm512_mask_storeu_ps(row, m0, out0);
    _mm512_mask_storeu_ps(row + 16, m1, out1);
  }
}

} // namespace

bool bf16_kernel_available() {
  static const bool available = __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl");
  return available;
}

namespace {

struct Scratch {
  std::vector<uint32_t> packed_a;
  std::vector<uint16_t> convert;
  std::vector<float> gather;
};

// Rows [r_begin, r_end) of c, columns of panels [p_begin, p_end), from packed
// b panels: pack each kRowBlock of a, then every (8-row group, panel) pair
// through the microkernel.
void gemm_rows(const float* a, int64_t sam, int64_t sak, const uint32_t* packed_b, float* c, int64_t ldc,
               int64_t r_begin, int64_t r_end, int64_t p_begin, int64_t p_end, int64_t n, int64_t k, float alpha,
               float beta, Scratch& s) {
  const int64_t pairs = (k + 1) / 2;
  s.packed_a.resize(static_cast<size_t>(kRowBlock * pairs));
  for (int64_t r0 = r_begin; r0 < r_end; r0 += kRowBlock) {
    const int64_t rows = std::min(kRowBlock, r_end - r0);
    pack_a(a, sam, sak, k, r0, rows, pairs, s.packed_a.data(), s.convert, s.gather);
    for (int64_t p = p_begin; p < p_end; ++p) {
      const int64_t j0 = p * kCols, cols = std::min(kCols, n - j0);
      for (int64_t r = 0; r < rows; r += kRows) {
        microkernel(s.packed_a.data() + r * pairs, pairs, packed_b + p * pairs * kCols, c + (r0 + r) * ldc + j0,
                    ldc, std::min(kRows, rows - r), cols, alpha, beta);
      }
    }
  }
}

} // namespace

void bf16_gemm_kernel(const float* a, int64_t sam, int64_t sak, const float* b, int64_t sbk, int64_t sbn,
                      float* c, int64_t ldc, int64_t m, int64_t n, int64_t k, float alpha, float beta) {
  const int64_t pairs = (k + 1) / 2, panels = (n + kCols - 1) / kCols;
  std::vector<uint32_t> packed_b(static_cast<size_t>(panels * pairs * kCols));
  at::parallel_for(0, panels, 1, [&](int64_t first, int64_t last) {
    Scratch s;
    for (int64_t p = first; p < last; ++p) {
      pack_b_panel(b, sbk, sbn, k, n, pairs, p, packed_b.data() + p * pairs * kCols, s.convert, s.gather);
    }
  });
  // Tasks are row blocks. With fewer blocks than threads (a weight gradient's
  // m is the layer's outputs, often 64 or fewer) one thread would do every
  // multiply-add: each block's panels are then split among the threads too,
  // which pack the block's a each. On a Zen 4 core pair: 64x2048 @ 2048x448
  // 1.30x faster, 64x2048 @ 2048x256 1.08-1.16x; below about 2^24
  // multiply-adds the second packing costs more than it saves (16x2048 @
  // 2048x64: 0.82x), so those stay whole. Each output is summed in the same
  // order either way.
  constexpr int64_t kMinSplitMacs = int64_t{1} << 24;
  const int64_t blocks = (m + kRowBlock - 1) / kRowBlock;
  const int64_t threads = at::get_num_threads();
  const int64_t splits =
      blocks >= threads || m * n * k < kMinSplitMacs ? 1 : std::min(panels, (threads + blocks - 1) / blocks);
  at::parallel_for(0, blocks * splits, 1, [&](int64_t first, int64_t last) {
    Scratch s;
    for (int64_t task = first; task < last; ++task) {
      const int64_t r0 = task / splits * kRowBlock, part = task % splits;
      gemm_rows(a, sam, sak, packed_b.data(), c, ldc, r0, std::min(m, r0 + kRowBlock), part * panels / splits,
                (part + 1) * panels / splits, n, k, alpha, beta, s);
    }
  });
}

void bf16_bmm_kernel(const float* a, int64_t sab, int64_t sam, int64_t sak, const float* b, int64_t sbb,
                     int64_t sbk, int64_t sbn, float* c, int64_t batch, int64_t m, int64_t n, int64_t k) {
  const int64_t pairs = (k + 1) / 2, panels = (n + kCols - 1) / kCols;
  // Small matrices (DLRM's interaction: 27 x 64 per sample): one thread per
  // matrix, packing and multiplying it whole.
  at::parallel_for(0, batch, 16, [&](int64_t first, int64_t last) {
    Scratch s;
    std::vector<uint32_t> packed_b(static_cast<size_t>(panels * pairs * kCols));
    for (int64_t i = first; i < last; ++i) {
      for (int64_t p = 0; p < panels; ++p) {
        pack_b_panel(b + i * sbb, sbk, sbn, k, n, pairs, p, packed_b.data() + p * pairs * kCols, s.convert, s.gather);
      }
      gemm_rows(a + i * sab, sam, sak, packed_b.data(), c + i * m * n, n, 0, m, 0, panels, n, k, 1.0f, 0.0f, s);
    }
  });
}

} // namespace torch_tpu
