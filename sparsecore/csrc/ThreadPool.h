#pragma once

// The engine's own worker threads, for the kernels' parallel loops.
//
// Not OpenMP: the kernels mostly run on the SparseCore executor's thread, and
// a parallel region started from a second thread gives libgomp a second
// thread pool. Managing more threads than CPUs, libgomp then stops spinning
// between regions for the rest of the process, so every small parallel ATen op
// of the main thread waits for its workers to wake (a 256x256 add 4x slower).
// libgomp does not know of these threads.
//
// On the process's main thread the loops run on its OpenMP team instead:
// those workers spin for a while after each ATen op, and threads of our own
// would contend with them for the CPUs (on 2 cores, preprocessing 4.3M ids
// took 32 ms on our threads, 25 ms on the team). Not in a forked child, where
// that team is gone.

#include <cstdint>
#include <functional>

namespace sparsecore {

// at::parallel_for's contract: f(chunk_begin, chunk_end) over disjoint
// contiguous chunks covering [begin, end), each at least grain_size long
// (except the last), on up to kernel_threads() threads, the caller one of them.
// Runs inline when nested or when one chunk suffices. Rethrows f's first
// exception in the caller.
void parallel_for(int64_t begin, int64_t end, int64_t grain_size,
                  const std::function<void(int64_t, int64_t)>& f);

// Threads a parallel_for of this thread uses: set by set_kernel_threads (the
// executor passes on its submitter's count), else at::get_num_threads().
int64_t kernel_threads();

}  // namespace sparsecore

// For sparsecore/_library.py (ctypes): this thread's kernel thread count;
// n <= 0 returns to at::get_num_threads().
extern "C" void sparsecore_set_kernel_threads(int64_t n);
