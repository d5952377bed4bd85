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
from torch_tpu.graph_breaks import outside_compiled_graphs

_MODES = {"highest": 0, "high": 1, "medium": 2}
_NAMES = {v: k for k, v in _MODES.items()}
_COST = {"high": "about 3x", "highest": "about 6x on a TPU"}
_warned: set[str] = set()


def _runs_outside_graphs(api: str):
    # The precision is process state compiled matmuls read when they run. Traced, the setter
    # became a graph op with no outputs, which AOTAutograd drops: set on the first call only.
    return outside_compiled_graphs(f"torch.tpu.{api}", "matmul precision")


@_runs_outside_graphs("set_float32_matmul_precision")
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


@_runs_outside_graphs("precision")
def _set(mode: int) -> None:
    # Ops DeferAndFuse has recorded run at the precision they were issued at.
    eager.materialize_deferred("matmul precision change")
    torch.ops.torch_tpu._set_matmul_precision(mode)


@_runs_outside_graphs("get_float32_matmul_precision")
def get_float32_matmul_precision() -> str:
    return _NAMES[torch.ops.torch_tpu._get_matmul_precision()]


@_runs_outside_graphs("precision")
def _enter(precision: str) -> str:
    previous = get_float32_matmul_precision()
    set_float32_matmul_precision(precision)
    return previous


@contextlib.contextmanager
def precision(precision: str) -> Iterator[None]:
    """Sets the tpu matmul precision inside a ``with`` block.

    In a compiled function it is set and restored in Python, so Dynamo runs that
    function's frame uncompiled (it cannot resume inside a ``with`` of its own);
    the functions it calls are still compiled."""
    previous = _enter(precision)
    try:
        yield
    finally:
        _set(_MODES[previous])
