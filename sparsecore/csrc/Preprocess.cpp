// Host preprocessing of a pooled stack into per-SparseCore CSR-wrapped COO
// buffers (the layout is described in sparsecore/preprocess.py). One pass per
// receiving SparseCore, in parallel: a receiver's samples only ever land in
// its own partitions, so no two threads touch the same output.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

namespace sparsecore {
namespace {

constexpr int64_t kAlignment = 8;

enum Combiner : int64_t { kSum = 0, kMean = 1, kSqrtn = 2 };

struct Entry {
  int32_t row;     // local row on the owner
  int32_t bag;     // output row
  float gain;
};

struct Id {
  int32_t owner;
  int32_t row;
  float gain;
};

// Distinct rows of one partition, counted with an open-addressing set.
class RowSet {
 public:
  explicit RowSet(size_t expected) {
    size_t cap = 16;
    while (cap < expected * 2) cap <<= 1;
    slots_.assign(cap, -1);
    mask_ = cap - 1;
  }
  bool contains(int32_t row) const { return slots_[find(row)] == row; }
  void insert(int32_t row) {
    auto& slot = slots_[find(row)];
    if (slot != row) {
      slot = row;
      ++size_;
    }
  }
  size_t size() const { return size_; }

 private:
  size_t find(int32_t row) const {
    size_t h = (static_cast<uint32_t>(row) * 2654435761u) & mask_;
    while (slots_[h] != -1 && slots_[h] != row) h = (h + 1) & mask_;
    return h;
  }
  std::vector<int32_t> slots_;
  size_t mask_ = 0;
  size_t size_ = 0;
};

struct Partition {
  std::vector<Entry> entries;
  int64_t observed_ids = 0;
  int64_t observed_unique = 0;
  int64_t dropped = 0;
};

// Applies the limits to one partition: counts what it needed, and with
// dropping keeps entries in order while they fit.
void limit(Partition& p, int64_t max_ids, int64_t max_unique, bool allow_drop) {
  RowSet all(p.entries.size());
  for (const auto& e : p.entries) all.insert(e.row);
  p.observed_ids = static_cast<int64_t>(p.entries.size());
  p.observed_unique = static_cast<int64_t>(all.size());
  if (!allow_drop || (p.observed_ids <= max_ids && p.observed_unique <= max_unique)) {
    return;
  }
  RowSet kept(std::min<size_t>(p.entries.size(), static_cast<size_t>(max_unique)));
  std::vector<Entry> out;
  out.reserve(std::min<size_t>(p.entries.size(), static_cast<size_t>(max_ids)));
  for (const auto& e : p.entries) {
    if (static_cast<int64_t>(out.size()) >= max_ids) break;
    if (!kept.contains(e.row)) {
      if (static_cast<int64_t>(kept.size()) >= max_unique) continue;
      kept.insert(e.row);
    }
    out.push_back(e);
  }
  p.dropped = p.observed_ids - static_cast<int64_t>(out.size());
  p.entries = std::move(out);
}

// id -> (owner, row) under mod sharding; shifts and masks when n is a power
// of two (the common case), since a division per id costs more than the rest.
class ShardMap {
 public:
  explicit ShardMap(int64_t n) : n_(n), pow2_((n & (n - 1)) == 0) {
    while ((int64_t{1} << shift_) < n) ++shift_;
  }
  int64_t owner(int64_t id) const { return pow2_ ? (id & (n_ - 1)) : id % n_; }
  int64_t row(int64_t id) const { return pow2_ ? (id >> shift_) : id / n_; }

