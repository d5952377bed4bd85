"""Loads sparsecore's compiled kernels (``torch.ops.sparsecore.*``) once."""

import ctypes
from pathlib import Path

import torch

_LIBRARY = Path(__file__).with_name("_kernels.so")

if not _LIBRARY.exists():
    raise ImportError(f"sparsecore's compiled kernels {_LIBRARY} are missing; run `make setup`")
torch.ops.load_library(str(_LIBRARY))

# The library torch loaded (dlopen of the same path returns it), for its C entry points.
_set_kernel_threads = ctypes.CDLL(str(_LIBRARY)).sparsecore_set_kernel_threads
_set_kernel_threads.argtypes = [ctypes.c_int64]
_set_kernel_threads.restype = None


def set_kernel_threads(n: int) -> None:
    """Threads the kernels called from this thread use (the engine's own pool, not OpenMP);
    ``n <= 0``: ``torch.get_num_threads()`` again."""
    _set_kernel_threads(n)
