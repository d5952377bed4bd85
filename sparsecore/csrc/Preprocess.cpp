// Host preprocessing of a pooled stack into per-SparseCore CSR-wrapped COO
// buffers (the layout is described in sparsecore/preprocess.py), read straight
// from the KJT's tensors.
//
// Pass 1, parallel over chunks of bags: validate ids, map them to (owner,
// row), merge duplicates within each bag, stage the entries and count them per
// partition. Pass 2, parallel over chunks: with the counts, every chunk knows
// where its entries go inside each partition (chunk order keeps every
// partition in bag order, which the lookup relies on) and writes them there.
// Distinct rows per partition are counted with a bitmap over the rows.
//
// preprocess_lookup_pooled also does the stack's lookup inside pass 1: each
// bag is summed a few dozen entries after it is merged, while its entries are
// still in cache, so the lookup never reads the COO buffers back.

#include "BagSum.h"
#include "Bags.h"
#include "Layout.h"
#include "ThreadPool.h"

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>
#include <tuple>
#include <vector>

#if defined(__AVX512CD__) && defined(__AVX512VL__)
#include <immintrin.h>
#endif

namespace sparsecore {
namespace {

// One merged (row, bag) of a partition, as pass 1 stages it.
struct Staged {
  int32_t partition;
  int32_t row;
  int32_t bag;
  float gain;
};

inline uint64_t key_of(const Staged& x) {
  return static_cast<uint64_t>(static_cast<uint32_t>(x.partition)) << 32 | static_cast<uint32_t>(x.row);
}

// Pass 1's output for one chunk: grown, never shrunk or value-initialised
// (every entry is written before it is read).
struct StagingBuffer {
  std::unique_ptr<Staged[]> data;
  size_t capacity = 0;
  size_t size = 0;
  void reset(size_t expected) {
    if (expected > capacity) {
      data.reset(new Staged[expected]);
      capacity = expected;
    }
    size = 0;
  }
};

// Whether a bag can hold a repeated id; false means it certainly does not,
// so there is nothing to merge. Most bags of large tables hold no
// repeat. Ids are compared by their low 32 bits (a false "maybe" only costs
// the merge), in octets: one conflict detection over 16 lanes checks an
// octet pair. The pairs grow as the square of the length, but up to
// kMaxScreened ids they cost less than the merge's hash probe per id
// (measured: preprocessing at pooling 100, uniform ids, about a quarter faster;
// at pooling 20 an eighth; Zipf ids, whose bags mostly repeat, unchanged).
constexpr int64_t kMaxScreened = 128;

#if defined(__AVX512CD__) && defined(__AVX512VL__)
// Lanes outside `live` are 0, which may equal an id: only live lanes are
// tested, and a lane's conflicts are with earlier lanes only.
template <typename index_t>
inline __m256i low_bits_octet(const index_t* ids, __mmask8 live) {
  if constexpr (sizeof(index_t) == 8) {
    return _mm512_maskz_cvtepi64_epi32(live, _mm512_maskz_loadu_epi64(live, ids));
  } else {
    return _mm256_maskz_loadu_epi32(live, ids);
  }
}

template <typename index_t>
inline bool may_repeat(const index_t* ids, int64_t length) {
  if (length > kMaxScreened) return true;
  const int64_t octets = (length + 7) / 8;
  __m256i octet[kMaxScreened / 8] = {};
  __mmask8 live[kMaxScreened / 8];
  for (int64_t o = 0; o < octets; ++o) {
    live[o] = static_cast<__mmask8>((1u << std::min<int64_t>(8, length - 8 * o)) - 1);
    octet[o] = low_bits_octet(ids + 8 * o, live[o]);
  }
  // Repeats within octet a, and within a later octet b or between a and b.
  auto repeats = [&](int64_t a, int64_t b) {
    // (maskz: GCC 12's unmasked insert reads an undefined register and warns)
    const __m512i low = _mm512_maskz_inserti64x4(0xFF, _mm512_setzero_si512(), octet[a], 0);
    const __m512i pair = _mm512_maskz_inserti64x4(0xFF, low, octet[b], 1);
    const auto tested = static_cast<__mmask16>(a == b ? live[a] : live[a] | live[b] << 8);
    return _mm512_mask_test_epi32_mask(tested, _mm512_conflict_epi32(pair), _mm512_set1_epi32(-1)) != 0;
  };
  if (octets == 1) return repeats(0, 0);
  for (int64_t a = 0; a < octets; ++a)
    for (int64_t b = a + 1; b < octets; ++b)
      if (repeats(a, b)) return true;
  return false;
}
#else
template <typename index_t>
inline bool may_repeat(const index_t*, int64_t) {
  return true;
}
#endif

// Merges ids repeated within one bag (gains summed), in place; returns the
// merged count. `ids` are the bag's ids, one per entry: bags they show free
// of repeats are left as they are. Bags are short, so a small
// open-addressing table beats sorting them; bags past 128 ids are sorted.
class BagMerger {
 public:
  template <typename index_t>
  __attribute__((always_inline)) size_t merge(Staged* bag, const index_t* ids, size_t size) {
    if (size <= 1 || !may_repeat(ids, static_cast<int64_t>(size))) return size;
    if (size > kSmall) {
      std::sort(bag, bag + size, [](const Staged& a, const Staged& b) { return key_of(a) < key_of(b); });
      size_t out = 0;
      for (size_t i = 0; i < size; ++i) {
        if (out > 0 && key_of(bag[out - 1]) == key_of(bag[i])) {
          bag[out - 1].gain += bag[i].gain;
        } else {
          bag[out++] = bag[i];
        }
      }
      return out;
    }
    // A slot holds (bag tag << 8 | index into the bag); slots of other bags'
    // tags are empty, so nothing is cleared between bags.
    if (++tag_ == kTags) {
      std::fill(slot_, slot_ + kSlots, 0u);
      tag_ = 1;
    }
    size_t out = 0;
    for (size_t i = 0; i < size; ++i) {
      const uint64_t key = key_of(bag[i]);
      uint32_t h = static_cast<uint32_t>((key * 0x9E3779B97F4A7C15ull) >> 56);  // 8 bits
      for (;; h = (h + 1) & (kSlots - 1)) {
        const uint32_t slot = slot_[h];
        if (slot >> 8 != tag_) {
          bag[out] = bag[i];
          slot_[h] = tag_ << 8 | static_cast<uint32_t>(out++);
          break;
        }
        if (key_of(bag[slot & 255]) == key) {
          bag[slot & 255].gain += bag[i].gain;
          break;
        }
      }
    }
    return out;
  }

