// The lookup of a pooled stack for inference, straight from the KJT's
// tensors: out[bag] = sum of gain * row over the bag's ids, in KJT order.
//
// No backward will read COO buffers, so none are built: the ids are
// validated, mapped to their rows under mod sharding with rotation (as the
// preprocessing pass maps them), counted per partition and summed, in one
// pass parallel over chunks of bags. Ids repeated within a bag are not
// merged, so the per-partition counts are raw: they bound the merged
// entries and the distinct rows of every partition from above, which is
// what sparsecore/inference.py checks against the limits.

#include "BagSum.h"
#include "Bags.h"
#include "Layout.h"
#include "ThreadPool.h"

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

namespace sparsecore {
namespace {

// How many ids ahead of the one summed a row is asked for (prefetch_bytes).
// Measured at dim 64, batch 8192, pooling 100, uniform ids: 140 ms at 32
// (the COO lookup's distance), 127 at 48, 125 at 64; Zipf ids about even.
constexpr int64_t kPrefetchDistance = 64;

struct StackArgs {
  at::IntArrayRef features, num_embeddings, rotations, row_offsets, combiners;
  int64_t n, batch_size, rows_per_sc;
};

template <typename index_t, typename scalar_t, int64_t kDim>
class ChunkLookup {
 public:
  ChunkLookup(const StackArgs& a, const index_t* ids, const float* weights, const std::vector<int64_t>& starts,
              const scalar_t* table, int64_t dim, float* out)
      : a_(a), ids_(ids), weights_(weights), starts_(starts), table_(table), dim_(dim),
        map_(a.n), slots_(static_cast<int64_t>(a.features.size())), out_(out), scratch_(kDim > 0 ? 0 : dim_) {}

  // Bags [k_begin, k_end): sums written, ids counted into `counts` (n x n,
  // this chunk's; nullptr: no partition can pass `bound`, so none are
  // counted). Returns false at the first out-of-range id (its slot and value
  // in `bad`), or once a partition of this chunk alone has passed `bound` ids
  // (so has the batch: `over` is set) or another chunk found that; the sums
  // are then not to be used.
  bool run(int64_t k_begin, int64_t k_end, int64_t* counts, int64_t* bad, int64_t bound, std::atomic<bool>& over) {
    const int64_t slice = batch_slice(a_.batch_size, a_.n);
    BagSum<scalar_t, kDim> sum(dim_, scratch_.data());
    int64_t slot = -1, run_end = 0, asked = 0;  // the slot's ids in this chunk end at run_end
    for (BagCursor at(k_begin, a_.batch_size, slice, a_.n); at.k < k_end; at.next()) {
      if (at.slot != slot) {
        slot = at.slot;
        slot_ = {a_.num_embeddings[slot], a_.rotations[slot], a_.row_offsets[slot]};
        const int64_t first = a_.features[slot] * a_.batch_size;
        asked = starts_[first + at.b];
        run_end = starts_[first + std::min(a_.batch_size, k_end - slot * a_.batch_size)];
      }
      const int64_t bag_index = a_.features[slot] * a_.batch_size + at.b;
      const int64_t begin = starts_[bag_index], length = starts_[bag_index + 1] - begin;
      const std::optional<float> shared_gain = bag_gains(weights_, begin, length, a_.combiners[slot], gains_);
      int64_t* receiver_counts = counts ? counts + at.receiver_base : nullptr;
      const float gain = shared_gain.value_or(0.0f);
      const bool summed =
          counts ? (shared_gain ? sum_bag<true, true>(sum, begin, length, run_end, asked, gain, receiver_counts)
                                : sum_bag<false, true>(sum, begin, length, run_end, asked, gain, receiver_counts))
                 : (shared_gain ? sum_bag<true, false>(sum, begin, length, run_end, asked, gain, nullptr)
                                : sum_bag<false, false>(sum, begin, length, run_end, asked, gain, nullptr));
      if (!summed) {
        bad[0] = slot;
        bad[1] = bad_id_;
        stream_fence();
        return false;
      }
      if (counts && (over.load(std::memory_order_relaxed) || past(receiver_counts, bound))) {
        over.store(true, std::memory_order_relaxed);
        stream_fence();
        return false;
      }
      sum.store(out_ + (at.b * slots_ + at.slot) * dim());
    }
    stream_fence();
    return true;
  }

 private:
  bool past(const int64_t* counts, int64_t bound) const {
    bool past = false;
    for (int64_t o = 0; o < a_.n; ++o) past |= counts[o] > bound;
    return past;
  }

