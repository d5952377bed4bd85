#include "TpuShmChannel.h"

#include <c10/util/Exception.h>

#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>
#include <thread>
#include <unordered_map>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace torch_tpu {
namespace shm {
namespace {

constexpr uint64_t kMagic = 0x7470755f73686d31ULL;  // "tpu_shm1"
constexpr int64_t kLine = 64;
constexpr int64_t kPage = 4096;
// Peers a round behind usually arrive within microseconds; spinning that long
// is cheaper than a futex sleep and wake-up.
constexpr auto kSpin = std::chrono::microseconds(30);
// How often a sleeping waiter looks at the clock and at the peers' processes.
constexpr auto kNap = std::chrono::milliseconds(20);

constexpr int64_t round_up(int64_t n, int64_t to) {
  return (n + to - 1) / to * to;
}

// Collectives that split a slot among the peers give each a share of whole lines.
bool share_fits(int64_t slot_bytes, int world) {
  return slot_bytes / world >= kLine;
}

void cpu_relax() {
#if defined(__x86_64__)
  _mm_pause();
#endif
}

int futex(std::atomic<uint32_t>* word, int op, uint32_t value, const timespec* timeout) {
  // Not FUTEX_PRIVATE_FLAG: the word is shared between processes.
  return static_cast<int>(syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, value, timeout, nullptr, 0));
}

// A process that exited is gone, or a zombie until its parent reaps it.
bool process_gone(int32_t pid) {
  if (pid <= 0) return false;
  if (kill(pid, 0) != 0) return errno == ESRCH;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(stat, line)) return false;
  const auto paren = line.rfind(')');
  return paren != std::string::npos && paren + 2 < line.size() && line[paren + 2] == 'Z';
}

std::string join(const std::vector<int>& ranks) {
  std::ostringstream out;
  for (size_t i = 0; i < ranks.size(); ++i) out << (i ? ", " : "") << ranks[i];
  return out.str();
}

} // namespace

// The first cache lines of the segment; per-rank counters follow, a line each.
struct Channel::Control {
  uint64_t magic;
  int64_t world;
  int64_t slot_bytes;
  alignas(kLine) std::atomic<uint32_t> bell;  // bumped by every arrival; the futex word
  std::atomic<uint32_t> sleepers;
};
// Where the per-rank barrier counters start.
constexpr int64_t kCountersOffset = round_up(static_cast<int64_t>(sizeof(Channel::Control)), kLine);
static_assert(sizeof(std::atomic<uint64_t>) == 8 && std::atomic<uint64_t>::is_always_lock_free,
              "the barrier counters must be lock-free to work across processes");

Channel::Channel(const std::string& path, int rank, int world, int64_t slot_bytes, bool create,
                 std::chrono::milliseconds timeout)
    : rank_(rank), world_(world), slot_bytes_(round_up(slot_bytes, kPage)), timeout_(timeout) {
  TORCH_CHECK(world >= 1 && rank >= 0 && rank < world, "tpu_dist: rank ", rank, " outside a group of ", world);
  pids_offset_ = kCountersOffset + kLine * world;
  header_stride_ = round_up(static_cast<int64_t>(sizeof(Header)) + 2 * 8 * world, kLine);
  headers_offset_ = round_up(pids_offset_ + 4 * world, kLine);
  slots_offset_ = round_up(headers_offset_ + 2 * world * header_stride_, kPage);
  size_ = slots_offset_ + 2 * world * slot_bytes_;

  TORCH_CHECK(share_fits(slot_bytes_, world), "tpu_dist: a slot of ", slot_bytes_, " bytes is too small for ",
              world, " ranks (", kLine, " bytes a peer at least)");
  const int fd = create ? open(path.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600) : open(path.c_str(), O_RDWR);
  TORCH_CHECK(fd >= 0, "tpu_dist: cannot ", create ? "create" : "open", " the shared-memory segment ", path, ": ",
              std::strerror(errno));
  // Allocated now, not on first touch: a full /dev/shm then fails here (and
  // the group keeps to gloo) instead of killing a rank with SIGBUS mid-copy.
  const int err = create ? posix_fallocate(fd, 0, size_) : 0;
  struct stat st{};
  const bool sized = err == 0 && fstat(fd, &st) == 0 && st.st_size >= size_;
  void* p = sized ? mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) : MAP_FAILED;
  const int map_err = errno;
  close(fd);
  if (p == MAP_FAILED && create) unlink(path.c_str());
  TORCH_CHECK(err == 0, "tpu_dist: cannot allocate ", size_, " bytes for the shared-memory segment ", path, ": ",
              std::strerror(err));
  TORCH_CHECK(sized, "tpu_dist: the shared-memory segment ", path, " has ", st.st_size, " bytes, ", size_,
              " needed (made for another group?)");
  TORCH_CHECK(p != MAP_FAILED, "tpu_dist: cannot map the shared-memory segment ", path, ": ", std::strerror(map_err));
  base_ = static_cast<char*>(p);
  if (create) {
    control()->magic = kMagic;
    control()->world = world;
    control()->slot_bytes = slot_bytes_;
  }
  if (control()->magic != kMagic || control()->world != world || control()->slot_bytes != slot_bytes_) {
    munmap(base_, size_);
    base_ = nullptr;
    TORCH_CHECK(false, "tpu_dist: the shared-memory segment ", path, " was made for another group");
  }
  pids()[rank] = static_cast<int32_t>(getpid());
}

