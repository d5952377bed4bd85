// The forward of a stack: out[bag] = sum of gain * table[owner * rows_per_sc + row]
// over the bag's COO entries, accumulated in fp32.
//
// Within every (receiver, owner) group the entries are in bag order (see
// Preprocess.cpp), so the work splits into disjoint ranges of bags: a thread
// takes a bag range, finds its slice of every group by binary search, and
// walks the bags in order with one cursor per group. A bag's entries from all
// its SparseCores are summed in registers and its output row is written once,
// as an embedding_bag kernel does, rather than read and written per entry.

#include "BagSum.h"
#include "Layout.h"
#include "ThreadPool.h"

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace sparsecore {
namespace {

// How many entries of a group ahead their rows are prefetched (prefetch_bytes).
constexpr int64_t kPrefetchDistance = 32;
constexpr int64_t kBagsPerTask = 256;

// kDim: as BagSum's.
template <typename scalar_t, int64_t kDim>
void lookup_bags(const Coo& coo, const scalar_t* table, int64_t runtime_dim, float* out, int64_t bag_begin,
                 int64_t bag_end) {
  const int64_t dim = kDim > 0 ? kDim : runtime_dim;
  const int64_t n = coo.n;
  const int64_t groups = n * n;
  std::vector<int64_t> cursor(groups), end(groups);
  for (int64_t g = 0; g < groups; ++g) {
    const int32_t* first = coo.samples + coo.spans[g].first;
    const int32_t* last = coo.samples + coo.spans[g].second;
    cursor[g] = std::lower_bound(first, last, bag_begin) - coo.samples;
    end[g] = std::lower_bound(first, last, bag_end) - coo.samples;
  }
  std::vector<const scalar_t*> shard(n);
  for (int64_t o = 0; o < n; ++o) shard[o] = table + o * coo.rows_per_sc * dim;
  for (int64_t g = 0; g < groups; ++g) {
    for (int64_t e = cursor[g]; e < std::min(end[g], cursor[g] + kPrefetchDistance); ++e) {
      prefetch_bytes(shard[g % n] + static_cast<int64_t>(coo.ids[e]) * dim, dim * sizeof(scalar_t));
    }
  }
  std::vector<float> scratch(kDim > 0 ? 0 : dim);
  BagSum<scalar_t, kDim> sum(dim, scratch.data());
  for (int64_t bag = bag_begin; bag < bag_end; ++bag) {
    sum.clear();
    // Only the bag's receiver has entries for it; the other groups' cursors
    // stop at once on a larger sample id.
    for (int64_t g = 0; g < groups; ++g) {
      int64_t e = cursor[g];
      const int64_t stop = end[g];
      const scalar_t* base = shard[g % n];
      for (; e < stop && coo.samples[e] == bag; ++e) {
        if (e + kPrefetchDistance < stop) {
          prefetch_bytes(base + static_cast<int64_t>(coo.ids[e + kPrefetchDistance]) * dim, dim * sizeof(scalar_t));
        }
        sum.add(base + static_cast<int64_t>(coo.ids[e]) * dim, coo.gains[e]);
      }
      cursor[g] = e;
    }
    sum.store(out + coo.row_of(bag) * dim);
  }
  stream_fence();
}

at::Tensor lookup(const at::Tensor& weight, const at::Tensor& row_pointers,
                  const at::Tensor& embedding_ids, const at::Tensor& sample_ids,
                  const at::Tensor& gains, int64_t num_bags, int64_t batch_size) {
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), "lookup: weight must be a contiguous 2-D table");
  TORCH_CHECK(batch_size > 0 ? num_bags % batch_size == 0 : num_bags == 0,
              "lookup: num_bags (", num_bags, ") must be a multiple of batch_size (", batch_size, ")");
  const int64_t n = row_pointers.size(0);
  const int64_t width = embedding_ids.size(1);
  const int64_t dim = weight.size(1);
  auto out = at::empty({num_bags, dim}, weight.options().dtype(at::kFloat));
  const auto rp = row_pointers.contiguous();
  const auto ids = embedding_ids.contiguous();
  const auto samples = sample_ids.contiguous();
  const auto gn = gains.contiguous();
  const Coo coo{ids.const_data_ptr<int32_t>(), samples.const_data_ptr<int32_t>(), gn.const_data_ptr<float>(),
                group_spans(rp.const_data_ptr<int32_t>(), n, width), n, weight.size(0) / n,
                OutputRows{std::max<int64_t>(batch_size, 1), batch_size > 0 ? num_bags / batch_size : 0}};
  float* op = out.mutable_data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, weight.scalar_type(), "sparsecore_lookup", [&] {
    const scalar_t* table = weight.const_data_ptr<scalar_t>();
    with_row_width(dim, [&](auto width) {
      parallel_for(0, num_bags, kBagsPerTask, [&](int64_t bag_begin, int64_t bag_end) {
        lookup_bags<scalar_t, decltype(width)::value>(coo, table, dim, op, bag_begin, bag_end);
      });
    });
  });
  return out;
}

} // namespace

TORCH_LIBRARY_FRAGMENT(sparsecore, m) {
  m.def("lookup(Tensor weight, Tensor row_pointers, Tensor embedding_ids, Tensor sample_ids, "
        "Tensor gains, SymInt num_bags, SymInt batch_size) -> Tensor");
  m.impl("lookup", c10::DispatchKey::CPU, TORCH_FN(lookup));
  m.impl("lookup", c10::DispatchKey::PrivateUse1, TORCH_FN(lookup));
}

} // namespace sparsecore
