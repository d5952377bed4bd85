"""Worker threads of the backend and of packages built on it.

Their ATen ops run on one thread: an OpenMP parallel region started from a
second thread gives libgomp a second thread pool, after which, managing more
threads than CPUs, it stops spinning between regions for the rest of the
process, and every small parallel op (on any device) waits for its workers to
wake. ``csrc/TpuThreads.h`` has the measurements. tpu streams' workers are set
up so by the C++ core; Python worker threads use :func:`worker`.
"""

from __future__ import annotations

import concurrent.futures

import torch

from torch_tpu import _backend


def keep_this_thread_off_openmp() -> None:
    """ATen ops on the calling thread use one thread from now on."""
    _backend.library.torch_tpu_keep_this_thread_off_openmp()


def _start_worker() -> None:
    keep_this_thread_off_openmp()
    torch.set_autocast_dtype("tpu", torch.bfloat16)  # as on the thread that loaded the backend


def worker(name: str) -> concurrent.futures.ThreadPoolExecutor:
    """A single worker thread named ``name`` whose ATen ops never start an OpenMP team, and whose
    ``torch.autocast("tpu")`` takes bf16 by default, as every thread of the backend."""
    return concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=name, initializer=_start_worker)
