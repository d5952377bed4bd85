"""Loads sparsecore's compiled kernels (``torch.ops.sparsecore.*``) once."""

from pathlib import Path

import torch

_LIBRARY = Path(__file__).with_name("_kernels.so")

if not _LIBRARY.exists():
    raise ImportError(f"sparsecore's compiled kernels {_LIBRARY} are missing; run `make setup`")
torch.ops.load_library(str(_LIBRARY))
