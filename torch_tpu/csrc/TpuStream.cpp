#include "TpuStream.h"

#include "TpuAutocast.h"
#include "TpuDevice.h"
#include "TpuThreads.h"

#include <Python.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace torch_tpu {
namespace {

// Waiting threads may hold the GIL while the task they wait for is a Python
// callback that needs it; release it for the wait.
class ReleaseGilIfHeld {
 public:
  ReleaseGilIfHeld() {
    if (Py_IsInitialized() && PyGILState_Check()) {
      state_ = PyEval_SaveThread();
    }
  }
  ~ReleaseGilIfHeld() {
    if (state_) {
      PyEval_RestoreThread(state_);
    }
  }

 private:
  PyThreadState* state_ = nullptr;
};

class Queue {
 public:
  void submit(std::function<void()> task) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!worker_started_) {
        // Detached: a worker blocked on an empty queue must not hold up exit.
        std::thread([this] { run(); }).detach();
        worker_started_ = true;
      }
      tasks_.push_back(std::move(task));
      ++submitted_;
    }
    cv_.notify_all();
  }

  bool idle() {
    std::lock_guard<std::mutex> lock(mu_);
    return completed_ == submitted_;
  }

  bool has_pending() const { return pending_.load(std::memory_order_acquire) > 0; }

  void synchronize() {
    std::unique_lock<std::mutex> lock(mu_);
    if (completed_ == submitted_) {
      return;
    }
    const uint64_t target = submitted_;
    lock.unlock();
    ReleaseGilIfHeld release;
    lock.lock();
    cv_.wait(lock, [&] { return completed_ >= target; });
  }

 private:
  void run() {
    keep_this_thread_off_openmp();
    use_bf16_autocast_on_this_thread();
    for (;;) {
      std::function<void()> task;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return !tasks_.empty(); });
        task = std::move(tasks_.front());
        tasks_.pop_front();
      }
      pending_.fetch_add(1, std::memory_order_release);
      task();  // tasks never throw: submitters catch their own errors
      pending_.fetch_sub(1, std::memory_order_release);
      {
        std::lock_guard<std::mutex> lock(mu_);
        ++completed_;
      }
      cv_.notify_all();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
  uint64_t submitted_ = 0;
  uint64_t completed_ = 0;
  std::atomic<int> pending_{0};
  bool worker_started_ = false;
};

constexpr int kMaxDevices = 64;

class StreamTable {
 public:
  c10::StreamId create(c10::DeviceIndex device) {
    std::lock_guard<std::mutex> lock(mu_);
    auto& queues = queues_[device];
    queues.push_back(std::make_unique<Queue>());
    return static_cast<c10::StreamId>(queues.size());  // ids start at 1
  }
  // nullptr for the default stream.
  Queue* get(c10::Stream s) {
    if (s.id() == kDefaultStreamId) {
      return nullptr;
    }
    std::lock_guard<std::mutex> lock(mu_);
    auto& queues = queues_[s.device_index()];
    TORCH_CHECK(
        s.id() > 0 && s.id() <= static_cast<c10::StreamId>(queues.size()),
        "Unknown tpu stream id ", s.id(), " on tpu:", static_cast<int>(s.device_index()));
    return queues[s.id() - 1].get();
  }
  std::vector<Queue*> all(c10::DeviceIndex device) {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<Queue*> out;
    for (auto& q : queues_[device]) {
      out.push_back(q.get());
    }
    return out;
  }

 private:
  std::mutex mu_;
  std::vector<std::unique_ptr<Queue>> queues_[kMaxDevices];
};

StreamTable& table() {
  static StreamTable* t = new StreamTable();
  return *t;
}

thread_local c10::StreamId t_current[kMaxDevices] = {};

c10::Stream make_stream(c10::DeviceIndex device, c10::StreamId id) {
  return c10::Stream(
      c10::Stream::UNSAFE, c10::Device(c10::DeviceType::PrivateUse1, device), id);
}

struct Event {
  std::mutex mu;
  std::condition_variable cv;
  uint64_t recorded = 0;   // version of the latest record()
  uint64_t completed = 0;  // highest version whose preceding work finished
  std::chrono::steady_clock::time_point when;