 private:
  static constexpr size_t kSmall = 128;  // at most half the slots used
  static constexpr uint32_t kSlots = 256;
  static constexpr uint32_t kTags = 1u << 24;
  uint32_t slot_[kSlots] = {};  // tag 0: never a bag's
  uint32_t tag_ = 0;
};

// Pass 1's bag sink when only the buffers are wanted.
struct NoLookup {
  struct Chunk {
    void add(int64_t, const Staged*, size_t) {}
    void flush() {}
  };
  Chunk chunk() const { return {}; }
};

// Pass 1's bag sink for preprocess_lookup_pooled: sums every bag into its
// output row. A chunk's bags arrive in bag order, merged; a bag is summed once
// kLag entries of later bags are staged, so rows can be asked for ahead.
template <typename scalar_t, int64_t kDim>
class FusedLookup {
 public:
  FusedLookup(const scalar_t* table, int64_t dim, int64_t n, int64_t rows_per_sc, OutputRows row_of, float* out)
      : table_(table), dim_(kDim > 0 ? kDim : dim), shard_(n), n_(n), rows_per_sc_(rows_per_sc), row_of_(row_of),
        out_(out) {}

  class Chunk {
   public:
    explicit Chunk(const FusedLookup& lookup)
        : l_(lookup), scratch_(kDim > 0 ? 0 : lookup.dim_), starts_(lookup.n_ + 1) {}

