#pragma once
// The CSR-wrapped COO layout the kernels share (sparsecore/preprocess.py
// describes it): receiver s's buffer holds its owner groups one after
// another, each starting at a multiple of kAlignment; row_pointers[s, o] is
// where group (s, o) ends within the receiver's row of width entries.

#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

namespace sparsecore {

constexpr int64_t kAlignment = 8;

inline int64_t align_up(int64_t x) {
  return (x + kAlignment - 1) / kAlignment * kAlignment;
}

// The buffer width for a receiver row of x entries: the next of kWidthsPerOctave
// geometric steps per power of two, a multiple of kAlignment (preprocess.py's
// bucket_width, which says why).
constexpr int64_t kWidthsPerOctave = 8;

inline int64_t bucket_width(int64_t x) {
  if (x <= kAlignment * kWidthsPerOctave) {
    return align_up(x);
  }
  int64_t octave = 1;
  while (octave * 2 < x) octave *= 2;  // the largest power of two below x
  const int64_t step = octave / kWidthsPerOctave;
  return (x + step - 1) / step * step;
}

// [begin, end) of every (receiver, owner) group in the flat (n x width) buffers, receiver-major.
inline std::vector<std::pair<int64_t, int64_t>> group_spans(const int32_t* row_pointers, int64_t n, int64_t width) {
  std::vector<std::pair<int64_t, int64_t>> out;
  out.reserve(n * n);
  for (int64_t s = 0; s < n; ++s) {
    int64_t start = 0;
    for (int64_t o = 0; o < n; ++o) {
      const int64_t end = row_pointers[s * n + o];
      out.emplace_back(s * width + start, s * width + end);
      start = align_up(end);
    }
  }
  return out;
}

// Bags are feature-major (bag f * batch_size + b); the pooled output is
// sample-major, so bag f * batch_size + b is output row b * slots + f and a
// stack's output is its (batch, slots x dim) block as it is.
struct OutputRows {
  int64_t batch_size;  // >= 1
  int64_t slots;
  int64_t operator()(int64_t bag) const { return bag % batch_size * slots + bag / batch_size; }
};

// A stack's COO buffers as the kernels read them.
struct Coo {
  const int32_t* ids;
  const int32_t* samples;
  const float* gains;
  std::vector<std::pair<int64_t, int64_t>> spans;  // group_spans
  int64_t n;
  int64_t rows_per_sc;
  OutputRows row_of;
};

// Asks for [p, p + bytes) ahead of use, to read. Random rows come from DRAM,
// and keeping several requests in flight is what makes a gather fast.
// prefetcht2 (locality 1), not prefetchnta: on a Sapphire Rapids core the
// non-temporal hint made the COO lookup 2.7x slower than T2 (d64, batch 8192,
// pooling 20, uniform: 60.1 vs 23.0 ms; pooling 100: 286 vs 94 ms) and 2x
// slower than no prefetch at all; T2 beat T0 and no prefetch everywhere.
inline void prefetch_bytes(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t offset = 0; offset < bytes; offset += 64) __builtin_prefetch(c + offset, 0, 1);
}

// Calls f(std::integral_constant<int64_t, K>{}) with K = dim for the common
// row widths, else K = 0 (any width): kernels compiled for a known width keep
// a row in vector registers and unroll its loops.
template <typename F>
decltype(auto) with_row_width(int64_t dim, F&& f) {
  switch (dim) {
    case 32: return f(std::integral_constant<int64_t, 32>{});
    case 64: return f(std::integral_constant<int64_t, 64>{});
    case 128: return f(std::integral_constant<int64_t, 128>{});
    default: return f(std::integral_constant<int64_t, 0>{});
  }
}

} // namespace sparsecore
