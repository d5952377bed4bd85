"""TensorCore matmul precision on tpu, separate from the CPU's setting.

The MXU multiplies bf16 operands and accumulates in fp32. For fp32 matmul-
family ops (mm, addmm, bmm, baddbmm, matmul, linear, einsum, conv):

* ``"medium"`` (the TPU default): operands rounded to bf16, fp32 output;
* ``"high"``: three bf16 passes (hi*hi + hi*lo + lo*hi), about 3x the cost;
* ``"highest"``: exact fp32 (a TPU runs six passes; exact is at least as
  accurate).

``torch.set_float32_matmul_precision`` keeps governing CPU and CUDA.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch

from torch_tpu import eager

_MODES = {"highest": 0, "high": 1, "medium": 2}
_NAMES = {v: k for k, v in _MODES.items()}
_COST = {"high": "about 3x", "highest": "about 6x on a TPU"}
_warned: set[str] = set()


def set_float32_matmul_precision(precision: str) -> None:
    if precision not in _MODES:
        raise ValueError(f"tpu matmul precision must be one of {sorted(_MODES)}, got {precision!r}")
    if precision in _COST and precision not in _warned:
        _warned.add(precision)
        warnings.warn(
            f"tpu matmul precision {precision!r} costs {_COST[precision]} the TensorCore time of "
            "'medium' (single-pass bf16)",
            UserWarning,
            stacklevel=2,
        )
    _set(_MODES[precision])


def _set(mode: int) -> None:
    # Ops DeferAndFuse has recorded run at the precision they were issued at.
    eager.materialize_deferred("matmul precision change")
    torch.ops.torch_tpu._set_matmul_precision(mode)


def get_float32_matmul_precision() -> str:
    return _NAMES[torch.ops.torch_tpu._get_matmul_precision()]


@contextlib.contextmanager
def precision(precision: str) -> Iterator[None]:
    """Sets the tpu matmul precision inside a ``with`` block."""
    previous = get_float32_matmul_precision()
    set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        _set(_MODES[previous])