    void add(int64_t bag, const Staged* entries, size_t count) {
      if (next_to_ask_ == nullptr) next_to_ask_ = entries;
      if (tail_ - head_ == kRing) pop();
      ring_[tail_++ % kRing] = {entries, count, bag};
      queued_ += count;
      staged_end_ = entries + count;
      while (tail_ > head_ && queued_ - ring_[head_ % kRing].count >= kLag) pop();
    }

    void flush() {
      while (head_ < tail_) pop();
      stream_fence();
    }

   private:
    struct Bag {
      const Staged* entries;
      size_t count;
      int64_t bag;
    };
    static constexpr size_t kRing = 64;  // bags: kLag bags of one id each must fit
    static constexpr size_t kLag = 32;   // entries, as the COO lookup's prefetch distance

    void pop() {
      const Bag b = ring_[head_++ % kRing];
      queued_ -= b.count;
      // Rows are asked for ahead of their sum, one per entry summed, so the
      // requests in flight stay level (a bag's worth at once would stall on
      // the line fill buffers): by the bag's end, kLag entries past it; then
      // on to the last bag staged, so a long bag's rows are asked for while
      // the bag before it is summed.
      ask_for(std::min(staged_end_, b.entries + b.count + kLag));
      BagSum<scalar_t, kDim> sum(l_.dim_, scratch_.data());  // a local: its sum stays in registers
      sum.clear();
      auto add_row = [&](const Staged& e) {
        sum.add(l_.row(e), e.gain);
        if (next_to_ask_ < staged_end_) ask_for(next_to_ask_ + 1);
      };
      if (b.count > 1 && l_.n_ > 1) {
        // The COO lookup sums a bag owner by owner (its groups), each in
        // staged order: the same order gives the same bits. A stable
        // counting sort of the bag's entries by owner.
        std::fill(starts_.begin(), starts_.end(), 0);
        for (size_t i = 0; i < b.count; ++i) ++starts_[l_.owner(b.entries[i]) + 1];
        for (int64_t o = 0; o < l_.n_; ++o) starts_[o + 1] += starts_[o];
        order_.resize(b.count);
        for (size_t i = 0; i < b.count; ++i) order_[starts_[l_.owner(b.entries[i])]++] = &b.entries[i];
        for (const Staged* e : order_) add_row(*e);
      } else {
        for (size_t i = 0; i < b.count; ++i) add_row(b.entries[i]);
      }
      sum.store(l_.out_ + l_.row_of_(b.bag) * l_.dim_);
    }

    void ask_for(const Staged* end) {
      for (; next_to_ask_ < end; ++next_to_ask_) prefetch_bytes(l_.row(*next_to_ask_), l_.dim_ * sizeof(scalar_t));
    }

    const FusedLookup& l_;
    Bag ring_[kRing];
    size_t head_ = 0, tail_ = 0, queued_ = 0;
    const Staged* staged_end_ = nullptr;   // past the last bag added
    const Staged* next_to_ask_ = nullptr;  // the first staged entry whose row is not yet asked for
    std::vector<float> scratch_;  // BagSum's, for any row width
    std::vector<int64_t> starts_;
    std::vector<const Staged*> order_;  // the bag's entries in summing order
  };

  Chunk chunk() const { return Chunk(*this); }

 private:
  int64_t owner(const Staged& e) const { return shard_.owner(e.partition); }
  const scalar_t* row(const Staged& e) const {
    return table_ + (owner(e) * rows_per_sc_ + e.row) * dim_;
  }

