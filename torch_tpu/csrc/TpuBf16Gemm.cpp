#include "TpuBf16Gemm.h"

#include "TpuBf16Kernel.h"
#include "TpuGemmOperands.h"
#include "TpuOnednn.h"
#include "TpuPrecision.h"

#include <ATen/ops/_to_copy.h>
#include <ATen/ops/empty.h>

#include <ATen/Parallel.h>
#include <ATen/cpu/Utils.h>
#include <ATen/native/CPUBlas.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

namespace torch_tpu {
namespace {

// fp32 operands already rounded to bf16 values: oneDNN's bf16 math mode then
// multiplies them exactly on the bf16 units and accumulates in fp32, which is
// the MXU's single pass. Strides are kept where oneDNN reads them (a
// transposed weight stays so).
at::Tensor rounded(const at::Tensor& t) {
  at::Tensor r = round_to_bf16(t);
  const int64_t d = r.dim();
  const int64_t rows_n = r.size(d - 2), cols_n = r.size(d - 1), s_row = r.stride(d - 2), s_col = r.stride(d - 1);
  const bool rows = s_col == 1 && s_row >= std::max<int64_t>(cols_n, 1);
  const bool cols = s_row == 1 && s_col >= std::max<int64_t>(rows_n, 1);
  const bool batch_dense = d == 2 || r.stride(0) >= rows_n * cols_n;
  return (rows || cols) && batch_dense ? r : r.contiguous();
}

// oneDNN's bf16 math mode needs AVX512 BW/VL/DQ (or AVX-NE-CONVERT, which
// this check leaves to the rounding path): on an AVX2-only CPU ATen raises
// "mkldnn_matmul bf16 path needs the cpu support ...".
bool onednn_bf16_available() {
  static const bool available = __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512dq");
  return available;
}

bool cpu_has_amx_bf16() {
  static const bool has = [] {
    const auto caps = at::cpu::get_cpu_capabilities();
    const auto it = caps.find("amx_bf16");
    return it != caps.end() && it->second.isBool() && it->second.toBool();
  }();
  return has;
}

// out = beta * out + alpha * bf16(a) @ bf16(b) through oneDNN's bf16 mode;
// 2-D or batched 3-D operands.
void onednn_bf16_matmul(const at::Tensor& a, const at::Tensor& b, const at::Tensor& out, float beta, float alpha) {
  onednn_matmul(rounded(a), rounded(b), out, beta, alpha, at::Float32Precision::BF16);
}

// Whether medium matmuls run our AVX512-BF16 kernel or oneDNN: oneDNN where
// the CPU has AMX tiles - at DLRM's shapes on a Sapphire Rapids core,
// 650-1000 GFLOP/s against the kernel's 180-220 (operand rounding included).
// TORCH_TPU_BF16_KERNEL=0 / 1 forces oneDNN / the kernel.
bool bf16_kernel_in_use() {
  static const bool use = [] {
    const char* env = std::getenv("TORCH_TPU_BF16_KERNEL");
    if (env != nullptr && std::string(env) == "0") {
      return false;
    }
    const bool forced = env != nullptr && std::string(env) == "1";
    return bf16_kernel_available() && (forced || !cpu_has_amx_bf16());
  }();
  return use;
}

// GEMMs on AMX tiles through oneDNN's batch-reduce micro-kernel (ATen's
// cpublas::brgemm): operands converted to bf16 block by block where they are
// used, products accumulated straight into the fp32 result. Against oneDNN's
// bf16 math mode over fp32 operands, measured here: 256^3 78-88 -> 44-46 us
// (row-major or transposed operands), 2048x512x256 587 -> 318 us, 1024^3 2.24
// -> 1.57 ms, 2048x4096x4096 86 -> 57 ms; attention's bmm, 128 x (128x64 @
// 64x128), 827 -> 468 us.
constexpr int64_t kTileRows = 32;  // rows of the result per micro-kernel call
constexpr int64_t kTileCols = 64;  // columns: one packed panel of b

bool tiles_available() {
  static const bool available = cpu_has_amx_bf16() && at::native::cpublas::could_pack(at::kBFloat16);
  return available;
}

// A matrix (or each of a batch, the last two dimensions) row-major, or the
// transpose of a row-major one (a Linear's weight in its forward, the
// activations in its weight gradient, attention's keys).
bool in_rows(const at::Tensor& t) {
  return t.is_contiguous();
}

bool in_columns(const at::Tensor& t) {
  return t.transpose(-2, -1).is_contiguous();
}

// a (..., m, k) @ b (..., k, n), 2-D or batched alike. TORCH_TPU_TILE_GEMM=0
// turns tiles off.
bool tiles_take(const at::Tensor& a, const at::Tensor& b, float alpha) {
  static const bool enabled = [] {
    const char* env = std::getenv("TORCH_TPU_TILE_GEMM");
    return env == nullptr || std::string(env) != "0";
  }();
  return enabled && tiles_available() && alpha == 1.0f && (in_rows(a) || in_columns(a)) &&
      (in_rows(b) || in_columns(b));
}

// The micro-kernel multiplies row pairs: an odd inner dimension gets a zero
// row (of b) and column (of a).
int64_t even(int64_t k) {
  return k + (k & 1);
}

// The 8x8 block of 32-bit values at src (rows src_ld apart) transposed in
// registers: out[q] is the block's column q.
__attribute__((target("avx2"), always_inline)) inline void transpose8x8(const float* src, int64_t src_ld,
                                                                        __m256 out[8]) {
  __m256 r[8], t[8], u[8];
  for (int q = 0; q < 8; ++q) r[q] = _mm256_loadu_ps(src + q * src_ld);
  for (int q = 0; q < 4; ++q) {
    t[2 * q] = _mm256_unpacklo_ps(r[2 * q], r[2 * q + 1]);
    t[2 * q + 1] = _mm256_unpackhi_ps(r[2 * q], r[2 * q + 1]);
  }
  for (int h = 0; h < 2; ++h) {  // rows 0-3 (h = 0) and 4-7
    u[4 * h + 0] = _mm256_shuffle_ps(t[4 * h], t[4 * h + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * h + 1] = _mm256_shuffle_ps(t[4 * h], t[4 * h + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[4 * h + 2] = _mm256_shuffle_ps(t[4 * h + 1], t[4 * h + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * h + 3] = _mm256_shuffle_ps(t[4 * h + 1], t[4 * h + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int q = 0; q < 4; ++q) {
    out[q] = _mm256_permute2f128_ps(u[q], u[4 + q], 0x20);
    out[4 + q] = _mm256_permute2f128_ps(u[q], u[4 + q], 0x31);
  }
}

// dst (cols x rows) = the transpose of src (rows x cols), 32-bit words (bf16
// pairs), both row-major with leading dimensions src_ld and dst_ld.
__attribute__((target("avx2"))) void transpose_words(const uint32_t* src, int64_t rows, int64_t cols,
                                                     int64_t src_ld, uint32_t* dst, int64_t dst_ld) {
  const int64_t rows8 = rows / 8 * 8, cols8 = cols / 8 * 8;
  for (int64_t i = 0; i < rows8; i += 8) {
    for (int64_t j = 0; j < cols8; j += 8) {
      __m256 column[8];
      transpose8x8(reinterpret_cast<const float*>(src + i * src_ld + j), src_ld, column);
      for (int q = 0; q < 8; ++q) _mm256_storeu_ps(reinterpret_cast<float*>(dst + (j + q) * dst_ld + i), column[q]);
    }
  }
  for (int64_t i = 0; i < rows; ++i) {  // the edges
    for (int64_t j = (i < rows8 ? cols8 : 0); j < cols; ++j) dst[j * dst_ld + i] = src[i * src_ld + j];
  }
}

// Which bf16 part of an fp32 value a conversion keeps: hi = bf16(x) (round to
// nearest even), or high precision's lo = bf16(x - hi).
enum class Part { kHi, kLo };

// The part of 8 / 16 values, in bf16.
__attribute__((target("avx2,avx512f,avx512vl,avx512bf16"), always_inline)) inline __m128bh part8(__m256 v, Part part) {
  const __m128bh hi = _mm256_cvtneps_pbh(v);
  if (part == Part::kHi) return hi;
  const __m256 hi32 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32((__m128i)hi), 16));
  return _mm256_cvtneps_pbh(_mm256_sub_ps(v, hi32));
}

// GCC 12 warns of an uninitialized value inside its own headers' 512-bit
// widening and shift intrinsics (their unmasked forms pass an undefined source).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"), always_inline)) inline __m256bh part16(__m512 v,
                                                                                                      Part part) {
  const __m256bh hi = _mm512_cvtneps_pbh(v);
  if (part == Part::kHi) return hi;
  const __m512 hi32 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)hi), 16));
  return _mm512_cvtneps_pbh(_mm512_sub_ps(v, hi32));
}
#pragma GCC diagnostic pop

at::BFloat16 part1(float v, Part part) {
  const at::BFloat16 hi(v);
  return part == Part::kHi ? hi : at::BFloat16(v - static_cast<float>(hi));
}

// dst (cols x rows, bf16) = the transpose of src (rows x cols, fp32), both
// row-major with leading dimensions src_ld and dst_ld, converted to the bf16
// part on the way out. Only where tiles are (AMX implies AVX512-BF16). Our
// own: ATen's copy of a transposed 256x256 took 34 us against 7 for a plain
// one.
__attribute__((target("avx2,avx512f,avx512vl,avx512bf16"))) void transpose_to_bf16(
    const float* src, int64_t rows, int64_t cols, int64_t src_ld, at::BFloat16* dst, int64_t dst_ld, Part part) {
  const int64_t rows8 = rows / 8 * 8, cols8 = cols / 8 * 8;
  for (int64_t i = 0; i < rows8; i += 8) {
    for (int64_t j = 0; j < cols8; j += 8) {
      __m256 column[8];
      transpose8x8(src + i * src_ld + j, src_ld, column);
      for (int q = 0; q < 8; ++q) {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + (j + q) * dst_ld + i), (__m128i)part8(column[q], part));
      }
    }
  }
  for (int64_t i = 0; i < rows; ++i) {  // the edges
    for (int64_t j = (i < rows8 ? cols8 : 0); j < cols; ++j) dst[j * dst_ld + i] = part1(src[i * src_ld + j], part);
  }
}