  // Sums the bag [begin, begin + length) into `sum` and adds its ids to their
  // owners' counts (kCount; `counts`: the receiver's n), asking for rows
  // kPrefetchDistance ids ahead within the slot (up to run_end; `asked` is
  // the first id not yet asked for). An id is checked, and its row and owner
  // worked out, when it is asked for; they are kept from the request to the
  // sum. Returns false at the first out-of-range id asked for (its value in
  // bad_id_), before it is summed: one pass over the ids, not three - the
  // separate checking and counting passes cost 10% of a Zipf-id lookup,
  // whose rows mostly come from cache. kShared: every id has `gain`, else
  // gains_ holds the bag's.
  template <bool kShared, bool kCount>
  bool sum_bag(BagSum<scalar_t, kDim>& sum, int64_t begin, int64_t length, int64_t run_end, int64_t& asked,
               float gain, int64_t* counts) {
    // Locals: the stores to the rings would otherwise make the compiler reload
    // every member they might alias, once per id.
    const index_t* ids = ids_;
    const scalar_t* table = table_;
    const int64_t limit = slot_.limit, rotation = slot_.rotation, first_row = slot_.row_offset;
    const int64_t rows_per_sc = a_.rows_per_sc;
    const ShardMap map = map_;
    int64_t* where = where_;
    int32_t* owners = owners_;
    // Up to 4 SparseCores, a power-of-two count: the bag's counts are 16-bit
    // lanes of one register, an add per id rather than a dependent memory
    // increment.
    const int64_t n = a_.n;
    const bool in_lanes = n <= 4 && (n & (n - 1)) == 0 && length < 65536;
    uint64_t lanes = 0;
    sum.clear();
    for (int64_t i = 0; i < length; ++i) {
      for (const int64_t ahead = std::min(begin + i + kPrefetchDistance, run_end); asked < ahead; ++asked) {
        if (outside(ids[asked], limit)) {
          bad_id_ = static_cast<int64_t>(ids[asked]);
          return false;
        }
        const int64_t shifted = static_cast<int64_t>(ids[asked]) + rotation;
        const int64_t owner = map.owner(shifted);
        const int64_t offset = (owner * rows_per_sc + first_row + map.row(shifted)) * dim();
        where[asked % kRing] = offset;
        if constexpr (kCount) owners[asked % kRing] = static_cast<int32_t>(owner);
        prefetch_bytes(table + offset, dim() * sizeof(scalar_t));
      }
      const int64_t at = (begin + i) % kRing;
      if constexpr (kCount) {
        if (in_lanes) {
          lanes += uint64_t{1} << (16 * owners[at]);
        } else {
          ++counts[owners[at]];
        }
      }
      sum.add(table + where[at], kShared ? gain : gains_[i]);
    }
    if constexpr (kCount) {
      for (int64_t o = 0; in_lanes && o < n; ++o) counts[o] += (lanes >> (16 * o)) & 0xFFFF;
    }
    return true;
  }

  // The row width: a constant where kDim is known, so row offsets are shifts.
  int64_t dim() const { return kDim > 0 ? kDim : dim_; }

  static constexpr int64_t kRing = 128;
  static_assert(kRing > kPrefetchDistance && (kRing & (kRing - 1)) == 0,
                "an address is read back up to kPrefetchDistance ids after it is written");

  struct Slot {
    int64_t limit = 0, rotation = 0, row_offset = 0;
  };

