// The fused backward of a stack: the pooled gradient becomes one gradient
// per touched row, and the optimizer updates that row and its state in place.
// No dense table gradient is ever formed.
//
// Rows of different owners are disjoint, and so are rows in different
// buckets (row mod k) of one owner: each (owner, bucket) task gathers its
// entries from every receiver, scattered by range of rows, and sums each
// range's rows in a small buffer that stays in cache; then it steps the
// optimizer on every touched row of the range. One parameterised kernel
// serves every optimizer.
//
// Rather than sorting entries by row: a sort moves every entry several times
// and leaves its sample and gain to be fetched from a random place, while a
// range's slot map and sums fit in L1 and L2.

#include "Layout.h"
#include "ThreadPool.h"

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <optional>
#include <tuple>
#include <vector>

namespace sparsecore {
namespace {

// How many entries ahead of the one summed its pooled-gradient row is asked
// for, and how many touched rows ahead of the one stepped its table and state
// rows are (prefetch_bytes). Rows a range touches are far apart in the table,
// and a step without its row in cache waits the whole DRAM latency. Measured
// (d64, batch 8192, pooling 20, row-wise Adagrad, backward alone, medians):
// entries 16 -> 64 ahead took the Zipf 1.2 backward from 30.2 to 28.5 ms and
// uniform from 77.1 to 75.2; then table rows 16 ahead (none before) took
// uniform from 75.9 to 63.4 ms and Zipf 1.2 from 32.3 to 30.9 (8 ahead: 63.7
// and 31.0; 32: 63.4 and 30.9).
constexpr int64_t kGradPrefetchDistance = 64;
constexpr int64_t kRowPrefetchDistance = 16;

enum Optimizer : int64_t { kSGD = 0, kAdagrad = 1, kRowWiseAdagrad = 2, kAdam = 3, kFTRL = 4 };

// The optimizer's numbers, read from a float64 [6] tensor; meaning per optimizer
// (sparsecore/optim.py): SGD [lr]; Adagrad, RowWiseAdagrad [lr, eps];
// Adam [lr, eps, beta1, beta2]; FTRL [lr, l1, l2, beta, lr_power].
struct Hyper {
  float p[6];
  int64_t step;
  float adam_step_size;  // Adam's bias-corrected step size: the same for every row of a call
  float lr() const { return p[0]; }
};

// Sixteen running sums rather than one: a single sum is a chain of dependent
// adds (four cycles each) that no vector unit can shorten.
template <int64_t kDim>
inline float sum_of_squares(const float* g, int64_t runtime_dim) {
  const int64_t dim = kDim > 0 ? kDim : runtime_dim;
  constexpr int64_t kLanes = 16;
  float lanes[kLanes] = {};
  int64_t d = 0;
  for (; d + kLanes <= dim; d += kLanes) {
    for (int64_t k = 0; k < kLanes; ++k) lanes[k] += g[d + k] * g[d + k];
  }
  if constexpr (kDim % kLanes != 0 || kDim == 0) {
    for (; d < dim; ++d) lanes[0] += g[d] * g[d];
  }
  float total = 0;
  for (int64_t k = 0; k < kLanes; ++k) total += lanes[k];
  return total;
}

// row_mean_sq: row-wise Adagrad's mean squared gradient of the whole row when
// this table holds only some of its columns (given by the caller); nullptr:
// computed here from g.
// kDim > 0: the row width known at compile time; kDim == 0: runtime_dim. The
// row, its gradient and its state never overlap (__restrict), so the loops
// vectorize.
template <typename scalar_t, int64_t kDim>
void step_row(scalar_t* __restrict w, const float* __restrict g, int64_t runtime_dim, int64_t optimizer,
              const Hyper& h, float* __restrict s0, float* __restrict s1, const float* row_mean_sq = nullptr) {
  const int64_t dim = kDim > 0 ? kDim : runtime_dim;
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
      s0[0] += row_mean_sq ? *row_mean_sq : sum_of_squares<kDim>(g, dim) / static_cast<float>(dim);
      const float scale = h.lr() / (std::sqrt(s0[0]) + h.p[1]);
      for (int64_t d = 0; d < dim; ++d) w[d] = static_cast<float>(w[d]) - scale * g[d];
      break;
    }
    case kAdam: {  // s0, s1: moments; lazy, as torch.optim.SparseAdam
      const float eps = h.p[1], beta1 = h.p[2], beta2 = h.p[3], step_size = h.adam_step_size;
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
  const double steps = static_cast<double>(h.step);
  h.adam_step_size = static_cast<float>(h.lr() * std::sqrt(1 - std::pow(static_cast<double>(h.p[3]), steps)) /
                                        (1 - std::pow(static_cast<double>(h.p[2]), steps)));
  return h;
}

// One COO entry on its way into its row's gradient: the row (local to the
// owner), the pooled-gradient row it reads, and its gain.
struct Contribution {
  uint32_t row;
  uint32_t grad_row;
  float gain;
};

// A task's rows are split into ranges of 2^shift rows: its entries are first
// scattered by range (keeping their order), then each range's rows are summed
// in a compact buffer that stays in cache, one slot per touched row in order
// of first touch. A range is small enough for its slot map to sit in L1 and
// its table rows to be near each other; there are few enough ranges for the
// scatter to keep one write stream per range.
constexpr int kMinRangeBits = 12;
constexpr int kMaxRangeCountBits = 11;

// Per thread, reused across calls so that a step does not fault in fresh pages.
struct Scratch {
  std::vector<Contribution> contributions;
  std::vector<int64_t> range_start;
  std::vector<int32_t> slot_of;  // per row of the current range: its slot, or -1
  std::vector<uint32_t> rows;    // per slot: its row
  std::vector<float> sums;       // per slot: its gradient, dim floats
  template <typename T>
  static T* at_least(std::vector<T>& v, size_t n) {
    if (v.size() < n) v.resize(n);
    return v.data();
  }
};

// One task's entries, scattered by range of rows.
struct TaskEntries {
  const Contribution* contributions;
  const int64_t* range_start;  // range r's entries are [range_start[r], range_start[r + 1])
};

// The COO entries of one (owner, bucket) task, as Contributions grouped by
// range of rows, each range's in buffer order (receiver by receiver).
TaskEntries scatter_by_range(Scratch& scratch, const Coo& coo, int64_t owner, int64_t buckets, int64_t bucket,
                             int shift, int64_t ranges) {
  const int64_t n = coo.n;
  const int32_t* ids = coo.ids;
  auto mine = [&](int32_t id) { return buckets == 1 || id % buckets == bucket; };
  int64_t* start = Scratch::at_least(scratch.range_start, ranges + 1);
  std::fill(start, start + ranges + 1, 0);
  for (int64_t s = 0; s < n; ++s) {
    const auto [begin, end] = coo.spans[s * n + owner];
    for (int64_t e = begin; e < end; ++e) {
      if (mine(ids[e])) ++start[(ids[e] >> shift) + 1];
    }
  }
  for (int64_t r = 0; r < ranges; ++r) start[r + 1] += start[r];
  Contribution* out = Scratch::at_least(scratch.contributions, start[ranges]);
  std::vector<int64_t> cursor(start, start + ranges);
  for (int64_t s = 0; s < n; ++s) {
    const auto [begin, end] = coo.spans[s * n + owner];
    int32_t bag = -1;
    uint32_t grad_row = 0;
    for (int64_t e = begin; e < end; ++e) {
      if (!mine(ids[e])) continue;
      if (coo.samples[e] != bag) {  // a group is in bag order: one division per bag, not per entry
        bag = coo.samples[e];
        grad_row = static_cast<uint32_t>(coo.row_of(bag));
      }
      out[cursor[ids[e] >> shift]++] = {static_cast<uint32_t>(ids[e]), grad_row, coo.gains[e]};
    }
  }
  return {out, start};
}

// Sums the gradients of the rows of one range [base, base + 2^shift) from its
// entries, in a compact buffer (a slot per touched row, in order of first
// touch), then calls on_row(row, sum, at + j) for the j-th, where at =
// reserve(touched rows), and ahead(row) kRowPrefetchDistance rows before.
template <int64_t kDim, typename OnRow, typename Ahead, typename Reserve>
void sum_range(Scratch& scratch, const Contribution* first, const Contribution* last, uint32_t base, int shift,
               const float* grad, int64_t runtime_dim, const OnRow& on_row, const Ahead& ahead,
               const Reserve& reserve) {
  const int64_t dim = kDim > 0 ? kDim : runtime_dim;
  const int64_t most = std::min<int64_t>(last - first, int64_t{1} << shift);
  uint32_t* rows = Scratch::at_least(scratch.rows, most);
  float* sums = Scratch::at_least(scratch.sums, most * dim);
  int32_t* slot_of = scratch.slot_of.data();
  int64_t slots = 0;
  for (const Contribution* c = first; c != last; ++c) {
    if (c + kGradPrefetchDistance < last) prefetch_bytes(grad + c[kGradPrefetchDistance].grad_row * dim, dim * 4);
    int32_t& slot = slot_of[c->row - base];
    if (slot < 0) {
      slot = static_cast<int32_t>(slots++);
      rows[slot] = c->row;
      std::fill(sums + slot * dim, sums + (slot + 1) * dim, 0.0f);
    }
    float* __restrict acc = sums + slot * dim;
    const float* __restrict g = grad + c->grad_row * dim;
    for (int64_t d = 0; d < dim; ++d) acc[d] += c->gain * g[d];
  }
  const int64_t at = reserve(slots);
  for (int64_t j = 0; j < std::min(slots, kRowPrefetchDistance); ++j) ahead(rows[j]);
  for (int64_t j = 0; j < slots; ++j) {
    if (j + kRowPrefetchDistance < slots) ahead(rows[j + kRowPrefetchDistance]);
    on_row(rows[j], sums + j * dim, at + j);
    slot_of[rows[j] - base] = -1;
  }
}

// Calls on_row(physical row, summed gradient, index) once for every row a
// stack's COO buffers touch, and ahead(physical row) a few rows before (to
// prefetch what on_row will read), in parallel over (owner, bucket of rows) tasks
// (rows of different tasks never meet). Indices are distinct: reserve(k) is
// called before a group of k rows, which get indices reserve's result + 0 ..
// k - 1. A row's entries are summed in their order in the buffers, whatever
// the thread count.
template <int64_t kDim, typename OnRow, typename Ahead, typename Reserve>
void for_each_touched_row(const at::Tensor& grad_output, const at::Tensor& row_pointers,
                          const at::Tensor& embedding_ids, const at::Tensor& sample_ids, const at::Tensor& gains,
                          int64_t batch_size, int64_t rows_per_sc, const OnRow& on_row, const Ahead& ahead,
                          const Reserve& reserve) {
  const int64_t n = row_pointers.size(0);
  const int64_t dim = grad_output.size(1);
  // A bag's gradient is in the output row the lookup wrote it to.
  const int64_t bags_per_slot = std::max<int64_t>(batch_size, 1);
  const auto grad = grad_output.contiguous().to(at::kFloat);
  const auto rp = row_pointers.contiguous();
  const auto ids = embedding_ids.contiguous();
  const auto samples = sample_ids.contiguous();
  const auto gn = gains.contiguous();
  const Coo coo{ids.const_data_ptr<int32_t>(), samples.const_data_ptr<int32_t>(), gn.const_data_ptr<float>(),
                group_spans(rp.const_data_ptr<int32_t>(), n, embedding_ids.size(1)), n, rows_per_sc,
                OutputRows{bags_per_slot, grad_output.size(0) / bags_per_slot}};
  const float* gp = grad.const_data_ptr<float>();
  const int64_t buckets = std::max<int64_t>(1, 2 * kernel_threads() / n);
  int row_bits = 1;
  while ((int64_t{1} << row_bits) < rows_per_sc) ++row_bits;
  const int shift = std::max(kMinRangeBits, row_bits - kMaxRangeCountBits);
  const int64_t ranges = ((std::max<int64_t>(rows_per_sc, 1) - 1) >> shift) + 1;
  parallel_for(0, n * buckets, 1, [&](int64_t first, int64_t last) {
    thread_local Scratch scratch;
    // Every slot free: also after an exception left a range half done.
    std::fill_n(Scratch::at_least(scratch.slot_of, size_t{1} << shift), size_t{1} << shift, -1);
    for (int64_t task = first; task < last; ++task) {
      const int64_t owner = task / buckets;
      const int64_t offset = owner * rows_per_sc;
      const TaskEntries entries = scatter_by_range(scratch, coo, owner, buckets, task % buckets, shift, ranges);
      for (int64_t r = 0; r < ranges; ++r) {
        const Contribution* begin = entries.contributions + entries.range_start[r];
        const Contribution* end = entries.contributions + entries.range_start[r + 1];
        if (begin == end) continue;
        sum_range<kDim>(
            scratch, begin, end, static_cast<uint32_t>(r << shift), shift, gp, dim,
            [&](uint32_t row, const float* g, int64_t index) { on_row(offset + row, g, index); },
            [&](uint32_t row) { ahead(offset + row); }, reserve);
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
  // Asks for row r's state ahead of its step (which writes it).
  void prefetch(int64_t r, int64_t dim) const {
    if (s0) prefetch_bytes(first(r), s0_width * 4);
    if (s1) prefetch_bytes(second(r, dim), dim * 4);
  }
};

// Asks for table row r and its state ahead of the optimizer's step on them.
template <typename scalar_t>
void prefetch_step(const scalar_t* table, int64_t r, int64_t dim, const StatePointers& st) {
  prefetch_bytes(table + r * dim, dim * static_cast<int64_t>(sizeof(scalar_t)));
  st.prefetch(r, dim);
}

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
    with_row_width(dim, [&](auto width) {
      constexpr int64_t kDim = decltype(width)::value;
      for_each_touched_row<kDim>(
          grad_output, row_pointers, embedding_ids, sample_ids, gains, batch_size, rows_per_sc,
          [&](int64_t r, const float* g, int64_t) {
            step_row<scalar_t, kDim>(table + r * dim, g, dim, optimizer, h, st.first(r), st.second(r, dim));
          },
          [&](int64_t r) { prefetch_step(table, r, dim, st); },
          [](int64_t) { return int64_t{0}; });
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
  with_row_width(dim, [&](auto width) {
    for_each_touched_row<decltype(width)::value>(
        grad_output, row_pointers, embedding_ids, sample_ids, gains, batch_size, rows_per_sc,
        [&](int64_t r, const float* g, int64_t i) {
          orp[i] = r;
          std::copy(g, g + dim, ogp + i * dim);
        },
        [](int64_t) {},
        // One atomic per range of rows, not per row: threads share its cache line.
        [&](int64_t rows) { return next.fetch_add(rows, std::memory_order_relaxed); });
  });
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
    with_row_width(dim, [&](auto width) {
      parallel_for(0, r.numel(), 256, [&](int64_t first, int64_t last) {
        for (int64_t i = first; i < last; ++i) {
          if (i + kRowPrefetchDistance < last) prefetch_step(table, rp[i + kRowPrefetchDistance], dim, st);
          const int64_t row = rp[i];
          step_row<scalar_t, decltype(width)::value>(table + row * dim, gp + i * dim, dim, optimizer, h,
                                                     st.first(row), st.second(row, dim), mp ? mp + i : nullptr);
        }
      });
    });
  });
}

} // namespace

TORCH_LIBRARY_FRAGMENT(sparsecore, m) {
  m.def("backward_update(Tensor(a!) weight, Tensor(b!)[] state, Tensor(c!) step, Tensor grad_output, "
        "Tensor row_pointers, Tensor embedding_ids, Tensor sample_ids, Tensor gains, SymInt batch_size, int optimizer, "
        "Tensor hyper) -> ()");
  m.impl("backward_update", c10::DispatchKey::CPU, TORCH_FN(backward_update));
  m.impl("backward_update", c10::DispatchKey::PrivateUse1, TORCH_FN(backward_update));
  m.def("row_gradients(Tensor grad_output, Tensor row_pointers, Tensor embedding_ids, Tensor sample_ids, "
        "Tensor gains, SymInt batch_size, int rows_per_sparsecore) -> (Tensor, Tensor)");
  m.impl("row_gradients", c10::DispatchKey::CPU, TORCH_FN(row_gradients));
  m.impl("row_gradients", c10::DispatchKey::PrivateUse1, TORCH_FN(row_gradients));
  m.def("apply_rows(Tensor(a!) weight, Tensor(b!)[] state, Tensor(c!) step, Tensor rows, Tensor grads, "
        "int optimizer, Tensor hyper, Tensor? row_mean_sq) -> ()");
  m.impl("apply_rows", c10::DispatchKey::CPU, TORCH_FN(apply_rows));
  m.impl("apply_rows", c10::DispatchKey::PrivateUse1, TORCH_FN(apply_rows));
}

} // namespace sparsecore
