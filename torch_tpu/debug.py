"""Debug mode's checks (torch_tpu.eager): index bounds and NaN/Inf, with the user's source line.

Every op on tpu tensors passes through ``DebugChecks`` (a dispatch mode):

* before it runs, the checker registered for the op (``register_checker``) looks
  at its arguments. Built in: index_select, gather, scatter (all variants),
  index, index_put, embedding, embedding_bag. Other packages add theirs (the
  SparseCore engine registers its lookup), so torch_tpu needs to know nothing
  of them. A checker raises ``IndexError`` through ``out_of_range``.
* after it runs, its floating outputs are checked for NaN and Inf, as
  ``set_nan_check`` says: ``"raise"`` (the default) raises
  ``FloatingPointError``, ``"warn"`` warns, ``"off"`` skips the check.
"""

from __future__ import annotations

import os
import traceback
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

Checker = Callable[[Any, tuple, dict], None]
"""checker(op, args, kwargs): raises when the op's arguments are out of range."""

NAN_CHECKS = ("raise", "warn", "off")
_checkers: dict[Any, Checker] = {}
_nan_check = "raise"


def register_checker(op: Any, checker: Checker) -> None:
    """Runs ``checker(op, args, kwargs)`` before every call of ``op`` (an OpOverload, or an
    OpOverloadPacket for all its overloads) on tpu tensors in Debug mode."""
    _checkers[op] = checker


def set_nan_check(action: str) -> None:
    """What Debug mode does with a NaN or Inf in an op's output: raise, warn or off."""
    global _nan_check
    if action not in NAN_CHECKS:
        raise ValueError(f"nan check {action!r}: expected one of {list(NAN_CHECKS)}")
    _nan_check = action


def get_nan_check() -> str:
    return _nan_check


# Frames inside these directories are the library's, not the user's.
_LIBRARY_DIRS = tuple(os.path.dirname(m.__file__) + os.sep for m in (torch,)) + (
    os.path.dirname(os.path.abspath(__file__)) + os.sep,)
_extra_library_dirs: list[str] = []


def register_library_dir(path: str) -> None:
    """Frames under ``path`` are skipped when naming the user's source line (e.g. sparsecore's)."""
    _extra_library_dirs.append(os.path.abspath(path) + os.sep)


def user_frame() -> str:
    """``file:line in function: code`` of the innermost frame outside torch and the libraries."""
    library = _LIBRARY_DIRS + tuple(_extra_library_dirs)
    for frame in reversed(traceback.extract_stack()):
        filename = os.path.abspath(frame.filename)
        if not filename.startswith(library) and "/contextlib.py" not in filename:
            return f"{frame.filename}:{frame.lineno} in {frame.name}: {(frame.line or '').strip()}"
    return "(no user frame)"


def out_of_range(op: Any, tensor: str, index: torch.Tensor, size: int, what: str, *,
                 negative_ok: bool = False) -> None:
    """Raises IndexError if a value of ``index`` (the argument named ``tensor``) is outside
    ``[0, size)`` (``[-size, size)`` with ``negative_ok``); ``what`` names the dimension."""
    if index.numel() == 0 or index.is_floating_point() or index.dtype == torch.bool:
        return
    low = -size if negative_ok else 0
    flat = index.reshape(-1)
    bad = (flat < low) | (flat >= size)
    if not bool(bad.any()):
        return
    position = int(bad.nonzero()[0, 0])
    value = int(flat[position])
    raise IndexError(f"{_name(op)}: {tensor}[{_unravel(position, index.shape)}] = {value} is out of range for "
                     f"{what} of size {size} (expected {low} <= {tensor} < {size}); called from {user_frame()}")


def _name(op: Any) -> str:
    return str(op)  # e.g. aten.index_select.default


def _unravel(position: int, shape: Sequence[int]) -> str:
    coords = []
    for size in reversed(list(shape) or [1]):
        coords.append(position % size)
        position //= size
    return ", ".join(str(c) for c in reversed(coords))