  const scalar_t* table_;
  int64_t dim_;
  ShardMap shard_;  // partition -> owner: partitions are receiver * n + owner
  int64_t n_, rows_per_sc_;
  OutputRows row_of_;
  float* out_;
};

// A partition's entries after the limits, for the (rare) dropping path.
struct Entry {
  int32_t row;
  int32_t bag;
  float gain;
};

// Distinct rows of one partition: a bitmap over the SparseCore's rows, reused
// across partitions by clearing exactly the bits that were set.
class DistinctRows {
 public:
  explicit DistinctRows(int64_t rows) : bits_((rows + 63) / 64, 0) {}
  int64_t count(const int32_t* rows, int64_t n) {
    int64_t distinct = 0;
    for (int64_t i = 0; i < n; ++i) {
      uint64_t& word = bits_[rows[i] >> 6];
      const uint64_t bit = uint64_t{1} << (rows[i] & 63);
      distinct += (word & bit) == 0;
      word |= bit;
    }
    if (n > static_cast<int64_t>(bits_.size()) / 8) {
      std::fill(bits_.begin(), bits_.end(), 0);  // many rows: a sweep beats scattered stores
    } else {
      for (int64_t i = 0; i < n; ++i) bits_[rows[i] >> 6] = 0;
    }
    return distinct;
  }
  bool test_and_set(int32_t row) {
    uint64_t& word = bits_[row >> 6];
    const uint64_t bit = uint64_t{1} << (row & 63);
    const bool was = (word & bit) != 0;
    word |= bit;
    return was;
  }
  // Only the row's own bit: its word holds the bits of other rows still counted.
  void clear(int32_t row) { bits_[row >> 6] &= ~(uint64_t{1} << (row & 63)); }

