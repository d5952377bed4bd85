#include "TpuThreads.h"

#include <ATen/Config.h>
#include <ATen/Parallel.h>
#include <c10/core/AutogradState.h>

#include <omp.h>

#if AT_MKL_ENABLED()
// mkl_service.h's mkl_set_num_threads_local is a macro for this (the lowercase
// symbol is the Fortran entry, which takes a pointer).
extern "C" int MKL_Set_Num_Threads_Local(int nthreads);
#endif

namespace torch_tpu {

void run_backward_on_this_thread() {
  thread_local bool done = false;
  if (!done) {
    done = true;
    c10::AutogradState::get_tls_state().set_multithreading_enabled(false);
  }
}

void keep_this_thread_off_openmp() {
  at::get_num_threads();  // ATen's per-thread set-up first: it would undo what follows
  omp_set_num_threads(1);  // this thread's ICV only
#if AT_MKL_ENABLED()
  MKL_Set_Num_Threads_Local(1);
#endif
}

OneThreadScope::OneThreadScope() : saved_(omp_get_max_threads()) {
  omp_set_num_threads(1);
}

OneThreadScope::~OneThreadScope() {
  omp_set_num_threads(saved_);
}

} // namespace torch_tpu

// For torch_tpu/threads.py (ctypes): the backend's Python worker threads.
extern "C" void torch_tpu_keep_this_thread_off_openmp() {
  torch_tpu::keep_this_thread_off_openmp();
}
