// DDP's per-iteration timings (forward, backward compute, communication) for
// modules on tpu. Without a timer registered for the device, DDP warns that
// it collects none. Ops on the default tpu stream run synchronously on the
// calling thread, so the host clock at each event is the device's time.

#include <torch/csrc/distributed/c10d/reducer_timer.hpp>

namespace torch_tpu {
namespace {

class TpuTimer : public c10d::Timer {
 public:
  explicit TpuTimer(c10::Device /*device*/) {}

  std::optional<int64_t> measureDifference(Event start, Event end) override {
    const int64_t start_time = getTimeRef(start), end_time = getTimeRef(end);
    // Unset events, or an end from an earlier iteration than the start.
    if (start_time == c10d::kUnsetTime || end_time == c10d::kUnsetTime || end_time < start_time) {
      return std::nullopt;
    }
    return end_time - start_time;
  }
};

} // namespace
} // namespace torch_tpu

namespace c10d {
C10_REGISTER_TYPED_CLASS(TimerRegistry, c10::kPrivateUse1, torch_tpu::TpuTimer);
} // namespace c10d