// dst[0, n) = the bf16 part of src[0, n), 16 at a time.
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) void to_bf16(const float* src, int64_t n,
                                                                           at::BFloat16* dst, Part part) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), (__m256i)part16(_mm512_loadu_ps(src + i), part));
  }
  if (i < n) {
    const __mmask16 rest = static_cast<__mmask16>((1u << (n - i)) - 1);
    _mm256_mask_storeu_epi16(dst + i, rest, (__m256i)part16(_mm512_maskz_loadu_ps(rest, src + i), part));
  }
}

// Per thread, reused: a block of an operand in bf16, converted where it is used
// (in L1 or L2) rather than the whole operand through memory first; a result
// tile of a last, partial panel.
template <typename T>
T* scratch(size_t n) {
  thread_local std::vector<T> buffer;
  if (buffer.size() < n) buffer.resize(n);
  return buffer.data();
}

// rows of `length` values, src rows src_ld apart, into dst rows of `width`
// (>= length) bf16 parts, zero past length.
void rows_to_bf16(const float* src, int64_t rows, int64_t length, int64_t src_ld, at::BFloat16* dst, int64_t width,
                  Part part) {
  if (length == width && src_ld == length) {
    to_bf16(src, rows * length, dst, part);
    return;
  }
  for (int64_t i = 0; i < rows; ++i) {
    to_bf16(src + i * src_ld, length, dst + i * width, part);
    std::fill(dst + i * width + length, dst + (i + 1) * width, at::BFloat16(0.0f));
  }
}

