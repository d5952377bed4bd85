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
#include <torch/library.h>

#include <cmath>
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

template <typename scalar_t>
void step_row(scalar_t* w, const float* g, int64_t dim, int64_t optimizer, const Hyper& h,
              float* s0, float* s1) {
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
      s0[0] += mean_sq / static_cast<float>(dim);
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

// step: int64 [1], the stack's update count, incremented here (Adam's bias
// correction). hyper: float64 [6] on the host (see Hyper), so the learning
// rate can change between steps without a new graph.
void backward_update(const at::Tensor& weight, at::TensorList state, const at::Tensor& step,
                     const at::Tensor& grad_output, const at::Tensor& row_pointers,
                     const at::Tensor& embedding_ids, const at::Tensor& sample_ids,
                     const at::Tensor& gains, int64_t batch_size, int64_t optimizer,
                     const at::Tensor& hyper) {
  TORCH_CHECK(weight.is_contiguous() && weight.dim() == 2, "backward_update: weight must be a contiguous 2-D table");
  TORCH_CHECK(hyper.numel() == 6 && hyper.scalar_type() == at::kDouble, "backward_update: hyper must be float64 [6]");
  TORCH_CHECK(step.numel() == 1 && step.scalar_type() == at::kLong, "backward_update: step must be one int64");
  const double* hp = hyper.const_data_ptr<double>();
  int64_t* count = step.mutable_data_ptr<int64_t>();
  Hyper h{};
  for (int i = 0; i < 6; ++i) h.p[i] = static_cast<float>(hp[i]);
  h.step = ++count[0];
  const int64_t n = row_pointers.size(0);
  const int64_t width = embedding_ids.size(1);
  const int64_t dim = weight.size(1);
  const int64_t rows_per_sc = weight.size(0) / n;
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
  float* s0 = state.size() > 0 ? state[0].mutable_data_ptr<float>() : nullptr;
  float* s1 = state.size() > 1 ? state[1].mutable_data_ptr<float>() : nullptr;
  const int64_t state_width = state.size() > 0 && state[0].dim() == 1 ? 1 : dim;  // row-wise: 1

  // Tasks: (owner, bucket of rows); rows of different tasks never meet.
  const int64_t buckets = std::max<int64_t>(1, 2 * at::get_num_threads() / n);
  int row_bits = 1;
  while ((int64_t{1} << row_bits) < rows_per_sc) ++row_bits;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, weight.scalar_type(), "sparsecore_update", [&] {
    scalar_t* table = weight.mutable_data_ptr<scalar_t>();
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
            const uint64_t ahead = keys[i + kPrefetchDistance];
            const int64_t r = owner * rows_per_sc + static_cast<int64_t>(ahead >> 32);
            prefetch(go + grad_row(sp[ahead & 0xffffffffu]) * dim, dim * 4);
            prefetch(table + r * dim, dim * static_cast<int64_t>(sizeof(scalar_t)));
            if (s0) prefetch(s0 + r * state_width, state_width * 4);
            if (s1) prefetch(s1 + r * dim, dim * 4);
          }
          const int64_t e = static_cast<int64_t>(keys[i] & 0xffffffffu);
          const float* g = go + grad_row(sp[e]) * dim;
          const float gain = gp[e];
          for (int64_t d = 0; d < dim; ++d) acc[d] += gain * g[d];
          const int64_t row = static_cast<int64_t>(keys[i] >> 32);
          if (i + 1 == keys.size() || static_cast<int64_t>(keys[i + 1] >> 32) != row) {
            const int64_t r = owner * rows_per_sc + row;
            step_row(table + r * dim, acc.data(), dim, optimizer, h, s0 ? s0 + r * state_width : nullptr,
                     s1 ? s1 + r * dim : nullptr);
            std::fill(acc.begin(), acc.end(), 0.0f);
          }
        }
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
}

} // namespace sparsecore