  const StackArgs& a_;
  const index_t* ids_;
  const float* weights_;
  const std::vector<int64_t>& starts_;
  const scalar_t* table_;
  int64_t dim_;
  ShardMap map_;
  int64_t slots_;  // bag slot * batch_size + b is output row b * slots + slot
  float* out_;
  std::vector<float> scratch_;  // BagSum's, for any row width
  std::vector<float> gains_;
  Slot slot_;
  int64_t where_[kRing];  // row_offset of the ids asked for, by position in the KJT modulo kRing
  int32_t owners_[kRing];  // and their owners
  int64_t bad_id_ = 0;  // the out-of-range id sum_bag stopped at
};

// The most ids that one receiving SparseCore's batch slice carries over the
// stack's features: a bound on every partition's count, since a partition
// holds some of one receiver's ids.
int64_t most_ids_per_receiver(const std::vector<int64_t>& starts, at::IntArrayRef features, int64_t batch_size,
                              int64_t n) {
  const int64_t slice = batch_slice(batch_size, n);
  int64_t most = 0;
  for (int64_t b0 = 0; b0 < batch_size; b0 += slice) {
    const int64_t b1 = std::min(batch_size, b0 + slice);
    int64_t total = 0;
    for (const int64_t f : features) total += starts[f * batch_size + b1] - starts[f * batch_size + b0];
    most = std::max(most, total);
  }
  return most;
}

// Returns the (bags, dim) fp32 sums (bag slot * batch_size + b at row
// b * slots + slot, as the COO lookup), (slot, id) of the first out-of-range
// id (slot -1 when all are valid), and whether some partition carries more
// than `bound` ids before merging. Either of the last two: the sums are not
// to be used. A batch past the bound is left as soon as a chunk sees it: with
// limits well below the raw counts (tuned to the distinct rows) that is
// early, and the full preprocessing that follows decides, bad ids included.
std::tuple<at::Tensor, int64_t, int64_t, bool> inference_lookup_pooled(
    const at::Tensor& weight, const at::Tensor& values, const at::Tensor& lengths, const at::Tensor& weights,
    at::IntArrayRef features, at::IntArrayRef num_embeddings, at::IntArrayRef rotations,
    at::IntArrayRef row_offsets, at::IntArrayRef combiners, int64_t num_sparsecores, int64_t batch_size,
    int64_t rows_per_sparsecore, int64_t bound) {
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(),
              "inference_lookup_pooled: weight must be a contiguous 2-D table");
  TORCH_CHECK(weight.size(0) == num_sparsecores * rows_per_sparsecore, "inference_lookup_pooled: weight has ",
              weight.size(0), " rows, expected ", num_sparsecores, " x ", rows_per_sparsecore);
  TORCH_CHECK(values.scalar_type() == at::kLong || values.scalar_type() == at::kInt,
              "inference_lookup_pooled: ids must be int64 or int32, got ", values.scalar_type());
  const StackArgs args{features, num_embeddings, rotations, row_offsets, combiners,
                       num_sparsecores, batch_size, rows_per_sparsecore};
  const int64_t n = num_sparsecores;
  const int64_t num_bags = static_cast<int64_t>(features.size()) * batch_size;
  const int64_t dim = weight.size(1);
  const auto v = values.contiguous();
  const auto l = lengths.contiguous().to(at::kLong);
  const auto w = weights.defined() && weights.numel() ? weights.contiguous().to(at::kFloat) : at::Tensor();
  const std::vector<int64_t> starts = bag_starts(l.const_data_ptr<int64_t>(), l.numel());
  TORCH_CHECK(starts.back() == v.numel(), "inference_lookup_pooled: lengths sum to ", starts.back(), " but there are ",
              v.numel(), " ids");
  auto out = at::empty({num_bags, dim}, weight.options().dtype(at::kFloat));
  const int64_t num_chunks = std::max<int64_t>(1, std::min<int64_t>(num_bags / 256, 8 * kernel_threads()));
  // Counting costs a tenth of a lookup whose rows come from cache (Zipf ids);
  // it is skipped when no receiver's batch slice carries more than `bound` ids.
  const bool counting = most_ids_per_receiver(starts, features, batch_size, n) > bound;
  std::vector<int64_t> chunk_counts(counting ? num_chunks * n * n : 0, 0);
  std::vector<int64_t> bad(num_chunks * 2, -1);
  std::atomic<bool> over{false};
  AT_DISPATCH_INDEX_TYPES(v.scalar_type(), "inference_lookup_pooled", [&] {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, weight.scalar_type(), "inference_lookup_pooled", [&] {
      with_row_width(dim, [&](auto width) {
        for_each_chunk(num_chunks, [&](const ChunkClaim& claim) {
          ChunkLookup<index_t, scalar_t, decltype(width)::value> lookup(
              args, v.const_data_ptr<index_t>(), w.defined() ? w.const_data_ptr<float>() : nullptr, starts,
              weight.const_data_ptr<scalar_t>(), dim, out.mutable_data_ptr<float>());
          for (int64_t c; claim(c);) {
            if (!lookup.run(num_bags * c / num_chunks, num_bags * (c + 1) / num_chunks,
                            counting ? chunk_counts.data() + c * n * n : nullptr, bad.data() + 2 * c, bound,
                            over)) {
              return;
            }
          }
        });
      });
    });
  });
  if (over) return {out, -1, 0, true};
  for (int64_t c = 0; c < num_chunks; ++c) {
    if (bad[2 * c] >= 0) return {out, bad[2 * c], bad[2 * c + 1], false};
  }
  if (!counting) return {out, -1, 0, false};
  std::vector<int64_t> total(n * n, 0);
  for (int64_t c = 0; c < num_chunks; ++c)
    for (int64_t p = 0; p < n * n; ++p) total[p] += chunk_counts[c * n * n + p];
  return {out, -1, 0, *std::max_element(total.begin(), total.end()) > bound};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(sparsecore, m) {
  m.def(
      "inference_lookup_pooled(Tensor weight, Tensor values, Tensor lengths, Tensor weights, int[] features, "
      "int[] num_embeddings, int[] rotations, int[] row_offsets, int[] combiners, int num_sparsecores, "
      "int batch_size, int rows_per_sparsecore, int bound) -> (Tensor, int, int, bool)");
  m.impl("inference_lookup_pooled", c10::DispatchKey::CPU, TORCH_FN(inference_lookup_pooled));
  m.impl("inference_lookup_pooled", c10::DispatchKey::PrivateUse1, TORCH_FN(inference_lookup_pooled));
}

}  // namespace sparsecore
