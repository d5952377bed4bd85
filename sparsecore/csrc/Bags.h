#pragma once
// Walking a pooled stack's bags straight from a KJT's tensors: what the
// preprocessing pass (Preprocess.cpp) and the inference lookup
// (InferenceLookup.cpp) share. A stack's bags are numbered slot-major,
// k = slot * batch_size + b, slot being a (table, feature) of the stack.

#include "ThreadPool.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

namespace sparsecore {

enum Combiner : int64_t { kSum = 0, kMean = 1, kSqrtn = 2 };

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

// Samples per receiving SparseCore: sample b's bags are received by SparseCore
// b / batch_slice (the last slice may be shorter).
inline int64_t batch_slice(int64_t batch_size, int64_t n) {
  return std::max<int64_t>((batch_size + n - 1) / n, 1);
}

// Walks a stack's bags k = slot * batch_size + b in order without dividing
// per bag (a division costs more than a one-id bag's other work), keeping the
// receiving SparseCore of sample b: the owner-0 partition of its batch slice.
class BagCursor {
 public:
  BagCursor(int64_t k_begin, int64_t batch_size, int64_t slice, int64_t n)
      : k(k_begin), slot(batch_size > 0 ? k_begin / batch_size : 0), b(batch_size > 0 ? k_begin % batch_size : 0),
        batch_size_(batch_size), slice_(slice), n_(n) {  // slice >= 1; an empty batch has no bags to walk
    find_receiver();
  }
  void next() {
    ++k;
    if (++b == batch_size_) {
      b = 0;
      ++slot;
    }
    if (b == 0 || b == receiver_end_) find_receiver();
  }

  int64_t k, slot, b;
  int32_t receiver_base = 0;

 private:
  void find_receiver() {
    const int64_t receiver = b / slice_;
    receiver_base = static_cast<int32_t>(receiver * n_);
    receiver_end_ = std::min((receiver + 1) * slice_, batch_size_);
  }
  int64_t batch_size_, slice_, n_;
  int64_t receiver_end_ = 0;
};

// Runs f(claim) on every kernel thread; each takes chunks one at a time with
// `for (int64_t c; claim(c);)` until none is left. Chunks of the same size
// cost unequally (a small table's rows stay in cache, a large one's do not),
// so an even split in advance leaves one thread waiting for the other.
class ChunkClaim {
 public:
  explicit ChunkClaim(int64_t num_chunks) : num_chunks_(num_chunks) {}
  bool operator()(int64_t& chunk) const {
    chunk = next_.fetch_add(1, std::memory_order_relaxed);
    return chunk < num_chunks_;
  }

 private:
  int64_t num_chunks_;
  mutable std::atomic<int64_t> next_{0};
};

template <typename F>
void for_each_chunk(int64_t num_chunks, const F& f) {
  const ChunkClaim claim(num_chunks);
  parallel_for(0, std::min(num_chunks, kernel_threads()), 1, [&](int64_t, int64_t) { f(claim); });
}

// A bag's gains, weight times the combiner's scale: the one gain all its ids
// share (unweighted sum and mean bags), or nullopt with each id's in `out`.
inline std::optional<float> bag_gains(const float* weights, int64_t begin, int64_t length, int64_t combiner,
                                      std::vector<float>& out) {
  if (weights == nullptr && combiner != kSqrtn) {
    return combiner == kMean && length > 0 ? 1.0f / static_cast<float>(length) : 1.0f;
  }
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
  return std::nullopt;
}

// Where every bag of the KJT starts in its values (lengths feature-major,
// features x batch); the last entry is the number of ids.
inline std::vector<int64_t> bag_starts(const int64_t* lengths, int64_t num_bags) {
  std::vector<int64_t> starts(num_bags + 1, 0);
  for (int64_t i = 0; i < num_bags; ++i) starts[i + 1] = starts[i] + lengths[i];
  return starts;
}

// Whether an id is outside [0, num_embeddings): negatives wrap high, so one
// unsigned comparison checks both ends (and a loop of them vectorizes).
template <typename index_t>
inline bool outside(index_t id, int64_t num_embeddings) {
  return static_cast<uint64_t>(id) >= static_cast<uint64_t>(num_embeddings);
}

// The first of a bag's ids outside [0, num_embeddings), or nullptr. They are
// checked in a loop of their own, with no branch per id, so that it
// vectorizes (about 5% off preprocessing, measured); only a bad bag is
// searched again.
template <typename index_t>
inline const index_t* first_outside(const index_t* ids, int64_t length, int64_t num_embeddings) {
  bool in_range = true;
  for (int64_t i = 0; i < length; ++i) in_range &= !outside(ids[i], num_embeddings);
  if (in_range) return nullptr;
  return std::find_if(ids, ids + length, [num_embeddings](index_t id) { return outside(id, num_embeddings); });
}

}  // namespace sparsecore
