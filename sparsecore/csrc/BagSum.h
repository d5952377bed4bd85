#pragma once
// Summing a bag's rows into its output row: shared by the COO lookup
// (Lookup.cpp) and the lookup fused into preprocessing (Preprocess.cpp), so
// that both give the same bits for the same entries in the same order, and
// by the inference lookup (InferenceLookup.cpp).

#include <cstdint>
#include <type_traits>

#ifdef __AVX__
#include <immintrin.h>
#endif

namespace sparsecore {

// One bag's fp32 sum: clear(), add(row, gain) per entry (acc += gain * row,
// fused multiply-adds), store(dst). kDim > 0: the row width known at compile
// time; fp32 rows of a multiple of 8 are summed in AVX registers explicitly
// (left to the compiler, a loop around add() may be unrolled and jammed into
// scalar code); kDim == 0: any width, through `scratch` (dim floats).
template <typename scalar_t, int64_t kDim>
class BagSum {
#if defined(__AVX__) && defined(__FMA__)
  static constexpr bool kVector = std::is_same_v<scalar_t, float> && kDim > 0 && kDim % 8 == 0;
#else
  static constexpr bool kVector = false;
#endif

 public:
  BagSum(int64_t dim, float* scratch) : dim_(kDim > 0 ? kDim : dim), scratch_(scratch) {}

  void clear() {
    if constexpr (kVector) {
#if defined(__AVX__) && defined(__FMA__)
      for (int64_t i = 0; i < kDim / 8; ++i) v_[i] = _mm256_setzero_ps();
#endif
    } else {
      float* acc = accumulator();
      for (int64_t d = 0; d < dim_; ++d) acc[d] = 0.0f;
    }
  }

  void add(const scalar_t* __restrict row, float gain) {
    if constexpr (kVector) {
#if defined(__AVX__) && defined(__FMA__)
      const __m256 g = _mm256_set1_ps(gain);
      for (int64_t i = 0; i < kDim / 8; ++i) v_[i] = _mm256_fmadd_ps(g, _mm256_loadu_ps(row + 8 * i), v_[i]);
#endif
    } else {
      float* __restrict acc = accumulator();
      for (int64_t d = 0; d < dim_; ++d) acc[d] += gain * static_cast<float>(row[d]);
    }
  }

  // Writes the sum once. Whole 64-byte lines are streamed past the cache:
  // the rows of a batch are scattered over a large output and are not read
  // again here, so reading each line in before overwriting it (what a normal
  // store does) would double the output's memory traffic. Callers end with
  // stream_fence() before the output is read.
  void store(float* __restrict dst) {
    if constexpr (kVector) {
#if defined(__AVX__) && defined(__FMA__)
      if (kDim % 16 == 0 && (reinterpret_cast<uintptr_t>(dst) & 63) == 0) {
        for (int64_t i = 0; i < kDim / 8; ++i) _mm256_stream_ps(dst + 8 * i, v_[i]);
      } else {
        for (int64_t i = 0; i < kDim / 8; ++i) _mm256_storeu_ps(dst + 8 * i, v_[i]);
      }
#endif
    } else {
      const float* acc = accumulator();
      for (int64_t d = 0; d < dim_; ++d) dst[d] = acc[d];
    }
  }

 private:
  float* accumulator() { return kDim > 0 ? fixed_ : scratch_; }

  int64_t dim_;
#if defined(__AVX__) && defined(__FMA__)
  __m256 v_[kVector ? kDim / 8 : 1];
#endif
  float fixed_[kDim > 0 && !kVector ? kDim : 1];
  float* scratch_;
};

// Makes BagSum::store's streaming stores visible before the output is read.
inline void stream_fence() {
#ifdef __AVX__
  _mm_sfence();
#endif
}

}  // namespace sparsecore
