// The fused backward of a stack: the pooled gradient becomes one gradient
// per touched row, and the optimizer updates that row and its state in place.
// No dense table gradient is ever formed.
//
// Rows of different owners are disjoint, and so are rows in different
// buckets (row mod k) of one owner: each (owner, bucket) task gathers its
// entries from every receiver, radix-sorts them by row, and walks the runs:
// sum a run's gradients, step the optimizer on its row, with the rows ahead
// prefetched. One parameterised kernel serves every optimizer.

#include "Layout.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <atomic>
#include <cmath>
#include <optional>
#include <tuple>
#include <vector>

namespace sparsecore {
namespace {

constexpr size_t kPrefetchDistance = 8;

inline void prefetch(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t offset = 0; offset < bytes; offset += 64) {
    __builtin_prefetch(c + offset, 1, 0);
  }
}

enum Optimizer : int64_t { kSGD = 0, kAdagrad = 1, kRowWiseAdagrad = 2, kAdam = 3, kFTRL = 4 };

// The optimizer's numbers, read from a float64 [6] tensor; meaning per optimizer
// (sparsecore/optim.py): SGD [lr]; Adagrad, RowWiseAdagrad [lr, eps];
// Adam [lr, eps, beta1, beta2]; FTRL [lr, l1, l2, beta, lr_power].
struct Hyper {
  float p[6];
  int64_t step;
  float lr() const { return p[0]; }
};

// Sorts (row << 32 | entry) keys by row: LSD radix, 8 bits a pass, only
// over the bits rows use. Equal rows keep entry order.
void sort_by_row(std::vector<uint64_t>& keys, std::vector<uint64_t>& scratch, int row_bits) {
  scratch.resize(keys.size());
  for (int shift = 32; shift < 32 + row_bits; shift += 8) {
    size_t count[257] = {0};
    for (uint64_t k : keys) ++count[((k >> shift) & 0xff) + 1];
    for (int i = 0; i < 256; ++i) count[i + 1] += count[i];
    for (uint64_t k : keys) scratch[count[(k >> shift) & 0xff]++] = k;
    keys.swap(scratch);
  }
}

// row_mean_sq: row-wise Adagrad's mean squared gradient of the whole row when
// this table holds only some of its columns (given by the caller); nullptr:
// computed here from g.
template <typename scalar_t>
void step_row(scalar_t* w, const float* g, int64_t dim, int64_t optimizer, const Hyper& h,
              float* s0, float* s1, const float* row_mean_sq = nullptr) {
  switch (optimizer) {
    case kSGD:
      for (int64_t d = 0; d < dim; ++d) w[d] = static_cast<float>(w[d]) - h.lr() * g[d];
      break;
    case kAdagrad: {  // s0: per-element sum of squares
      const float eps = h.p[1];
      for (int64_t d = 0; d < dim; ++d) {
        s0[d] += g[d] * g[d];
        w[d] = static_cast<float>(w[d]) - h.lr() * g[d] / (std::sqrt(s0[d]) + eps);
      }
      break;
    }
    case kRowWiseAdagrad: {  // s0: one accumulator for the row
      float mean_sq = 0;
      for (int64_t d = 0; d < dim; ++d) mean_sq += g[d] * g[d];
      s0[0] += row_mean_sq ? *row_mean_sq : mean_sq / static_cast<float>(dim);
      const float scale = h.lr() / (std::sqrt(s0[0]) + h.p[1]);
      for (int64_t d = 0; d < dim; ++d) w[d] = static_cast<float>(w[d]) - scale * g[d];
      break;
    }
    case kAdam: {  // s0, s1: moments; lazy, as torch.optim.SparseAdam
      const float eps = h.p[1], beta1 = h.p[2], beta2 = h.p[3];
      const double step = static_cast<double>(h.step);
      const float step_size = static_cast<float>(
          h.lr() * std::sqrt(1 - std::pow(static_cast<double>(beta2), step)) /
          (1 - std::pow(static_cast<double>(beta1), step)));
      for (int64_t d = 0; d < dim; ++d) {
        s0[d] += (g[d] - s0[d]) * (1 - beta1);
        s1[d] = s1[d] * beta2 + (1 - beta2) * g[d] * g[d];
        w[d] = static_cast<float>(w[d]) - step_size * s0[d] / (std::sqrt(s1[d]) + eps);
      }
      break;
    }
    case kFTRL: {  // s0: accumulator, s1: linear; FTRL-Proximal with beta (TF's ApplyFtrlV2)
      const float lr = h.lr(), l1 = h.p[1], l2 = h.p[2], beta = h.p[3], power = h.p[4];
      for (int64_t d = 0; d < dim; ++d) {
        const float accum = s0[d] + g[d] * g[d];
        const float sigma = (std::pow(accum, -power) - std::pow(s0[d], -power)) / lr;
        s1[d] += g[d] - sigma * static_cast<float>(w[d]);
        s0[d] = accum;
        const float quadratic = (std::pow(accum, -power) + beta) / lr + 2 * l2;
        const float linear = s1[d];
        w[d] = std::abs(linear) > l1 ? (std::copysign(l1, linear) - linear) / quadratic : 0.0f;
      }
      break;
    }
    default:
      TORCH_CHECK(false, "unknown optimizer ", optimizer);
  }
}

Hyper read_hyper(const at::Tensor& hyper, const at::Tensor& step) {
  TORCH_CHECK(hyper.numel() == 6 && hyper.scalar_type() == at::kDouble, "sparsecore update: hyper must be float64 [6]");
  TORCH_CHECK(step.numel() == 1 && step.scalar_type() == at::kLong, "sparsecore update: step must be one int64");
  const double* hp = hyper.const_data_ptr<double>();
  Hyper h{};
  for (int i = 0; i < 6; ++i) h.p[i] = static_cast<float>(hp[i]);
  h.step = ++step.mutable_data_ptr<int64_t>()[0];
  return h;
}

// Calls on_row(physical row, summed gradient) once for every row a stack's COO
// buffers touch, in parallel over (owner, bucket of rows) tasks (rows of
// different tasks never meet); prefetch(physical row) is called ahead.
template <typename OnRow, typename Prefetch>
void for_each_touched_row(const at::Tensor& grad_output, const at::Tensor& row_pointers,
                          const at::Tensor& embedding_ids, const at::Tensor& sample_ids, const at::Tensor& gains,
                          int64_t batch_size, int64_t rows_per_sc, const OnRow& on_row, const Prefetch& ahead) {
  const int64_t n = row_pointers.size(0);
  const int64_t width = embedding_ids.size(1);
  const int64_t dim = grad_output.size(1);
  // A bag's gradient is in the output row the lookup wrote it to.
  const int64_t bags_per_slot = std::max<int64_t>(batch_size, 1);
  const OutputRows grad_row{bags_per_slot, grad_output.size(0) / bags_per_slot};
  const auto grad = grad_output.contiguous().to(at::kFloat);
  const auto rp = row_pointers.contiguous();
  const auto ids = embedding_ids.contiguous();
  const auto samples = sample_ids.contiguous();
  const auto gn = gains.contiguous();
  const auto spans = group_spans(rp.const_data_ptr<int32_t>(), n, width);
  const int32_t* idp = ids.const_data_ptr<int32_t>();
  const int32_t* sp = samples.const_data_ptr<int32_t>();
  const float* gp = gn.const_data_ptr<float>();
  const float* go = grad.const_data_ptr<float>();
  const int64_t buckets = std::max<int64_t>(1, 2 * at::get_num_threads() / n);
  int row_bits = 1;
  while ((int64_t{1} << row_bits) < rows_per_sc) ++row_bits;
  at::parallel_for(0, n * buckets, 1, [&](int64_t first, int64_t last) {
    std::vector<uint64_t> keys, scratch;
    std::vector<float> acc(dim);
    for (int64_t task = first; task < last; ++task) {
      const int64_t owner = task / buckets, bucket = task % buckets;
      keys.clear();
      for (int64_t s = 0; s < n; ++s) {
        const auto [begin, end] = spans[s * n + owner];
        for (int64_t e = begin; e < end; ++e) {
          if (idp[e] % buckets == bucket) {
            keys.push_back(static_cast<uint64_t>(idp[e]) << 32 | static_cast<uint64_t>(e));
          }
        }
      }
      sort_by_row(keys, scratch, row_bits);
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (size_t i = 0; i < keys.size(); ++i) {
        if (i + kPrefetchDistance < keys.size()) {
          // Gradient rows and touched table rows are scattered: fetch ahead.
          const uint64_t k = keys[i + kPrefetchDistance];
          prefetch(go + grad_row(sp[k & 0xffffffffu]) * dim, dim * 4);
          ahead(owner * rows_per_sc + static_cast<int64_t>(k >> 32));
        }
        const int64_t e = static_cast<int64_t>(keys[i] & 0xffffffffu);
        const float* g = go + grad_row(sp[e]) * dim;
        const float gain = gp[e];
        for (int64_t d = 0; d < dim; ++d) acc[d] += gain * g[d];
        const int64_t row = static_cast<int64_t>(keys[i] >> 32);
        if (i + 1 == keys.size() || static_cast<int64_t>(keys[i + 1] >> 32) != row) {
          on_row(owner * rows_per_sc + row, acc.data());
          std::fill(acc.begin(), acc.end(), 0.0f);
        }
      }
    }
  });
}

struct StatePointers {
  float* s0;
  float* s1;
  int64_t s0_width;  // 1 for a row-wise statistic, else dim
  StatePointers(at::TensorList state, int64_t dim)
      : s0(state.size() > 0 ? state[0].mutable_data_ptr<float>() : nullptr),
        s1(state.size() > 1 ? state[1].mutable_data_ptr<float>() : nullptr),
        s0_width(state.size() > 0 && state[0].dim() == 1 ? 1 : dim) {}
  float* first(int64_t r) const { return s0 ? s0 + r * s0_width : nullptr; }
  float* second(int64_t r, int64_t dim) const { return s1 ? s1 + r * dim : nullptr; }
};

// step: int64 [1], the stack's update count, incremented here (Adam's bias
// correction). hyper: float64 [6] on the host (see Hyper), so the learning
// rate can change between steps without a new graph.
void backward_update(const at::Tensor& weight, at::TensorList state, const at::Tensor& step,
                     const at::Tensor& grad_output, const at::Tensor& row_pointers,
                     const at::Tensor& embedding_ids, const at::Tensor& sample_ids,
                     const at::Tensor& gains, int64_t batch_size, int64_t optimizer,
                     const at::Tensor& hyper) {
  TORCH_CHECK(weight.is_contiguous() && weight.dim() == 2, "backward_update: weight must be a contiguous 2-D table");
  const Hyper h = read_hyper(hyper, step);
  const int64_t dim = weight.size(1);
  const int64_t rows_per_sc = weight.size(0) / row_pointers.size(0);
  const StatePointers st(state, dim);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, weight.scalar_type(), "sparsecore_update", [&] {
    scalar_t* table = weight.mutable_data_ptr<scalar_t>();
    for_each_touched_row(
        grad_output, row_pointers, embedding_ids, sample_ids, gains, batch_size, rows_per_sc,
        [&](int64_t r, const float* g) {
          step_row(table + r * dim, g, dim, optimizer, h, st.first(r), st.second(r, dim));
        },
        [&](int64_t r) {
          prefetch(table + r * dim, dim * static_cast<int64_t>(sizeof(scalar_t)));
          if (st.s0) prefetch(st.first(r), st.s0_width * 4);
          if (st.s1) prefetch(st.second(r, dim), dim * 4);
        });
  });
}