 private:
  std::vector<uint64_t> bits_;
};

struct Buffers {
  at::Tensor row_pointers, embedding_ids, sample_ids, gains;
};

// Group starts (each owner group of a receiver at a multiple of 8) and the
// zero-padded buffers for the given partition sizes.
Buffers allocate(const std::vector<int64_t>& totals, int64_t n, std::vector<int64_t>& group_start,
                 const at::Device& device) {
  Buffers out;
  const auto opts = at::TensorOptions().device(device);
  out.row_pointers = at::empty({n, n}, opts.dtype(at::kInt));
  auto* rp = out.row_pointers.mutable_data_ptr<int32_t>();
  group_start.assign(n * n, 0);
  int64_t width = 0;
  for (int64_t s = 0; s < n; ++s) {
    int64_t offset = 0;
    for (int64_t o = 0; o < n; ++o) {
      group_start[s * n + o] = offset;
      rp[s * n + o] = static_cast<int32_t>(offset + totals[s * n + o]);
      offset += align_up(totals[s * n + o]);
    }
    width = std::max(width, offset);
  }
  width = bucket_width(width);
  for (int64_t p = 0; p < n * n; ++p) group_start[p] += (p / n) * width;  // flat offsets
  // Entries overwrite everything but the padding, so only the padding is filled.
  out.embedding_ids = at::empty({n, width}, opts.dtype(at::kInt));
  out.sample_ids = at::empty({n, width}, opts.dtype(at::kInt));
  out.gains = at::empty({n, width}, opts.dtype(at::kFloat));
  int32_t* eid = out.embedding_ids.mutable_data_ptr<int32_t>();
  int32_t* sid = out.sample_ids.mutable_data_ptr<int32_t>();
  float* gn = out.gains.mutable_data_ptr<float>();
  auto pad = [&](int64_t begin, int64_t end) {
    std::fill(eid + begin, eid + end, 0);
    std::fill(sid + begin, sid + end, -1);
    std::fill(gn + begin, gn + end, 0.0f);
  };
  for (int64_t s = 0; s < n; ++s) {
    for (int64_t o = 0; o < n; ++o) {
      const int64_t end = group_start[s * n + o] + totals[s * n + o];
      const int64_t next = o + 1 < n ? group_start[s * n + o + 1] : (s + 1) * width;
      pad(end, next);
    }
  }
  return out;
}

using Preprocessed = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, int64_t, int64_t, int64_t>;

template <typename index_t, typename Sink>
Preprocessed preprocess_impl(
    const at::Tensor& values, const at::Tensor& lengths, const at::Tensor& weights, at::IntArrayRef features,
    at::IntArrayRef num_embeddings, at::IntArrayRef rotations, at::IntArrayRef row_offsets,
    at::IntArrayRef combiners, int64_t n, int64_t batch_size, int64_t rows_per_sc, int64_t max_ids,
    int64_t max_unique, bool allow_drop, const at::Device& device, const Sink& sink) {
  const auto v = values.contiguous();
  const auto l = lengths.contiguous().to(at::kLong);
  const auto w = weights.defined() && weights.numel() ? weights.contiguous().to(at::kFloat) : at::Tensor();
  const index_t* ids = v.const_data_ptr<index_t>();
  const int64_t* lens = l.const_data_ptr<int64_t>();
  const float* wts = w.defined() ? w.const_data_ptr<float>() : nullptr;
  const int64_t slots = static_cast<int64_t>(features.size());

  // Start of every bag of the whole KJT (feature-major).
  const std::vector<int64_t> starts = bag_starts(lens, l.numel());
  TORCH_CHECK(starts.back() == v.numel(), "preprocess_pooled: lengths sum to ", starts.back(),
              " but there are ", v.numel(), " ids");

  // Pass 1, parallel over chunks of the stack's bags (slot-major: bag = slot * B + b):
  // validate, map to (owner, row), merge within the bag, stage with counts.
  const int64_t slice = batch_slice(batch_size, n);
  const int64_t num_bags = slots * batch_size;
  // Ids in the stack's bags [k_begin, k_end): within a slot its bags are one
  // run of the KJT's.
  auto ids_of_bags = [&](int64_t k_begin, int64_t k_end) {
    int64_t ids = 0;
    for (int64_t slot = k_begin / std::max<int64_t>(batch_size, 1); slot * batch_size < k_end; ++slot) {
      const int64_t first = features[slot] * batch_size;
      ids += starts[first + std::min(k_end - slot * batch_size, batch_size)] -
             starts[first + std::max<int64_t>(k_begin - slot * batch_size, 0)];
    }
    return ids;
  };
  const int64_t num_chunks = std::max<int64_t>(1, std::min<int64_t>(num_bags / 256, 8 * kernel_threads()));
  // Staging buffers stay with the calling thread between calls: fresh pages
  // would cost a fault each.
  // (A reference: worker threads must see the caller's buffers, not their own.)
  thread_local std::vector<StagingBuffer> staging;
  std::vector<StagingBuffer>& staged = staging;
  if (static_cast<int64_t>(staged.size()) < num_chunks) staged.resize(num_chunks);
  std::vector<int64_t> counts(num_chunks * n * n, 0);
  std::vector<int64_t> bad(num_chunks * 2, -1);
  for_each_chunk(num_chunks, [&](const ChunkClaim& claim) {
    std::vector<float> gains;
    BagMerger merger;
    const ShardMap map(n);  // a local: kept in registers across the stores below
    for (int64_t c; claim(c);) {
      int64_t* count = counts.data() + c * n * n;
      const int64_t k_begin = num_bags * c / num_chunks, k_end = num_bags * (c + 1) / num_chunks;
      staged[c].reset(static_cast<size_t>(ids_of_bags(k_begin, k_end)));
      Staged* out = staged[c].data.get();
      auto bags = sink.chunk();
      for (BagCursor at(k_begin, batch_size, slice, n); at.k < k_end; at.next()) {
        const int64_t k = at.k, j = at.slot, b = at.b;
        const int64_t bag_index = features[j] * batch_size + b;
        const int64_t begin = starts[bag_index], length = starts[bag_index + 1] - begin;
        if (length == 0) {
          bags.add(k, out, 0);
          continue;
        }
        const std::optional<float> shared = bag_gains(wts, begin, length, combiners[j], gains);
        const bool shared_gain = shared.has_value();
        const float gain = shared.value_or(0.0f);
        const int64_t rotation = rotations[j], row_offset = row_offsets[j];
        // Nothing of a bad bag is staged.
        if (const index_t* first_bad = first_outside(ids + begin, length, num_embeddings[j])) {
          bad[2 * c] = j;
          bad[2 * c + 1] = static_cast<int64_t>(*first_bad);
          return;
        }
        for (int64_t i = 0; i < length; ++i) {
          const int64_t shifted = static_cast<int64_t>(ids[begin + i]) + rotation;
          out[i] = {at.receiver_base + static_cast<int32_t>(map.owner(shifted)),
                    static_cast<int32_t>(row_offset + map.row(shifted)), static_cast<int32_t>(k),
                    shared_gain ? gain : gains[i]};
        }
        const size_t merged = merger.merge(out, ids + begin, static_cast<size_t>(length));
        for (size_t i = 0; i < merged; ++i) ++count[out[i].partition];
        bags.add(k, out, merged);
        out += merged;
      }
      bags.flush();
      staged[c].size = static_cast<size_t>(out - staged[c].data.get());
    }
  });
  for (int64_t c = 0; c < num_chunks; ++c) {
    if (bad[2 * c] >= 0) {
      return {at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), 0, bad[2 * c], bad[2 * c + 1]};
    }
  }