// b (batch, k, n), in rows or columns, as ceil(n / kTileCols) column panels
// a matrix in the micro-kernel's layout, even(k) rows each (the last panel's
// missing columns and an odd k's extra row zero): panel p holds
// b[kk][p * kTileCols + c] at [kk / 2][c][kk % 2], each row pair of a column
// one 32-bit word. For b in columns (b = w.t(), w row-major), a column's row
// pairs are adjacent in w: the panel is the transpose of w's rows taken as
// 32-bit words.
at::Tensor rhs_panels(const at::Tensor& b, Part part) {
  const int64_t batch = b.size(0), k = b.size(1), n = b.size(2), kp = even(k);
  const int64_t panels_n = (n + kTileCols - 1) / kTileCols;
  const bool rows_in = in_rows(b);
  const float* source = (rows_in ? b : b.transpose(1, 2)).const_data_ptr<float>();  // (batch, k, n) or (batch, n, k)
  at::Tensor panels = at::empty({batch, panels_n, kp, kTileCols}, b.options().dtype(at::kBFloat16));
  at::BFloat16* pp = panels.mutable_data_ptr<at::BFloat16>();
  at::parallel_for(0, batch * panels_n, 1, [&](int64_t first, int64_t last) {
    at::BFloat16* block = scratch<at::BFloat16>(kp * kTileCols);
    for (int64_t task = first; task < last; ++task) {
      const float* matrix = source + task / panels_n * k * n;
      const int64_t p = task % panels_n, cols = std::min(kTileCols, n - p * kTileCols);
      at::BFloat16* panel = pp + task * kp * kTileCols;
      if (rows_in) {  // the panel's columns: kp rows of kTileCols
        rows_to_bf16(matrix + p * kTileCols, k, cols, n, block, kTileCols, part);
        std::fill(block + k * kTileCols, block + kp * kTileCols, at::BFloat16(0.0f));
        at::native::cpublas::pack(kp, kTileCols, kTileCols, kTileCols, at::kBFloat16, at::kBFloat16, block, panel);
      } else {  // the panel's kTileCols rows of w, kp long
        rows_to_bf16(matrix + p * kTileCols * k, cols, k, k, block, kp, part);
        std::fill(block + cols * kp, block + kTileCols * kp, at::BFloat16(0.0f));
        transpose_words(reinterpret_cast<const uint32_t*>(block), kTileCols, kp / 2, kp / 2,
                        reinterpret_cast<uint32_t*>(panel), kTileCols);
      }
    }
  });
  return panels;
}