  void complete(uint64_t version) {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (version > completed) {
        completed = version;
        when = std::chrono::steady_clock::now();
      }
    }
    cv.notify_all();
  }
  uint64_t latest() {
    std::lock_guard<std::mutex> lock(mu);
    return recorded;
  }
  void wait(uint64_t version) {
    std::unique_lock<std::mutex> lock(mu);
    if (completed >= version) {
      return;
    }
    lock.unlock();
    ReleaseGilIfHeld release;
    lock.lock();
    cv.wait(lock, [&] { return completed >= version; });
  }
};

} // namespace

c10::Stream default_stream(c10::DeviceIndex device) {
  device = resolve(device);
  check_device_index(device);
  return make_stream(device, kDefaultStreamId);
}

c10::Stream new_stream(c10::DeviceIndex device) {
  device = resolve(device);
  check_device_index(device);
  return make_stream(device, table().create(device));
}

c10::Stream current_stream(c10::DeviceIndex device) {
  device = resolve(device);
  check_device_index(device);
  return make_stream(device, t_current[device]);
}

c10::Stream exchange_stream(c10::Stream s) {
  const auto previous = current_stream(s.device_index());
  t_current[s.device_index()] = s.id();
  return previous;
}

void submit(c10::Stream s, std::function<void()> task) {
  if (Queue* q = table().get(s)) {
    q->submit(std::move(task));
  } else {
    task();
  }
}

bool query_stream(c10::Stream s) {
  Queue* q = table().get(s);
  return q == nullptr || q->idle();
}

void synchronize_stream(c10::Stream s) {
  if (Queue* q = table().get(s)) {
    q->synchronize();
  }
}

void synchronize_device(c10::DeviceIndex device) {
  device = resolve(device);
  check_device_index(device);
  for (Queue* q : table().all(device)) {
    q->synchronize();
  }
}

void wait_current_stream(c10::DeviceIndex device) {
  const c10::StreamId id = t_current[device];
  if (id == kDefaultStreamId) {
    return;
  }
  Queue* q = table().get(make_stream(device, id));
  if (!q->idle()) {
    q->synchronize();
  }
}

// An event handle (what the guard hands torch) shares its Event with every
// task queued to record or wait on it: the handle may be destroyed while a
// stream still has such a task pending (stream.wait_stream() records a
// temporary event, queues a wait on it and drops it at once).
using EventRef = std::shared_ptr<Event>;

EventRef& event_of(void* handle) {
  return *static_cast<EventRef*>(handle);
}

void* record_event(void* handle, c10::Stream s) {
  if (!handle) {
    handle = new EventRef(std::make_shared<Event>());
  }
  EventRef event = event_of(handle);
  uint64_t version;
  {
    std::lock_guard<std::mutex> lock(event->mu);
    version = ++event->recorded;
  }
  submit(s, [event, version] { event->complete(version); });
  return handle;
}

void block_on_event(void* handle, c10::Stream s) {
  if (!handle || query_event(handle)) {
    return;
  }
  EventRef event = event_of(handle);
  const uint64_t version = event->latest();
  submit(s, [event, version] { event->wait(version); });
}

bool query_event(void* handle) {
  if (!handle) {
    return true;
  }
  Event& event = *event_of(handle);
  std::lock_guard<std::mutex> lock(event.mu);
  return event.completed >= event.recorded;
}

void synchronize_event(void* handle) {
  if (!handle) {
    return;
  }
  Event& event = *event_of(handle);
  event.wait(event.latest());
}

double elapsed_ms(void* start, void* end) {
  TORCH_CHECK(start && end, "Both events must be recorded before calculating elapsed time.");
  synchronize_event(start);
  synchronize_event(end);
  auto when = [](void* handle) {
    Event& event = *event_of(handle);
    std::lock_guard<std::mutex> lock(event.mu);
    return event.when;
  };
  return std::chrono::duration<double, std::milli>(when(end) - when(start)).count();
}

void destroy_event(void* handle) {
  delete static_cast<EventRef*>(handle);  // queued tasks hold their own reference
}

} // namespace torch_tpu

// C entry point for Python (ctypes): runs fn(arg) in order on the stream.
extern "C" int torch_tpu_stream_submit(
    int device, int64_t stream_id, void (*fn)(void*), void* arg) {
  try {
    torch_tpu::check_device_index(static_cast<c10::DeviceIndex>(device));
    auto s = c10::Stream(
        c10::Stream::UNSAFE,
        c10::Device(c10::DeviceType::PrivateUse1, static_cast<c10::DeviceIndex>(device)),
        stream_id);
    torch_tpu::submit(s, [fn, arg] { fn(arg); });
    return 0;
  } catch (const std::exception&) {
    return 1;
  }
}