  // Pass 2: place every chunk's entries at its own offsets inside each
  // partition (chunk order keeps bag order), in parallel over chunks.
  std::vector<int64_t> totals(n * n, 0);
  for (int64_t c = 0; c < num_chunks; ++c)
    for (int64_t p = 0; p < n * n; ++p) totals[p] += counts[c * n * n + p];
  std::vector<int64_t> group_start;
  Buffers buf = allocate(totals, n, group_start, device);
  int32_t* eid = buf.embedding_ids.mutable_data_ptr<int32_t>();
  int32_t* sid = buf.sample_ids.mutable_data_ptr<int32_t>();
  float* gn = buf.gains.mutable_data_ptr<float>();
  std::vector<int64_t> cursor(num_chunks * n * n);
  for (int64_t p = 0; p < n * n; ++p) {
    int64_t offset = group_start[p];
    for (int64_t c = 0; c < num_chunks; ++c) {
      cursor[c * n * n + p] = offset;
      offset += counts[c * n * n + p];
    }
  }
  for_each_chunk(num_chunks, [&](const ChunkClaim& claim) {
    for (int64_t c; claim(c);) {
      int64_t* at = cursor.data() + c * n * n;
      for (const Staged* e = staged[c].data.get(); e != staged[c].data.get() + staged[c].size; ++e) {
        const int64_t i = at[e->partition]++;
        eid[i] = e->row;
        sid[i] = e->bag;
        gn[i] = e->gain;
      }
    }
  });

  // What each partition needed: ids and distinct rows.
  auto part_counts = at::zeros({n, n, 2}, at::kLong);
  int64_t* pc = part_counts.mutable_data_ptr<int64_t>();
  parallel_for(0, n * n, 1, [&](int64_t first, int64_t last) {
    DistinctRows distinct(rows_per_sc);
    for (int64_t p = first; p < last; ++p) {
      pc[2 * p] = totals[p];
      pc[2 * p + 1] = distinct.count(eid + group_start[p], totals[p]);
    }
  });
  bool over = false;
  for (int64_t p = 0; p < n * n; ++p) over |= pc[2 * p] > max_ids || pc[2 * p + 1] > max_unique;
  if (!over || !allow_drop) {
    return {buf.row_pointers, buf.embedding_ids, buf.sample_ids, buf.gains, part_counts, 0, -1, 0};
  }