// out (fp32, contiguous (batch, m, n)) = beta * out + part(a) @ b for a
// (batch, m, k) in rows or columns (tiles_take) and b's panels (rhs_panels of
// a (batch, k, n)); beta 0 ignores out's contents. A task is kTileRows rows of
// one result: a's rows converted once into a block, then every panel of b.
void tiles_gemm(const at::Tensor& a, Part part, const at::Tensor& panels, int64_t n, const at::Tensor& out,
                float beta) {
  const int64_t batch = a.size(0), m = a.size(1), k = a.size(2), kp = even(k);
  if (beta != 0.0f && beta != 1.0f) {
    out.mul_(beta);
  }
  const bool rows_in = in_rows(a);
  const float* source = (rows_in ? a : a.transpose(1, 2)).const_data_ptr<float>();  // (batch, m, k) or (batch, k, m)
  const at::BFloat16* pp = panels.const_data_ptr<at::BFloat16>();
  float* op = out.mutable_data_ptr<float>();
  const int64_t row_tiles = (m + kTileRows - 1) / kTileRows, col_tiles = (n + kTileCols - 1) / kTileCols;
  const int64_t last_cols = n - (col_tiles - 1) * kTileCols;  // of the last panel
  at::parallel_for(0, batch * row_tiles, 1, [&](int64_t first, int64_t last) {
    at::BFloat16* block = scratch<at::BFloat16>(kTileRows * kp);
    float* edge = scratch<float>(kTileRows * kTileCols);  // the last panel's result, when partial
    for (int64_t task = first; task < last; ++task) {
      const int64_t e = task / row_tiles, r = task % row_tiles * kTileRows, rows = std::min(kTileRows, m - r);
      const float* matrix = source + e * m * k;
      if (rows_in) {
        rows_to_bf16(matrix + r * k, rows, k, k, block, kp, part);
      } else {
        transpose_to_bf16(matrix + r, k, rows, m, block, kp, part);
        for (int64_t i = 0; i < rows && k < kp; ++i) block[i * kp + k] = at::BFloat16(0.0f);
      }
      for (int64_t c = 0; c < col_tiles; ++c) {
        const at::BFloat16* panel = pp + (e * col_tiles + c) * kp * kTileCols;
        float* result = op + (e * m + r) * n + c * kTileCols;
        if (c + 1 < col_tiles || last_cols == kTileCols) {
          at::native::cpublas::brgemm(rows, kTileCols, kp, kp, kTileCols, n, beta != 0.0f, block, panel, result, true);
          continue;
        }
        for (int64_t i = 0; i < rows && beta != 0.0f; ++i) std::copy_n(result + i * n, last_cols, edge + i * kTileCols);
        at::native::cpublas::brgemm(rows, kTileCols, kp, kp, kTileCols, kTileCols, beta != 0.0f, block, panel, edge,
                                    true);
        for (int64_t i = 0; i < rows; ++i) std::copy_n(edge + i * kTileCols, last_cols, result + i * n);
      }
    }
    at::native::cpublas::brgemm_release(true);
  });
}

// out = beta * out + bf16(a) @ bf16(b), a (batch, m, k) and b (batch, k, n): medium's
// single pass (tiles_take).
void tiles_product(const at::Tensor& a, const at::Tensor& b, const at::Tensor& out, float beta) {
  tiles_gemm(a, Part::kHi, rhs_panels(b, Part::kHi), b.size(2), out, beta);
}

