#include "TpuShmCollectives.h"
#include "TpuThreads.h"

#include <ATen/CPUFunctions.h>
#include <ATen/Functions.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <memory>
#include <sstream>
#include <vector>

namespace torch_tpu {
namespace shm {
namespace {

using c10d::ReduceOp;
constexpr int64_t kLine = 64;

enum class Collective : int32_t { kAllReduce = 1, kBroadcast, kAllGather, kReduceScatter, kAllToAll };

const char* name_of(int32_t c) {
  switch (static_cast<Collective>(c)) {
    case Collective::kAllReduce: return "all_reduce";
    case Collective::kBroadcast: return "broadcast";
    case Collective::kAllGather: return "all_gather_into_tensor";
    case Collective::kReduceScatter: return "reduce_scatter_tensor";
    case Collective::kAllToAll: return "all_to_all_single";
  }
  return "an unknown collective";
}

const char* name_of(ReduceOp::RedOpType op) {
  static const char* names[] = {"SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "PREMUL_SUM"};
  return op >= 0 && op <= ReduceOp::PREMUL_SUM ? names[op] : "UNUSED";
}

Header header_of(Collective what, const at::Tensor& t, int32_t reduce, int32_t root) {
  Header h{};
  h.op = static_cast<int32_t>(what);
  h.dtype = static_cast<int32_t>(t.scalar_type());
  h.reduce = reduce;
  h.root = root;
  if (t.dim() > kMaxDims) {
    h.ndim = 1;
    h.sizes[0] = t.numel();
  } else {
    h.ndim = static_cast<int32_t>(t.dim());
    for (int64_t d = 0; d < t.dim(); ++d) h.sizes[d] = t.size(d);
  }
  return h;
}

// The message of what `check` raises, or "" if it raises nothing.
template <typename F>
std::string failure_of(F&& check) {
  try {
    check();
    return {};
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
}

std::string describe(const Header& h, int rank, const int64_t* send, const int64_t* recv, int world) {
  std::ostringstream out;
  out << "rank " << rank << ": " << name_of(h.op);
  if (h.reduce >= 0) out << " " << name_of(static_cast<ReduceOp::RedOpType>(h.reduce));
  if (h.root >= 0) out << " from rank " << h.root;
  out << " of " << c10::toString(static_cast<c10::ScalarType>(h.dtype)) << "[";
  for (int d = 0; d < h.ndim; ++d) out << (d ? ", " : "") << h.sizes[d];
  out << "]";
  if (send != nullptr) {
    out << " sending [";
    for (int r = 0; r < world; ++r) out << (r ? ", " : "") << send[r];
    out << "] bytes, receiving [";
    for (int r = 0; r < world; ++r) out << (r ? ", " : "") << recv[r];
    out << "] bytes";
  }
  return out.str();
}

bool same_call(const Header& a, const Header& b, bool compare_sizes) {
  if (a.op != b.op || a.dtype != b.dtype || a.reduce != b.reduce || a.root != b.root) return false;
  if (!compare_sizes) return true;
  return a.ndim == b.ndim && std::equal(a.sizes, a.sizes + a.ndim, b.sizes);
}

// One collective on a channel: rounds of writes, a barrier, then reads.
// all_to_all passes each rank's byte counts per peer, which are checked
// pairwise instead of the shapes (its ranks' tensors may differ).
class Rounds {
 public:
  Rounds(Channel& channel, const Header& mine, Timeout timeout, std::vector<int64_t> send = {},
         std::vector<int64_t> recv = {})
      : ch_(channel), mine_(mine), timeout_(timeout), send_(std::move(send)), recv_(std::move(recv)) {
    ch_.check_usable();
  }

  // A call whose arguments are wrong on this rank still takes the first
  // barrier, so that every rank raises now, with this rank's reason, instead
  // of its peers waiting for it until the timeout.
  [[noreturn]] void fail_with(const std::string& reason) {
    mine_.invalid = 1;
    std::snprintf(mine_.reason, sizeof(mine_.reason), "%s", reason.c_str());
    send_.clear();
    recv_.clear();
    begin();
    exchange();
    TORCH_CHECK(false, reason);  // not reached: exchange() raises
  }

  // The buffer set this round writes into; the first round also carries the header.
  int begin() {
    set_ = ch_.next_set();
    if (first_) {
      ch_.header(set_, ch_.rank()) = mine_;
      std::copy(send_.begin(), send_.end(), ch_.send_bytes(set_, ch_.rank()));
      std::copy(recv_.begin(), recv_.end(), ch_.recv_bytes(set_, ch_.rank()));
    }
    return set_;
  }

  // Waits for every rank's writes; after the first, checks that the calls agree.
  void exchange() {
    ch_.barrier(name_of(mine_.op), timeout_);
    if (first_) {
      first_ = false;
      check_calls();
    }
  }

  // sent[s][d]: bytes rank s sends rank d (all_to_all; known after the first exchange).
  const std::vector<std::vector<int64_t>>& sent() const { return sent_; }

 private:
  void check_calls() {
    const int world = ch_.world();
    std::ostringstream invalid;
    for (int r = 0; r < world; ++r) {
      const Header& h = ch_.header(set_, r);
      if (h.invalid) invalid << (invalid.tellp() > 0 ? "; " : "") << "rank " << r << ": " << h.reason;
    }
    if (invalid.tellp() > 0) {
      const std::string why = std::string("tpu_dist ") + name_of(mine_.op) +
          ": a rank's arguments are wrong, so no rank can complete the collective (" + invalid.str() + ")";
      ch_.break_with(why);
      TORCH_CHECK(false, why);
    }
    const bool pairwise = !send_.empty();
    bool agree = true;
    for (int r = 0; r < world; ++r) agree = agree && same_call(ch_.header(set_, r), mine_, !pairwise);
    if (agree && pairwise) {
      sent_.assign(world, std::vector<int64_t>(world));
      for (int s = 0; s < world; ++s) {
        std::copy(ch_.send_bytes(set_, s), ch_.send_bytes(set_, s) + world, sent_[s].begin());
      }
      for (int s = 0; s < world; ++s) {
        for (int d = 0; d < world; ++d) agree = agree && sent_[s][d] == ch_.recv_bytes(set_, d)[s];
      }
    }
    if (agree) return;
    std::ostringstream why;
    why << "tpu_dist " << name_of(mine_.op) << ": the ranks' calls disagree ("
        << (pairwise ? "every rank must receive from each peer exactly what that peer sends it"
                     : "every rank must call the same collective on tensors of the same shape and dtype")
        << "): ";
    for (int r = 0; r < world; ++r) {
      why << (r ? "; " : "")
          << describe(ch_.header(set_, r), r, pairwise ? ch_.send_bytes(set_, r) : nullptr,
                      pairwise ? ch_.recv_bytes(set_, r) : nullptr, world);
    }
    ch_.break_with(why.str());
    TORCH_CHECK(false, why.str());
  }

  Channel& ch_;
  Header mine_;
  Timeout timeout_;
  std::vector<int64_t> send_;
  std::vector<int64_t> recv_;
  std::vector<std::vector<int64_t>> sent_;
  int set_ = 0;
  bool first_ = true;
};

char* bytes_of(const at::Tensor& t) {
  return static_cast<char*>(t.data_ptr());
}

at::Tensor flat(char* data, int64_t bytes, at::ScalarType dtype) {
  return at::from_blob(data, {bytes / static_cast<int64_t>(c10::elementSize(dtype))},
                       at::TensorOptions().dtype(dtype));
}

void combine(at::Tensor& out, const at::Tensor& a, const at::Tensor& b, ReduceOp::RedOpType op) {
  switch (op) {
    case ReduceOp::SUM:
    case ReduceOp::AVG: at::cpu::add_out(out, a, b); return;
    case ReduceOp::PRODUCT: at::cpu::mul_out(out, a, b); return;
    case ReduceOp::MIN: at::cpu::minimum_out(out, a, b); return;
    case ReduceOp::MAX: at::cpu::maximum_out(out, a, b); return;
    case ReduceOp::BAND: at::cpu::bitwise_and_out(out, a, b); return;
    case ReduceOp::BOR: at::cpu::bitwise_or_out(out, a, b); return;
    case ReduceOp::BXOR: at::cpu::bitwise_xor_out(out, a, b); return;
    default: TORCH_CHECK(false, "tpu_dist: reduce op ", name_of(op), " is not supported here");
  }
}

// dest[0, n) = bytes [at, at + n) of every rank's slot in buffer set `set`,
// combined by op in rank order, so every rank gets the same bits.
void reduce_slots(Channel& ch, int set, int64_t at, int64_t n, char* dest, at::ScalarType dtype,
                  ReduceOp::RedOpType op) {
  // Every rank of the host reduces at the same time (measured: a 256 KiB
  // all_reduce of 2 ranks took 6.8 ms with their OpenMP teams).
  OneThreadScope one_thread;
  std::vector<at::Tensor> parts;
  for (int r = 0; r < ch.world(); ++r) parts.push_back(flat(ch.slot(set, r) + at, n, dtype));
  at::Tensor out = flat(dest, n, dtype);
  if (op == ReduceOp::AVG && at::isIntegralType(dtype, /*includeBool=*/true)) {
    // Summed in int64: a narrow type's sum overflows it (uint8 200 + 100), its average does
    // not. The average truncates, as integer division does.
    at::Tensor sum = parts[0].to(at::kLong, /*non_blocking=*/false, /*copy=*/true);  // the peers read the slots
    for (size_t i = 1; i < parts.size(); ++i) sum.add_(parts[i]);
    out.copy_(sum.div_(static_cast<int64_t>(parts.size()), "trunc"));
    return;
  }
  if (parts.size() == 1) {
    out.copy_(parts[0]);
  } else {
    combine(out, parts[0], parts[1], op);
    for (size_t i = 2; i < parts.size(); ++i) combine(out, out, parts[i], op);
  }
  if (op == ReduceOp::AVG) {
    at::cpu::div_out(out, out, at::scalar_tensor(static_cast<int64_t>(parts.size()), at::kLong));
  }
}

void copy_bytes(char* to, const char* from, int64_t n) {
  if (n > 0 && to != from) std::memmove(to, from, static_cast<size_t>(n));
}

// Bytes a round moves per (rank, peer) pair when a slot is split among the peers.
int64_t share_of_slot(const Channel& ch) {
  return ch.slot_bytes() / ch.world() / kLine * kLine;
}

int64_t piece(int64_t total, int64_t round, int64_t per_round) {
  return std::clamp<int64_t>(total - round * per_round, 0, per_round);
}

} // namespace

bool supports(ReduceOp::RedOpType op) {
  return op <= ReduceOp::BXOR;
}

void all_reduce(Channel& ch, const at::Tensor& tensor, ReduceOp::RedOpType op, Timeout timeout) {
  Rounds rounds(ch, header_of(Collective::kAllReduce, tensor, op, -1), timeout);
  const int64_t total = static_cast<int64_t>(tensor.nbytes());
  const int64_t per_round = ch.slot_bytes() / tensor.element_size() * tensor.element_size();
  int64_t offset = 0;
  do {
    const int64_t n = std::min(per_round, total - offset);
    const int set = rounds.begin();
    copy_bytes(ch.slot(set, ch.rank()), bytes_of(tensor) + offset, n);
    rounds.exchange();
    // Every rank reduces the whole round: with a few ranks this reads no more
    // memory than splitting the work, and saves a second barrier.
    reduce_slots(ch, set, 0, n, bytes_of(tensor) + offset, tensor.scalar_type(), op);
    offset += n;
  } while (offset < total);
}

void broadcast(Channel& ch, const at::Tensor& tensor, int64_t root, Timeout timeout) {
  Rounds rounds(ch, header_of(Collective::kBroadcast, tensor, -1, static_cast<int32_t>(root)), timeout);
  if (root < 0 || root >= ch.world()) {
    rounds.fail_with("tpu_dist broadcast: root rank " + std::to_string(root) + " outside the group of " +
                     std::to_string(ch.world()));
  }
  const int64_t total = static_cast<int64_t>(tensor.nbytes());
  int64_t offset = 0;
  do {
    const int64_t n = std::min(ch.slot_bytes(), total - offset);
    const int set = rounds.begin();
    if (ch.rank() == root) copy_bytes(ch.slot(set, ch.rank()), bytes_of(tensor) + offset, n);
    rounds.exchange();
    if (ch.rank() != root) copy_bytes(bytes_of(tensor) + offset, ch.slot(set, static_cast<int>(root)), n);
    offset += n;
  } while (offset < total);
}

namespace {

// all_gather's output, and reduce_scatter's input, hold world blocks of the other tensor.
void check_blocks(Rounds& rounds, const char* what, const at::Tensor& input, const at::Tensor& output,
                  bool output_is_whole, int world) {
  const at::Tensor& whole = output_is_whole ? output : input;
  const at::Tensor& block = output_is_whole ? input : output;
  if (whole.numel() != block.numel() * world || whole.scalar_type() != block.scalar_type()) {
    rounds.fail_with(c10::str("tpu_dist ", what, ": the ", output_is_whole ? "output" : "input",
                              " must hold world size (", world, ") times the ", output_is_whole ? "input" : "output",
                              "'s elements of the same dtype; got input ", input.scalar_type(), input.sizes(),
                              " and output ", output.scalar_type(), output.sizes()));
  }
}

} // namespace

void all_gather_into(Channel& ch, const at::Tensor& output, const at::Tensor& input, Timeout timeout) {
  Rounds rounds(ch, header_of(Collective::kAllGather, input, -1, -1), timeout);
  check_blocks(rounds, "all_gather_into_tensor", input, output, /*output_is_whole=*/true, ch.world());
  const int64_t total = static_cast<int64_t>(input.nbytes());
  int64_t offset = 0;
  do {
    const int64_t n = std::min(ch.slot_bytes(), total - offset);
    const int set = rounds.begin();
    copy_bytes(ch.slot(set, ch.rank()), bytes_of(input) + offset, n);
    rounds.exchange();
    // The input may be this rank's block of the output (FSDP2 gathers in place).
    for (int r = 0; r < ch.world(); ++r) {
      copy_bytes(bytes_of(output) + r * total + offset,
                 r == ch.rank() ? bytes_of(input) + offset : ch.slot(set, r), n);
    }
    offset += n;
  } while (offset < total);
}

void reduce_scatter_into(Channel& ch, const at::Tensor& output, const at::Tensor& input, ReduceOp::RedOpType op,
                         Timeout timeout) {
  Rounds rounds(ch, header_of(Collective::kReduceScatter, input, op, -1), timeout);
  check_blocks(rounds, "reduce_scatter_tensor", input, output, /*output_is_whole=*/false, ch.world());
  const int64_t total = static_cast<int64_t>(output.nbytes());
  const int64_t share = share_of_slot(ch) / output.element_size() * output.element_size();
  int64_t offset = 0;
  do {
    const int64_t n = std::min(share, total - offset);
    const int set = rounds.begin();
    for (int d = 0; d < ch.world(); ++d) {
      copy_bytes(ch.slot(set, ch.rank()) + d * share, bytes_of(input) + d * total + offset, n);
    }
    rounds.exchange();
    reduce_slots(ch, set, ch.rank() * share, n, bytes_of(output) + offset, output.scalar_type(), op);
    offset += n;
  } while (offset < total);
}

namespace {

// Bytes per dim-0 row, and the split of a tensor's rows among the ranks.
std::vector<int64_t> split_bytes(const at::Tensor& t, c10::IntArrayRef splits, int world, const char* which) {
  const int64_t rows = t.dim() == 0 ? 1 : t.size(0);
  const int64_t row_bytes = rows == 0 ? 0 : static_cast<int64_t>(t.nbytes()) / rows;
  std::vector<int64_t> bytes(world);
  if (splits.empty()) {
    TORCH_CHECK(rows % world == 0, "tpu_dist all_to_all_single: with no ", which, " split sizes the ", which,
                "'s ", rows, " rows must divide evenly among ", world, " ranks");
    std::fill(bytes.begin(), bytes.end(), rows / world * row_bytes);
    return bytes;
  }
  TORCH_CHECK(static_cast<int64_t>(splits.size()) == world, "tpu_dist all_to_all_single: ", which,
              " split sizes need one entry per rank (", world, "), got ", splits);
  int64_t sum = 0;
  for (int r = 0; r < world; ++r) {
    TORCH_CHECK(splits[r] >= 0, "tpu_dist all_to_all_single: negative ", which, " split size in ", splits);
    bytes[r] = splits[r] * row_bytes;
    sum += splits[r];
  }
  TORCH_CHECK(sum == rows, "tpu_dist all_to_all_single: ", which, " split sizes ", splits, " add up to ", sum,
              " rows, but the ", which, " has ", rows);
  return bytes;
}

std::vector<int64_t> starts(const std::vector<int64_t>& sizes) {
  std::vector<int64_t> out(sizes.size(), 0);
  for (size_t i = 1; i < sizes.size(); ++i) out[i] = out[i - 1] + sizes[i - 1];
  return out;
}

} // namespace

namespace {

// Where the block a rank exchanges with each peer lies in one of its tensors:
// either the tensor's bytes split in order (all_to_all_single's row splits), or
// column runs of a 2-D tensor, all its rows, side by side forming the block
// (row-major: each row of the block is the row's runs, in order).
class Blocks {
 public:
  Blocks(const at::Tensor& t, std::vector<int64_t> bytes) : base_(bytes_of(t)), bytes_(std::move(bytes)) {
    starts_ = starts(bytes_);
  }

  Blocks(const at::Tensor& t, const std::vector<std::vector<ColumnRun>>& columns, int world, const char* which)
      : base_(bytes_of(t)) {
    TORCH_CHECK(t.dim() == 2, "tpu_dist all_to_all_columns: the ", which, " must be 2-D to take column runs, got ",
                t.sizes());
    TORCH_CHECK(static_cast<int>(columns.size()) == world, "tpu_dist all_to_all_columns: ", which,
                " column runs need one list per rank (", world, "), got ", columns.size());
    const int64_t element = t.element_size();
    const int64_t rows = t.size(0);
    row_stride_ = t.size(1) * element;
    for (const auto& runs : columns) {
      std::vector<ColumnRun> in_bytes;
      int64_t width = 0;
      for (const ColumnRun& run : runs) {
        TORCH_CHECK(run.column >= 0 && run.width >= 0 && run.column + run.width <= t.size(1),
                    "tpu_dist all_to_all_columns: ", which, " column run [", run.column, ", ",
                    run.column + run.width, ") lies outside its ", t.size(1), " columns");
        if (run.width > 0) in_bytes.push_back({run.column * element, run.width * element});
        width += run.width * element;
      }
      runs_.push_back(std::move(in_bytes));
      row_bytes_.push_back(width);
      bytes_.push_back(width * rows);
    }
  }

  const std::vector<int64_t>& bytes() const { return bytes_; }
  bool contiguous() const { return runs_.empty(); }
  char* begin(int peer) const { return base_ + starts_[peer]; }  // contiguous blocks only

  // to[0, n) = bytes [at, at + n) of the peer's block.
  void read(int peer, int64_t at, int64_t n, char* to) const {
    walk(peer, at, n, [to](char* here, int64_t len, int64_t done) { std::memcpy(to + done, here, len); });
  }

  // Bytes [at, at + n) of the peer's block = from[0, n).
  void write(int peer, int64_t at, int64_t n, const char* from) const {
    walk(peer, at, n, [from](char* here, int64_t len, int64_t done) { std::memcpy(here, from + done, len); });
  }

 private:
  template <typename Copy>
  void walk(int peer, int64_t at, int64_t n, const Copy& copy) const {
    if (n <= 0) return;
    if (runs_.empty()) {
      copy(base_ + starts_[peer] + at, n, 0);
      return;
    }
    const auto& runs = runs_[peer];
    const int64_t row_bytes = row_bytes_[peer];
    int64_t row = at / row_bytes;
    int64_t pos = at % row_bytes;  // within the block's row
    size_t i = 0;
    int64_t run_start = 0;  // the block byte where run i starts
    for (int64_t done = 0; done < n;) {
      while (pos >= run_start + runs[i].width) run_start += runs[i++].width;
      const int64_t len = std::min(run_start + runs[i].width - pos, n - done);
      copy(base_ + row * row_stride_ + runs[i].column + (pos - run_start), len, done);
      done += len;
      pos += len;
      if (pos == row_bytes) {
        ++row;
        pos = 0;
        i = 0;
        run_start = 0;
      }
    }
  }

  char* base_;
  std::vector<int64_t> bytes_;
  std::vector<int64_t> starts_;
  std::vector<std::vector<ColumnRun>> runs_;  // in bytes
  std::vector<int64_t> row_bytes_;
  int64_t row_stride_ = 0;
};

std::unique_ptr<Blocks> blocks_of(const at::Tensor& t, c10::IntArrayRef splits,
                                  const std::vector<std::vector<ColumnRun>>& columns, int world, const char* which) {
  if (columns.empty()) return std::make_unique<Blocks>(t, split_bytes(t, splits, world, which));
  TORCH_CHECK(splits.empty(), "tpu_dist all_to_all_columns: the ", which,
              " takes column runs or split sizes, not both");
  return std::make_unique<Blocks>(t, columns, world, which);
}

} // namespace

void all_to_all(Channel& ch, const at::Tensor& output, const at::Tensor& input, c10::IntArrayRef output_splits,
                c10::IntArrayRef input_splits, Timeout timeout) {
  all_to_all_columns(ch, output, input, output_splits, input_splits, {}, {}, timeout);
}

void all_to_all_columns(Channel& ch, const at::Tensor& output, const at::Tensor& input,
                        c10::IntArrayRef output_splits, c10::IntArrayRef input_splits,
                        const std::vector<std::vector<ColumnRun>>& output_columns,
                        const std::vector<std::vector<ColumnRun>>& input_columns, Timeout timeout) {
  const int world = ch.world();
  const int me = ch.rank();
  std::unique_ptr<Blocks> in;
  std::unique_ptr<Blocks> out;
  const std::string wrong = failure_of([&] {
    TORCH_CHECK(output.scalar_type() == input.scalar_type(), "tpu_dist all_to_all_single: input ",
                input.scalar_type(), " and output ", output.scalar_type(), " must have the same dtype");
    const char* in_begin = bytes_of(input);
    const char* out_begin = bytes_of(output);
    TORCH_CHECK(out_begin + output.nbytes() <= in_begin || in_begin + input.nbytes() <= out_begin,
                "tpu_dist all_to_all_single: the output must not overlap the input (later rounds still send it)");
    TORCH_CHECK(output_columns.empty() || input_columns.empty(),
                "tpu_dist all_to_all_columns: column runs on the input or on the output, not both");
    in = blocks_of(input, input_splits, input_columns, world, "input");
    out = blocks_of(output, output_splits, output_columns, world, "output");
  });
  const std::vector<int64_t> none(world, 0);
  Rounds rounds(ch, header_of(Collective::kAllToAll, input, -1, -1), timeout, in ? in->bytes() : none,
                out ? out->bytes() : none);
  if (!wrong.empty()) rounds.fail_with(wrong);
  const std::vector<int64_t>& send = in->bytes();
  const std::vector<int64_t>& recv = out->bytes();
  const int64_t share = share_of_slot(ch);
  int64_t num_rounds = 1;  // known after the first exchange
  for (int64_t k = 0; k < num_rounds; ++k) {
    const int set = rounds.begin();
    for (int d = 0; d < world; ++d) {
      if (d != me) in->read(d, k * share, piece(send[d], k, share), ch.slot(set, me) + d * share);
    }
    rounds.exchange();
    if (k == 0) {
      for (int s = 0; s < world; ++s) {
        for (int d = 0; d < world; ++d) {
          if (s != d) num_rounds = std::max(num_rounds, (rounds.sent()[s][d] + share - 1) / share);
        }
      }
      // This rank's own block: at most one side has column runs.
      if (in->contiguous()) {
        out->write(me, 0, send[me], in->begin(me));
      } else {
        in->read(me, 0, send[me], out->begin(me));
      }
    }
    for (int s = 0; s < world; ++s) {
      if (s != me) out->write(s, k * share, piece(recv[s], k, share), ch.slot(set, s) + me * share);
    }
  }
}

} // namespace shm
} // namespace torch_tpu