  // Dropping (rare): keep each partition's entries in order while they fit, then lay out again.
  std::vector<std::vector<Entry>> kept(n * n);
  int64_t dropped = 0;
  DistinctRows seen(rows_per_sc);
  for (int64_t p = 0; p < n * n; ++p) {
    int64_t distinct = 0;
    for (int64_t i = group_start[p]; i < group_start[p] + totals[p]; ++i) {
      if (static_cast<int64_t>(kept[p].size()) >= max_ids) break;
      if (!seen.test_and_set(eid[i])) {
        if (distinct >= max_unique) {
          seen.clear(eid[i]);
          continue;
        }
        ++distinct;
      }
      kept[p].push_back({eid[i], sid[i], gn[i]});
    }
    for (const auto& e : kept[p]) seen.clear(e.row);
    dropped += totals[p] - static_cast<int64_t>(kept[p].size());
    totals[p] = static_cast<int64_t>(kept[p].size());
  }
  Buffers out = allocate(totals, n, group_start, device);
  int32_t* oe = out.embedding_ids.mutable_data_ptr<int32_t>();
  int32_t* os = out.sample_ids.mutable_data_ptr<int32_t>();
  float* og = out.gains.mutable_data_ptr<float>();
  for (int64_t p = 0; p < n * n; ++p) {
    for (size_t i = 0; i < kept[p].size(); ++i) {
      oe[group_start[p] + i] = kept[p][i].row;
      os[group_start[p] + i] = kept[p][i].bag;
      og[group_start[p] + i] = kept[p][i].gain;
    }
  }
  return {out.row_pointers, out.embedding_ids, out.sample_ids, out.gains, part_counts, dropped, -1, 0};
}

template <typename Sink>
Preprocessed preprocess_with(
    const at::Tensor& values, const at::Tensor& lengths, const at::Tensor& weights, at::IntArrayRef features,
    at::IntArrayRef num_embeddings, at::IntArrayRef rotations, at::IntArrayRef row_offsets,
    at::IntArrayRef combiners, int64_t num_sparsecores, int64_t batch_size, int64_t rows_per_sparsecore,
    int64_t max_ids, int64_t max_unique, bool allow_drop, const at::Device& device, const Sink& sink) {
  TORCH_CHECK(values.scalar_type() == at::kLong || values.scalar_type() == at::kInt,
              "preprocess_pooled: ids must be int64 or int32, got ", values.scalar_type());
  if (values.scalar_type() == at::kLong) {
    return preprocess_impl<int64_t>(values, lengths, weights, features, num_embeddings, rotations, row_offsets,
                                    combiners, num_sparsecores, batch_size, rows_per_sparsecore, max_ids,
                                    max_unique, allow_drop, device, sink);
  }
  return preprocess_impl<int32_t>(values, lengths, weights, features, num_embeddings, rotations, row_offsets,
                                  combiners, num_sparsecores, batch_size, rows_per_sparsecore, max_ids,
                                  max_unique, allow_drop, device, sink);
}

// The buffers are allocated on `device` (host memory either way: a tpu
// device's allocator caches blocks, and the lookup reads them there).
// Returns the COO buffers, per-partition (ids, distinct rows) counts, the
// number of dropped ids, and (slot, id) of the first out-of-range id (slot
// -1 when all are valid; nothing else is built then).
Preprocessed preprocess_pooled(
    const at::Tensor& values, const at::Tensor& lengths, const at::Tensor& weights, at::IntArrayRef features,
    at::IntArrayRef num_embeddings, at::IntArrayRef rotations, at::IntArrayRef row_offsets,
    at::IntArrayRef combiners, int64_t num_sparsecores, int64_t batch_size, int64_t rows_per_sparsecore,
    int64_t max_ids, int64_t max_unique, bool allow_drop, at::Device device) {
  return preprocess_with(values, lengths, weights, features, num_embeddings, rotations, row_offsets, combiners,
                         num_sparsecores, batch_size, rows_per_sparsecore, max_ids, max_unique, allow_drop, device,
                         NoLookup{});
}

// preprocess_pooled, and the stack's lookup in `weight` (the lookup op's
// output) done on the way. When ids were dropped the output is of the ids
// before dropping: the caller looks up the returned buffers instead.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, int64_t, int64_t, int64_t, at::Tensor>
preprocess_lookup_pooled(
    const at::Tensor& weight, const at::Tensor& values, const at::Tensor& lengths, const at::Tensor& weights,
    at::IntArrayRef features, at::IntArrayRef num_embeddings, at::IntArrayRef rotations,
    at::IntArrayRef row_offsets, at::IntArrayRef combiners, int64_t num_sparsecores, int64_t batch_size,
    int64_t rows_per_sparsecore, int64_t max_ids, int64_t max_unique, bool allow_drop, at::Device device) {
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(),
              "preprocess_lookup_pooled: weight must be a contiguous 2-D table");
  TORCH_CHECK(weight.size(0) == num_sparsecores * rows_per_sparsecore, "preprocess_lookup_pooled: weight has ",
              weight.size(0), " rows, expected ", num_sparsecores, " x ", rows_per_sparsecore);
  const int64_t num_bags = static_cast<int64_t>(features.size()) * batch_size;
  const int64_t dim = weight.size(1);
  auto out = at::empty({num_bags, dim}, weight.options().dtype(at::kFloat));
  const OutputRows row_of{std::max<int64_t>(batch_size, 1), static_cast<int64_t>(features.size())};
  Preprocessed result;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, weight.scalar_type(), "preprocess_lookup_pooled", [&] {
    with_row_width(dim, [&](auto width) {
      const FusedLookup<scalar_t, decltype(width)::value> sink(weight.const_data_ptr<scalar_t>(), dim,
                                                               num_sparsecores, rows_per_sparsecore, row_of,
                                                               out.mutable_data_ptr<float>());
      result = preprocess_with(values, lengths, weights, features, num_embeddings, rotations, row_offsets, combiners,
                               num_sparsecores, batch_size, rows_per_sparsecore, max_ids, max_unique, allow_drop,
                               device, sink);
    });
  });
  return std::tuple_cat(std::move(result), std::make_tuple(out));
}

} // namespace

