// The forward of a stack: out[bag] += gain * table[owner * rows_per_sc + row]
// for every COO entry, accumulated in fp32. Parallel over receiving
// SparseCores: their bags are disjoint, so no two threads write one row.

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

namespace sparsecore {
namespace {

constexpr int64_t kAlignment = 8;

template <typename scalar_t>
void accumulate_row(float* out, const scalar_t* row, float gain, int64_t dim) {
  for (int64_t d = 0; d < dim; ++d) {
    out[d] += gain * static_cast<float>(row[d]);
  }
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
  const int32_t* rpp = rp.const_data_ptr<int32_t>();
  const int32_t* idp = ids.const_data_ptr<int32_t>();
  const int32_t* sp = samples.const_data_ptr<int32_t>();
  const float* gp = gn.const_data_ptr<float>();
  float* op = out.mutable_data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, weight.scalar_type(), "sparsecore_lookup", [&] {
    const scalar_t* table = weight.const_data_ptr<scalar_t>();
    at::parallel_for(0, n, 1, [&](int64_t first, int64_t last) {
      for (int64_t s = first; s < last; ++s) {
        int64_t start = 0;
        for (int64_t o = 0; o < n; ++o) {
          const int64_t end = rpp[s * n + o];
          const scalar_t* shard = table + o * rows_per_sc * dim;
          for (int64_t e = s * width + start; e < s * width + end; ++e) {
            accumulate_row(op + static_cast<int64_t>(sp[e]) * dim, shard + static_cast<int64_t>(idp[e]) * dim, gp[e], dim);
          }
          start = (end + kAlignment - 1) / kAlignment * kAlignment;
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