Channel::~Channel() {
  if (base_ != nullptr) munmap(base_, size_);
}

Channel::Control* Channel::control() const {
  return reinterpret_cast<Control*>(base_);
}

std::atomic<uint64_t>& Channel::arrived(int rank) const {
  return *reinterpret_cast<std::atomic<uint64_t>*>(base_ + kCountersOffset + kLine * rank);
}

Header& Channel::header(int set, int rank) {
  return *reinterpret_cast<Header*>(base_ + headers_offset_ + (set * world_ + rank) * header_stride_);
}

int64_t* Channel::send_bytes(int set, int rank) {
  return reinterpret_cast<int64_t*>(&header(set, rank) + 1);
}

int64_t* Channel::recv_bytes(int set, int rank) {
  return send_bytes(set, rank) + world_;
}

char* Channel::slot(int set, int rank) {
  return base_ + slots_offset_ + (set * world_ + rank) * slot_bytes_;
}

int32_t* Channel::pids() const {
  return reinterpret_cast<int32_t*>(base_ + pids_offset_);
}

bool Channel::all_arrived(uint64_t epoch) const {
  for (int r = 0; r < world_; ++r) {
    if (arrived(r).load(std::memory_order_acquire) < epoch) return false;
  }
  return true;
}

std::vector<int> Channel::missing(uint64_t epoch) const {
  std::vector<int> out;
  for (int r = 0; r < world_; ++r) {
    if (arrived(r).load(std::memory_order_acquire) < epoch) out.push_back(r);
  }
  return out;
}

void Channel::barrier(const char* what, std::chrono::milliseconds timeout) {
  if (timeout.count() < 0) timeout = timeout_;
  const uint64_t epoch = ++epoch_;
  Control* c = control();
  arrived(rank_).store(epoch, std::memory_order_seq_cst);
  c->bell.fetch_add(1, std::memory_order_seq_cst);
  if (c->sleepers.load(std::memory_order_seq_cst) > 0) futex(&c->bell, FUTEX_WAKE, INT32_MAX, nullptr);

  using Clock = std::chrono::steady_clock;
  const auto spin_until = Clock::now() + kSpin;
  while (Clock::now() < spin_until) {
    for (int i = 0; i < 64; ++i) {
      if (all_arrived(epoch)) return;
      cpu_relax();
    }
  }
  const auto deadline = Clock::now() + timeout;
  const timespec nap{0, std::chrono::duration_cast<std::chrono::nanoseconds>(kNap).count()};
  while (true) {
    // An arrival bumps the bell after its counter, and wakes sleepers it sees:
    // read the bell, then check the counters, then sleep only if it is unchanged.
    const uint32_t bell = c->bell.load(std::memory_order_seq_cst);
    c->sleepers.fetch_add(1, std::memory_order_seq_cst);
    if (all_arrived(epoch)) {
      c->sleepers.fetch_sub(1, std::memory_order_seq_cst);
      return;
    }
    futex(&c->bell, FUTEX_WAIT, bell, &nap);
    c->sleepers.fetch_sub(1, std::memory_order_seq_cst);
    const auto late = missing(epoch);
    if (late.empty()) return;
    for (int r : late) {
      if (process_gone(pids()[r])) fail_wait(what, epoch, std::nullopt);
    }
    if (Clock::now() >= deadline) fail_wait(what, epoch, timeout);
  }
}

void Channel::fail_wait(const char* what, uint64_t epoch, std::optional<std::chrono::milliseconds> timed_out) {
  const auto late = missing(epoch);
  std::ostringstream why;
  why << "tpu_dist " << what << " on rank " << rank_ << ": ";
  if (timed_out) {
    why << "timed out after " << timed_out->count() << " ms waiting for rank(s) " << join(late)
        << " (they never entered this collective: stopped, stuck, or calling a different one)";
  } else {
    std::vector<int> gone;
    for (int r : late) {
      if (process_gone(pids()[r])) gone.push_back(r);
    }
    why << "rank(s) " << join(gone) << " exited (their process is gone), so the collective cannot complete";
  }
  break_with(why.str());
  TORCH_CHECK(false, why.str());
}

void Channel::break_with(const std::string& reason) {
  if (broken_.empty()) broken_ = reason;
}

void Channel::check_usable() const {
  TORCH_CHECK(broken_.empty(), "tpu_dist: this process group failed earlier and its ranks are out of step; "
              "destroy it and start again. The first error was: ", broken_);
}

namespace {
std::mutex registry_mutex;
std::unordered_map<std::string, std::shared_ptr<Channel>>& registry() {
  static auto* channels = new std::unordered_map<std::string, std::shared_ptr<Channel>>();
  return *channels;
}
} // namespace

void attach(const std::string& group, std::shared_ptr<Channel> channel) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  if (channel) {
    registry()[group] = std::move(channel);
  } else {
    registry().erase(group);
  }
}

std::shared_ptr<Channel> find(const std::string& group) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  auto it = registry().find(group);
  return it == registry().end() ? nullptr : it->second;
}

} // namespace shm
} // namespace torch_tpu
