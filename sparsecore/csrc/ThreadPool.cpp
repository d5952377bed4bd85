#include "ThreadPool.h"

#include <ATen/Parallel.h>
#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <thread>

namespace sparsecore {
namespace {

thread_local int64_t t_kernel_threads = 0;
thread_local bool t_in_parallel = false;

// Marks this thread as running a chunk, so a parallel_for inside it runs inline.
struct InParallel {
  InParallel() { t_in_parallel = true; }
  ~InParallel() { t_in_parallel = false; }
};

// Workers sleep between jobs: the kernels' loops run for milliseconds, so a
// wake-up's tens of microseconds do not count, and sleeping threads leave the
// CPUs to the main thread's OpenMP team.
class Pool {
 public:
  // task(i) for i in [0, threads), i = 0 on the calling thread. One job at a
  // time: callers from other threads wait for the running one.
  void run(int64_t threads, const std::function<void(int64_t)>& task) {
    std::lock_guard<std::mutex> one_job(job_mutex_);
    while (static_cast<int64_t>(workers_) < threads - 1) {
      std::thread([this, index = ++workers_] { work(index); }).detach();
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      task_ = &task;
      participants_ = threads;
      pending_ = threads - 1;
      ++generation_;
    }
    wake_.notify_all();
    task(0);
    std::unique_lock<std::mutex> lock(mutex_);
    finished_.wait(lock, [this] { return pending_ == 0; });
    task_ = nullptr;
  }

 private:
  void work(int64_t index) {
    uint64_t seen = 0;
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      wake_.wait(lock, [&] { return generation_ != seen; });
      seen = generation_;
      if (index >= participants_) continue;
      const std::function<void(int64_t)>* task = task_;
      lock.unlock();
      (*task)(index);
      lock.lock();
      if (--pending_ == 0) finished_.notify_one();
    }
  }

  std::mutex job_mutex_;
  std::mutex mutex_;  // guards what follows
  std::condition_variable wake_, finished_;
  const std::function<void(int64_t)>* task_ = nullptr;
  uint64_t generation_ = 0;
  int64_t participants_ = 0, pending_ = 0, workers_ = 0;
};

// A forked child: libgomp's team of the parent's main thread did not survive
// the fork either, and waiting on it would hang.
bool g_forked = false;

// Never destroyed: detached workers wait on it until the process ends. A
// forked child has none of the parent's threads, so it starts a new pool.
Pool* g_pool = [] {
  pthread_atfork(nullptr, nullptr, [] {
    g_pool = new Pool();
    g_forked = true;
  });
  return new Pool();
}();

// The process's first thread, whose OpenMP team ATen's own parallel ops use.
bool on_main_thread() {
  static const pid_t main_tid = getpid();
  thread_local const bool is_main = static_cast<pid_t>(syscall(SYS_gettid)) == main_tid;
  return is_main;
}

}  // namespace

int64_t kernel_threads() {
  return t_kernel_threads > 0 ? t_kernel_threads : at::get_num_threads();
}

void parallel_for(int64_t begin, int64_t end, int64_t grain_size,
                  const std::function<void(int64_t, int64_t)>& f) {
  const int64_t n = end - begin;
  if (n <= 0) return;
  const int64_t grain = std::max<int64_t>(grain_size, 1);
  const int64_t threads = t_in_parallel ? 1 : std::min(kernel_threads(), (n + grain - 1) / grain);
  if (threads <= 1) {
    f(begin, end);
    return;
  }
  if (on_main_thread() && t_kernel_threads == 0 && !g_forked) {
    // The main thread's own OpenMP team: after an ATen op its workers spin for
    // a while, and on a machine with as many CPUs as workers a pool of our own
    // would contend with them for every core.
    at::parallel_for(begin, end, grain, [&](int64_t chunk_begin, int64_t chunk_end) {
      InParallel scope;
      f(chunk_begin, chunk_end);
    });
    return;
  }
  const int64_t chunk = (n + threads - 1) / threads;
  std::once_flag first_error;
  std::exception_ptr error;
  g_pool->run(threads, [&](int64_t i) {
    const int64_t chunk_begin = begin + i * chunk;
    if (chunk_begin >= end) return;
    InParallel scope;
    try {
      f(chunk_begin, std::min(end, chunk_begin + chunk));
    } catch (...) {
      std::call_once(first_error, [&] { error = std::current_exception(); });
    }
  });
  if (error) std::rethrow_exception(error);
}

}  // namespace sparsecore

extern "C" void sparsecore_set_kernel_threads(int64_t n) {
  sparsecore::t_kernel_threads = n;
}
