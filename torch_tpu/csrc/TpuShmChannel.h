#pragma once
// The shared-memory segment that ranks of one tpu_dist group on one host
// exchange data through: the stand-in for the ICI links between the chips of
// a TPU host, where gloo's TCP pairs are the stand-in for the network between
// hosts.
//
// One segment per group, mapped by every rank. It holds each rank's process
// id and barrier counter, and two buffer sets (even and odd rounds), each
// with a header and a data slot per rank. A collective moves its bytes in
// rounds of at most a slot; every round ends with one barrier, and rounds
// alternate buffer sets. A rank can write set p for round k + 2 only after
// every rank has reached round k + 1's barrier, that is after every rank has
// finished reading round k, so one barrier a round is enough.
//
// Waiting spins briefly, then sleeps on a futex in the segment (cross-process).
// It gives up with an error naming the ranks that did not arrive: at once if
// their process is gone, else at the group's timeout. After an error the
// channel refuses further collectives: the ranks are no longer in step.

#include <c10/core/ScalarType.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace torch_tpu {
namespace shm {

constexpr int kMaxDims = 8;
constexpr int kReasonBytes = 240;

// What a rank says about the collective it is in: every rank checks every
// other rank's header after the first barrier of a collective.
struct Header {
  int32_t op;      // Collective
  int32_t dtype;   // c10::ScalarType
  int32_t reduce;  // c10d::ReduceOp::RedOpType, or -1
  int32_t root;    // broadcast's root, or -1
  int32_t ndim;     // tensors of more dims are described flattened
  int32_t invalid;  // 1: this rank's arguments are wrong (reason below); every rank then raises
  int64_t sizes[kMaxDims];
  char reason[kReasonBytes];
  // Followed by int64 send_bytes[world] and recv_bytes[world] (all_to_all).
};

class Channel {
 public:
  // create: make the segment file at `path` (rank 0); else open it.
  Channel(const std::string& path, int rank, int world, int64_t slot_bytes, bool create,
          std::chrono::milliseconds timeout);
  ~Channel();
  Channel(const Channel&) = delete;
  Channel& operator=(const Channel&) = delete;

  int rank() const { return rank_; }
  int world() const { return world_; }
  int64_t slot_bytes() const { return slot_bytes_; }
  std::chrono::milliseconds timeout() const { return timeout_; }

  // Collectives of one group run one at a time in each process.
  std::mutex& mutex() { return mutex_; }

  // The buffer set of the next round (flips every round, the same on every rank).
  int next_set() { return static_cast<int>(rounds_++ & 1); }
  Header& header(int set, int rank);
  int64_t* send_bytes(int set, int rank);
  int64_t* recv_bytes(int set, int rank);
  char* slot(int set, int rank);

  // Waits until every rank has reached this barrier. `what` names the
  // collective in errors; timeout < 0 means the group's.
  void barrier(const char* what, std::chrono::milliseconds timeout);

  // Refuses further collectives with this reason (raised now by the caller).
  void break_with(const std::string& reason);
  void check_usable() const;

 // The segment's first cache lines (defined in the .cpp).
  struct Control;

 private:
  Control* control() const;
  std::atomic<uint64_t>& arrived(int rank) const;
  int32_t* pids() const;
  bool all_arrived(uint64_t epoch) const;
  std::vector<int> missing(uint64_t epoch) const;
  // timed_out: the wait's timeout; nullopt when a peer's process is gone.
  [[noreturn]] void fail_wait(const char* what, uint64_t epoch, std::optional<std::chrono::milliseconds> timed_out);

  int rank_;
  int world_;
  int64_t slot_bytes_;
  std::chrono::milliseconds timeout_;
  int64_t pids_offset_ = 0;
  int64_t header_stride_ = 0;
  int64_t headers_offset_ = 0;
  int64_t slots_offset_ = 0;
  int64_t size_ = 0;
  char* base_ = nullptr;
  uint64_t epoch_ = 0;
  uint64_t rounds_ = 0;
  std::mutex mutex_;
  std::string broken_;
};

// Channels by process-group name (c10d::ProcessGroup::getGroupName());
// attaching null removes the group's channel (unmapped once no collective holds it).
void attach(const std::string& group, std::shared_ptr<Channel> channel);
std::shared_ptr<Channel> find(const std::string& group);

} // namespace shm
} // namespace torch_tpu
