// The forward of a stack: out[bag] += gain * table[owner * rows_per_sc + row]
// for every COO entry, accumulated in fp32.
//
// Within every (receiver, owner) group the entries are in bag order (see
// Preprocess.cpp), so the work splits into disjoint ranges of bags: a thread
// takes a bag range and finds its slice of every group by binary search. No
// two threads write one output row, whatever the number of SparseCores.

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>

namespace sparsecore {
namespace {

constexpr int64_t kAlignment = 8;
// Rows fetched ahead of use: random rows come from DRAM, and keeping several
// requests in flight is what makes a gather fast.
constexpr int64_t kPrefetchDistance = 8;
constexpr int64_t kBagsPerTask = 256;

template <typename scalar_t>
inline void accumulate_row(float* __restrict out, const scalar_t* __restrict row, float gain, int64_t dim) {
  for (int64_t d = 0; d < dim; ++d) {
    out[d] += gain * static_cast<float>(row[d]);
  }
}

template <typename scalar_t>
inline void prefetch_row(const scalar_t* row, int64_t dim) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t offset = 0; offset < dim * static_cast<int64_t>(sizeof(scalar_t)); offset += 64) {
    __builtin_prefetch(p + offset, 0, 0);
  }
}

// [begin, end) of every (receiver, owner) group in the flat buffers.
std::vector<std::pair<int64_t, int64_t>> groups(const int32_t* row_pointers, int64_t n, int64_t width) {
  std::vector<std::pair<int64_t, int64_t>> out;
  out.reserve(n * n);
  for (int64_t s = 0; s < n; ++s) {
    int64_t start = 0;
    for (int64_t o = 0; o < n; ++o) {
      const int64_t end = row_pointers[s * n + o];
      out.emplace_back(s * width + start, s * width + end);
      start = (end + kAlignment - 1) / kAlignment * kAlignment;
    }
  }
  return out;
}

at::Tensor lookup(const at::Tensor& weight, const at::Tensor& row_pointers,
                  const at::Tensor& embedding_ids, const at::Tensor& sample_ids,
                  const at::Tensor& gains, int64_t num_bags) {
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), "lookup: weight must be a contiguous 2-D table");
  const int64_t n = row_pointers.size(0);
  const int64_t width = embedding_ids.size(1);
  const int64_t dim = weight.size(1);
  const int64_t rows_per_sc = weight.size(0) / n;
  auto out = at::zeros({num_bags, dim}, weight.options().dtype(at::kFloat));
  const auto rp = row_pointers.contiguous();
  const auto ids = embedding_ids.contiguous();
  const auto samples = sample_ids.contiguous();
  const auto gn = gains.contiguous();
  const auto spans = groups(rp.const_data_ptr<int32_t>(), n, width);
  const int32_t* idp = ids.const_data_ptr<int32_t>();
  const int32_t* sp = samples.const_data_ptr<int32_t>();
  const float* gp = gn.const_data_ptr<float>();
  float* op = out.mutable_data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, weight.scalar_type(), "sparsecore_lookup", [&] {
    const scalar_t* table = weight.const_data_ptr<scalar_t>();
    at::parallel_for(0, num_bags, kBagsPerTask, [&](int64_t bag_begin, int64_t bag_end) {
      for (size_t g = 0; g < spans.size(); ++g) {
        const int64_t owner = static_cast<int64_t>(g) % n;
        const scalar_t* shard = table + owner * rows_per_sc * dim;
        const int32_t* first = sp + spans[g].first;
        const int32_t* last = sp + spans[g].second;
        const int64_t begin = std::lower_bound(first, last, bag_begin) - sp;
        const int64_t end = std::lower_bound(first, last, bag_end) - sp;
        for (int64_t e = begin; e < end; ++e) {
          if (e + kPrefetchDistance < end) {
            prefetch_row(shard + static_cast<int64_t>(idp[e + kPrefetchDistance]) * dim, dim);
          }
          accumulate_row(op + static_cast<int64_t>(sp[e]) * dim, shard + static_cast<int64_t>(idp[e]) * dim, gp[e], dim);
        }
      }
    });
  });
  return out;
}

} // namespace

TORCH_LIBRARY_FRAGMENT(sparsecore, m) {
  m.def("lookup(Tensor weight, Tensor row_pointers, Tensor embedding_ids, Tensor sample_ids, "
        "Tensor gains, int num_bags) -> Tensor");
  m.impl("lookup", c10::DispatchKey::CPU, TORCH_FN(lookup));
  m.impl("lookup", c10::DispatchKey::PrivateUse1, TORCH_FN(lookup));
}

} // namespace sparsecore