// The backward's first half: (physical rows touched, their summed gradients),
// for callers that combine gradients across devices before the update. Rows
// come out in no fixed order (tasks finish as they do).
std::tuple<at::Tensor, at::Tensor> row_gradients(const at::Tensor& grad_output, const at::Tensor& row_pointers,
                                                 const at::Tensor& embedding_ids, const at::Tensor& sample_ids,
                                                 const at::Tensor& gains, int64_t batch_size, int64_t rows_per_sc) {
  const int64_t dim = grad_output.size(1);
  // At most one row per COO entry. Written in place from the device's allocator: growing
  // host vectors instead would touch fresh pages every step, which costs more than the sums.
  const int64_t most = embedding_ids.numel();
  auto out_rows = at::empty({most}, grad_output.options().dtype(at::kLong));
  auto out_grads = at::empty({most, dim}, grad_output.options().dtype(at::kFloat));
  int64_t* orp = out_rows.mutable_data_ptr<int64_t>();
  float* ogp = out_grads.mutable_data_ptr<float>();
  std::atomic<int64_t> next{0};
  for_each_touched_row(
      grad_output, row_pointers, embedding_ids, sample_ids, gains, batch_size, rows_per_sc,
      [&](int64_t r, const float* g) {
        const int64_t i = next.fetch_add(1, std::memory_order_relaxed);
        orp[i] = r;
        std::copy(g, g + dim, ogp + i * dim);
      },
      [](int64_t) {});
  const int64_t total = next.load();
  return {out_rows.narrow(0, 0, total), out_grads.narrow(0, 0, total)};
}

