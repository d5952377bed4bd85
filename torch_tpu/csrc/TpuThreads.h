#pragma once

// Which host threads start OpenMP parallel regions.
//
// The tpu kernels are host kernels, parallel through libgomp. A parallel region
// started from a second thread gives libgomp a second thread pool, and once it
// manages more threads than there are CPUs it stops spinning between regions
// for the rest of the process: every small parallel op, on any device, then
// waits for its workers to wake (a 256x256 CPU add 4-8x slower, a matmul 57%).
// So the threads the backend starts run their ATen ops on one thread, and the
// backward of tpu tensors runs on the thread that made them, not on autograd's
// device thread.

namespace torch_tpu {

// Once per thread: backward passes this thread starts run on it, as CPU ones
// do (autograd's multithreading off for the thread). Called where a thread
// makes tpu memory; a later torch.autograd.set_multithreading_enabled(True)
// on the thread is kept.
void run_backward_on_this_thread();

// For the backend's worker threads (streams, torch_tpu/threads.py): ATen ops
// on this thread use one thread, so they never start an OpenMP team. Work that
// needs more brings threads of its own.
void keep_this_thread_off_openmp();

// While alive, ATen's CPU kernels on this thread run on it alone: for work
// that every process of a host does at the same moment (a collective's
// reduction), where an OpenMP team in each would put more threads than cores
// on the machine and leave the teams spinning against each other.
class OneThreadScope {
 public:
  OneThreadScope();
  ~OneThreadScope();
  OneThreadScope(const OneThreadScope&) = delete;
  OneThreadScope& operator=(const OneThreadScope&) = delete;

 private:
  int saved_;
};

} // namespace torch_tpu