def _arg(args: tuple, kwargs: dict, position: int, name: str, default: Any = None) -> Any:
    return args[position] if len(args) > position else kwargs.get(name, default)


def _check_dim_index(op, args, kwargs) -> None:  # (self, dim, index, ...)
    self, dim, index = _arg(args, kwargs, 0, "self"), _arg(args, kwargs, 1, "dim"), _arg(args, kwargs, 2, "index")
    size = self.shape[dim] if self.dim() else 1
    out_of_range(op, "index", index, size, f"dimension {dim} of self")


def _check_indices(op, args, kwargs) -> None:  # (self, indices, ...): advanced indexing
    self, indices = _arg(args, kwargs, 0, "self"), _arg(args, kwargs, 1, "indices")
    dim = 0  # the dimension of self the next index applies to: a k-dim mask takes k of them
    for i, index in enumerate(indices or []):
        if index is not None and index.dtype in (torch.bool, torch.uint8):
            dim += index.dim()
            continue
        if index is not None and dim < self.dim():
            out_of_range(op, f"indices[{i}]", index, self.shape[dim], f"dimension {dim} of self", negative_ok=True)
        dim += 1


def _check_embedding(op, args, kwargs) -> None:  # (weight, indices, ...)
    weight, indices = _arg(args, kwargs, 0, "weight"), _arg(args, kwargs, 1, "indices")
    out_of_range(op, "indices", indices, weight.shape[0], "the rows of weight")


aten = torch.ops.aten
for _op in (aten.index_select, aten.gather, aten.scatter, aten.scatter_, aten.scatter_add, aten.scatter_add_,
            aten.scatter_reduce, aten.scatter_reduce_):
    register_checker(_op, _check_dim_index)
for _op in (aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_):
    register_checker(_op, _check_indices)
for _op in (aten.embedding, aten.embedding_bag, aten._embedding_bag, aten._embedding_bag_forward_only):
    register_checker(_op, _check_embedding)


# Ops whose outputs are uninitialized memory (or storage set by hand): nothing to check.
_UNINITIALIZED = {getattr(aten, name) for name in ("empty", "empty_like", "empty_strided", "new_empty",
                                                   "new_empty_strided", "empty_permuted", "resize_", "set_")
                  if hasattr(aten, name)}


def _on_tpu(values: list) -> bool:
    return any(isinstance(v, torch.Tensor) and v.device.type == "tpu" for v in values)


def _check_finite(op: Any, outputs: list) -> None:
    for i, out in enumerate(outputs):
        if not (isinstance(out, torch.Tensor) and out.device.type == "tpu"
                and (out.is_floating_point() or out.is_complex())):
            continue
        if out.numel() == 0 or bool(torch.isfinite(out).all()):
            continue
        kind = "NaN" if bool(torch.isnan(out).any()) else "Inf"
        message = f"{_name(op)}: output {i} holds {kind}; called from {user_frame()}"
        if _nan_check == "raise":
            raise FloatingPointError(message)
        warnings.warn(message, RuntimeWarning, stacklevel=2)


class DebugChecks(TorchDispatchMode):
    """The dispatch mode Debug enters: checks before and after every op on tpu tensors."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat, _ = tree_flatten((args, kwargs))
        if _on_tpu(flat):
            checker = _checkers.get(func) or _checkers.get(func.overloadpacket)
            if checker is not None:
                checker(func, args, kwargs)
        out = func(*args, **kwargs)
        # Outputs are checked whatever the inputs: torch.full(..., device="tpu") and a
        # copy to the tpu make tpu tensors from none (_check_finite looks at tpu outputs only).
        if _nan_check != "off" and func.overloadpacket not in _UNINITIALIZED:  # (this mode is off while it runs: the check's own ops are not checked)
            _check_finite(func, tree_flatten(out)[0])
        return out