// The second half: the optimizer on the given (distinct) physical rows.
// row_mean_sq (float [rows], optional): row-wise Adagrad's statistic of whole
// rows, for tables split by columns.
void apply_rows(const at::Tensor& weight, at::TensorList state, const at::Tensor& step, const at::Tensor& rows,
                const at::Tensor& grads, int64_t optimizer, const at::Tensor& hyper,
                const std::optional<at::Tensor>& row_mean_sq) {
  TORCH_CHECK(weight.is_contiguous() && weight.dim() == 2, "apply_rows: weight must be a contiguous 2-D table");
  TORCH_CHECK(rows.dim() == 1 && grads.dim() == 2 && grads.size(0) == rows.size(0) && grads.size(1) == weight.size(1),
              "apply_rows: rows [U] and grads [U, dim] must match the table's dim ", weight.size(1));
  const Hyper h = read_hyper(hyper, step);
  const int64_t dim = weight.size(1);
  const auto r = rows.contiguous().to(at::kLong);
  const auto g = grads.contiguous().to(at::kFloat);
  const at::Tensor msq = row_mean_sq.has_value() ? row_mean_sq->contiguous().to(at::kFloat) : at::Tensor();
  const int64_t* rp = r.const_data_ptr<int64_t>();
  const float* gp = g.const_data_ptr<float>();
  const float* mp = msq.defined() ? msq.const_data_ptr<float>() : nullptr;
  const StatePointers st(state, dim);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, weight.scalar_type(), "sparsecore_apply_rows", [&] {
    scalar_t* table = weight.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, r.numel(), 256, [&](int64_t first, int64_t last) {
      for (int64_t i = first; i < last; ++i) {
        const int64_t row = rp[i];
        step_row(table + row * dim, gp + i * dim, dim, optimizer, h, st.first(row), st.second(row, dim),
                 mp ? mp + i : nullptr);
      }
    });
  });
}

} // namespace