 private:
  int64_t n_;
  bool pow2_;
  int shift_ = 0;
};

// Bags are short: insertion sort by (owner, row) beats std::sort there.
void sort_bag(std::vector<Id>& bag) {
  auto less = [](const Id& a, const Id& b) { return a.owner != b.owner ? a.owner < b.owner : a.row < b.row; };
  if (bag.size() > 32) {
    std::sort(bag.begin(), bag.end(), less);
    return;
  }
  for (size_t i = 1; i < bag.size(); ++i) {
    Id x = bag[i];
    size_t j = i;
    for (; j > 0 && less(x, bag[j - 1]); --j) bag[j] = bag[j - 1];
    bag[j] = x;
  }
}

// Gains of one bag's ids: weight times the combiner's scale.
void bag_gains(const float* weights, int64_t begin, int64_t length, int64_t combiner, std::vector<float>& out) {
  out.resize(length);
  double sq = 0;
  for (int64_t i = 0; i < length; ++i) {
    out[i] = weights ? weights[begin + i] : 1.0f;
    sq += static_cast<double>(out[i]) * out[i];
  }
  float scale = 1.0f;
  if (combiner == kMean) {
    scale = length > 0 ? 1.0f / static_cast<float>(length) : 0.0f;
  } else if (combiner == kSqrtn) {
    scale = sq > 0 ? static_cast<float>(1.0 / std::sqrt(sq)) : 0.0f;
  }
  for (auto& g : out) g *= scale;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, int64_t> preprocess_pooled(
    const at::Tensor& values, const at::Tensor& lengths, const at::Tensor& weights,
    at::IntArrayRef rotations, at::IntArrayRef row_offsets, at::IntArrayRef combiners,
    int64_t num_sparsecores, int64_t batch_size, int64_t max_ids, int64_t max_unique,
    bool allow_drop) {
  TORCH_CHECK(values.scalar_type() == at::kLong && lengths.scalar_type() == at::kLong,
              "preprocess_pooled: values and lengths must be int64");
  const int64_t n = num_sparsecores;
  const int64_t num_features = static_cast<int64_t>(rotations.size());
  TORCH_CHECK(lengths.numel() == num_features * batch_size, "preprocess_pooled: lengths must be features x batch");
  const auto v = values.contiguous();
  const auto l = lengths.contiguous();
  const auto w = weights.defined() && weights.numel() ? weights.contiguous().to(at::kFloat) : at::Tensor();
  const int64_t* ids = v.const_data_ptr<int64_t>();
  const int64_t* lens = l.const_data_ptr<int64_t>();
  const float* wts = w.defined() ? w.const_data_ptr<float>() : nullptr;

  // Start of every bag in values (feature-major, like a KJT).
  std::vector<int64_t> starts(num_features * batch_size + 1, 0);
  for (int64_t i = 0; i < num_features * batch_size; ++i) starts[i + 1] = starts[i] + lens[i];
  TORCH_CHECK(starts.back() == v.numel(), "preprocess_pooled: lengths sum to ", starts.back(),
              " but there are ", v.numel(), " ids");

  const int64_t slice = std::max<int64_t>((batch_size + n - 1) / n, 1);
  const int64_t num_bags = num_features * batch_size;
  const ShardMap shard(n);
  // Bags are processed in chunks, in parallel; each chunk keeps its own
  // per-partition lists, joined in chunk order so every partition stays in
  // bag order (the lookup relies on it).
  const int64_t num_chunks = std::max<int64_t>(1, std::min<int64_t>(num_bags / 512, 4 * at::get_num_threads()));
  std::vector<std::vector<std::vector<Entry>>> chunk_parts(num_chunks, std::vector<std::vector<Entry>>(n * n));
  at::parallel_for(0, num_chunks, 1, [&](int64_t first_chunk, int64_t last_chunk) {
    std::vector<Id> bag;
    std::vector<float> gains;
    for (int64_t c = first_chunk; c < last_chunk; ++c) {
      auto& parts = chunk_parts[c];
      const int64_t k_begin = num_bags * c / num_chunks, k_end = num_bags * (c + 1) / num_chunks;
      for (int64_t k = k_begin; k < k_end; ++k) {
        const int64_t begin = starts[k], length = starts[k + 1] - begin;
        if (length == 0) continue;
        const int64_t f = k / batch_size, s = (k % batch_size) / slice;
        bag_gains(wts, begin, length, combiners[f], gains);
        bag.resize(length);
        for (int64_t i = 0; i < length; ++i) {
          const int64_t shifted = ids[begin + i] + rotations[f];
          bag[i] = {static_cast<int32_t>(shard.owner(shifted)),
                    static_cast<int32_t>(row_offsets[f] + shard.row(shifted)), gains[i]};
        }
        sort_bag(bag);
        // Merge duplicates within the bag: equal (owner, row) are adjacent.
        for (size_t i = 0; i < bag.size();) {
          Id merged = bag[i];
          size_t j = i + 1;
          for (; j < bag.size() && bag[j].owner == merged.owner && bag[j].row == merged.row; ++j) {
            merged.gain += bag[j].gain;
          }
          parts[s * n + merged.owner].push_back({merged.row, static_cast<int32_t>(k), merged.gain});
          i = j;
        }
      }
    }
  });
  std::vector<Partition> partitions(n * n);
  at::parallel_for(0, n * n, 1, [&](int64_t first, int64_t last) {
    for (int64_t p = first; p < last; ++p) {
      size_t total = 0;
      for (const auto& parts : chunk_parts) total += parts[p].size();
      auto& entries = partitions[p].entries;
      entries.reserve(total);
      for (auto& parts : chunk_parts) {
        entries.insert(entries.end(), parts[p].begin(), parts[p].end());
        std::vector<Entry>().swap(parts[p]);
      }
      limit(partitions[p], max_ids, max_unique, allow_drop);
    }
  });

  // Layout: each owner group of a receiver starts at a multiple of 8.
  auto row_pointers = at::empty({n, n}, at::kInt);
  auto* rp = row_pointers.mutable_data_ptr<int32_t>();
  std::vector<int64_t> group_start(n * n);
  int64_t width = 0;
  for (int64_t s = 0; s < n; ++s) {
    int64_t offset = 0;
    for (int64_t o = 0; o < n; ++o) {
      group_start[s * n + o] = offset;
      const int64_t count = static_cast<int64_t>(partitions[s * n + o].entries.size());
      rp[s * n + o] = static_cast<int32_t>(offset + count);
      offset += (count + kAlignment - 1) / kAlignment * kAlignment;
    }
    width = std::max(width, offset);
  }
  auto embedding_ids = at::zeros({n, width}, at::kInt);
  auto sample_ids = at::full({n, width}, -1, at::kInt);
  auto gains = at::zeros({n, width}, at::kFloat);
  auto* eid = embedding_ids.mutable_data_ptr<int32_t>();
  auto* sid = sample_ids.mutable_data_ptr<int32_t>();
  auto* gn = gains.mutable_data_ptr<float>();
  auto counts = at::zeros({n, n, 2}, at::kLong);  // per partition: ids, distinct rows
  auto* ct = counts.mutable_data_ptr<int64_t>();
  int64_t dropped = 0;
  for (int64_t p = 0; p < n * n; ++p) {
    const auto& part = partitions[p];
    const int64_t base = (p / n) * width + group_start[p];
    for (size_t i = 0; i < part.entries.size(); ++i) {
      eid[base + i] = part.entries[i].row;
      sid[base + i] = part.entries[i].bag;
      gn[base + i] = part.entries[i].gain;
    }
    ct[2 * p] = part.observed_ids;
    ct[2 * p + 1] = part.observed_unique;
    dropped += part.dropped;
  }
  return {row_pointers, embedding_ids, sample_ids, gains, counts, dropped};
}

} // namespace

TORCH_LIBRARY_FRAGMENT(sparsecore, m) {
  m.def(
      "preprocess_pooled(Tensor values, Tensor lengths, Tensor weights, int[] rotations, "
      "int[] row_offsets, int[] combiners, int num_sparsecores, int batch_size, int max_ids, "
      "int max_unique, bool allow_drop) -> (Tensor, Tensor, Tensor, Tensor, Tensor, int)");
  m.impl("preprocess_pooled", c10::DispatchKey::CPU, TORCH_FN(preprocess_pooled));
}

} // namespace sparsecore