// The result's starting value and the beta the GEMM applies to it: bias
// broadcast to (m, n) when beta is not 0 (a copy: the GEMM writes it), else
// uninitialized memory (beta 0).
std::pair<at::Tensor, float> initial_result(const at::Tensor& a, const at::Tensor& b, const at::Tensor& bias,
                                            float beta) {
  const int64_t m = a.size(0), n = b.size(1);
  if (bias.defined() && beta != 0.0f) {
    return {at::_to_copy(bias.expand({m, n}), at::kFloat, std::nullopt, std::nullopt, std::nullopt, false,
                         c10::MemoryFormat::Contiguous),
            beta};
  }
  return {at::empty({m, n}, a.options()), 0.0f};
}

} // namespace

at::Tensor bf16x3_gemm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& bias, float beta, float alpha) {
  if (!plain_product(a, b) || !tiles_take(a, b, alpha)) {
    return {};
  }
  // The parts are taken where the blocks are converted, not split in memory first.
  auto [out, gemm_beta] = initial_result(a, b, bias, beta);
  const at::Tensor lhs = a.unsqueeze(0), rhs = b.unsqueeze(0), result = out.unsqueeze(0);
  const int64_t n = b.size(1);
  const at::Tensor b_hi = rhs_panels(rhs, Part::kHi);
  tiles_gemm(lhs, Part::kHi, b_hi, n, result, gemm_beta);
  tiles_gemm(lhs, Part::kHi, rhs_panels(rhs, Part::kLo), n, result, 1.0f);
  tiles_gemm(lhs, Part::kLo, b_hi, n, result, 1.0f);
  return out;
}

at::Tensor bf16_gemm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& bias,
                     float beta, float alpha) {
  if (!plain_product(a, b) || !(bf16_kernel_in_use() || onednn_bf16_available())) {
    return {};  // the caller's rounding path
  }
  const int64_t m = a.size(0), k = a.size(1), n = b.size(1);
  auto [out, gemm_beta] = initial_result(a, b, bias, beta);
  if (tiles_take(a, b, alpha)) {
    tiles_product(a.unsqueeze(0), b.unsqueeze(0), out.unsqueeze(0), gemm_beta);
    return out;
  }
  if (bf16_kernel_in_use()) {  // packing reads any strides and rounds on the way
    bf16_gemm_kernel(a.const_data_ptr<float>(), a.stride(0), a.stride(1), b.const_data_ptr<float>(), b.stride(0),
                     b.stride(1), out.mutable_data_ptr<float>(), n, m, n, k, alpha, gemm_beta);
    return out;
  }
  onednn_bf16_matmul(a, b, out, gemm_beta, alpha);
  return out;
}

at::Tensor bf16_bmm(const at::Tensor& a, const at::Tensor& b) {
  // oneDNN takes batched matmuls only on AMX; without AMX or the kernel,
  // callers keep their small-matrix and rounding paths.
  if (a.dim() != 3 || b.dim() != 3 || a.scalar_type() != at::kFloat || b.scalar_type() != at::kFloat ||
      !(bf16_kernel_in_use() || (cpu_has_amx_bf16() && onednn_bf16_available()))) {
    return {};
  }
  const int64_t batch = a.size(0), m = a.size(1), k = a.size(2), n = b.size(2);
  TORCH_CHECK(b.size(0) == batch && b.size(1) == k, "Expected size for first two dimensions of batch2 tensor to be: [",
              batch, ", ", k, "] but got: [", b.size(0), ", ", b.size(1), "].");
  at::Tensor out = at::empty({batch, m, n}, a.options());
  if (out.numel() == 0) {
    return out;
  }
  if (k == 0) {
    return out.zero_();
  }
  if (tiles_take(a, b, 1.0f)) {
    tiles_product(a, b, out, 0.0f);
    return out;
  }
  if (!bf16_kernel_in_use()) {
    onednn_bf16_matmul(a, b, out, 0.0f, 1.0f);
    return out;
  }
  bf16_bmm_kernel(a.const_data_ptr<float>(), a.stride(0), a.stride(1), a.stride(2), b.const_data_ptr<float>(),
                  b.stride(0), b.stride(1), b.stride(2), out.mutable_data_ptr<float>(), batch, m, n, k);
  return out;
}

} // namespace torch_tpu