TORCH_LIBRARY_FRAGMENT(sparsecore, m) {
  m.def("backward_update(Tensor(a!) weight, Tensor(b!)[] state, Tensor(c!) step, Tensor grad_output, "
        "Tensor row_pointers, Tensor embedding_ids, Tensor sample_ids, Tensor gains, int batch_size, int optimizer, "
        "Tensor hyper) -> ()");
  m.impl("backward_update", c10::DispatchKey::CPU, TORCH_FN(backward_update));
  m.impl("backward_update", c10::DispatchKey::PrivateUse1, TORCH_FN(backward_update));
  m.def("row_gradients(Tensor grad_output, Tensor row_pointers, Tensor embedding_ids, Tensor sample_ids, "
        "Tensor gains, int batch_size, int rows_per_sparsecore) -> (Tensor, Tensor)");
  m.impl("row_gradients", c10::DispatchKey::CPU, TORCH_FN(row_gradients));
  m.impl("row_gradients", c10::DispatchKey::PrivateUse1, TORCH_FN(row_gradients));
  m.def("apply_rows(Tensor(a!) weight, Tensor(b!)[] state, Tensor(c!) step, Tensor rows, Tensor grads, "
        "int optimizer, Tensor hyper, Tensor? row_mean_sq) -> ()");
  m.impl("apply_rows", c10::DispatchKey::CPU, TORCH_FN(apply_rows));
  m.impl("apply_rows", c10::DispatchKey::PrivateUse1, TORCH_FN(apply_rows));
}

} // namespace sparsecore