TORCH_LIBRARY_FRAGMENT(sparsecore, m) {
  m.def(
      "preprocess_pooled(Tensor values, Tensor lengths, Tensor weights, int[] features, "
      "int[] num_embeddings, int[] rotations, int[] row_offsets, int[] combiners, int num_sparsecores, "
      "int batch_size, int rows_per_sparsecore, int max_ids, int max_unique, bool allow_drop, "
      "Device device) "
      "-> (Tensor, Tensor, Tensor, Tensor, Tensor, int, int, int)");
  m.impl("preprocess_pooled", c10::DispatchKey::CPU, TORCH_FN(preprocess_pooled));
  m.def(
      "preprocess_lookup_pooled(Tensor weight, Tensor values, Tensor lengths, Tensor weights, int[] features, "
      "int[] num_embeddings, int[] rotations, int[] row_offsets, int[] combiners, int num_sparsecores, "
      "int batch_size, int rows_per_sparsecore, int max_ids, int max_unique, bool allow_drop, "
      "Device device) "
      "-> (Tensor, Tensor, Tensor, Tensor, Tensor, int, int, int, Tensor)");
  m.impl("preprocess_lookup_pooled", c10::DispatchKey::CPU, TORCH_FN(preprocess_lookup_pooled));
  m.impl("preprocess_lookup_pooled", c10::DispatchKey::PrivateUse1, TORCH_FN(preprocess_lookup_pooled));
}

} // namespace sparsecore
