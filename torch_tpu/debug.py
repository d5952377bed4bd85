"""Debug mode's checks (torch_tpu.eager): index bounds and NaN/Inf, with the user's source line.

Every op on tpu tensors passes through ``DebugChecks`` (a dispatch mode):

* before it runs, the checker registered for the op (``register_checker``) looks
  at its arguments. Built in: index_select, gather, scatter (all variants),
  index, index_put, embedding, embedding_bag. Other packages add theirs (the
  SparseCore engine registers its lookup), so torch_tpu needs to know nothing
  of them. A checker raises ``IndexError`` through ``out_of_range``.
* after it runs, the values it produced are checked for NaN and Inf, as
  ``set_nan_check`` says: ``"raise"`` (the default) raises
  ``FloatingPointError``, ``"warn"`` warns, ``"off"`` skips the check.

What counts as a value the op produced (floating and complex tpu tensors only):

* a fresh output. An output that aliases an input (a view, or the ``self`` an
  in-place op returns, per the op's schema or a shared storage) holds no new
  value and is not checked; nor are the outputs of ``empty``, ``empty_like``,
  ``empty_strided``, ``new_empty``... (uninitialized memory by contract).
* what an in-place op (or an ``out=`` argument) wrote: its mutated tensors are
  checked after the op, but a NaN already at that position before it ran is not
  new (filling a ``torch.empty`` buffer slice by slice is fine: what was not
  written is not reported).

The rule for each (the line jax's ``debug_nans``/``debug_infs`` and PyTorch's
anomaly mode draw differently: jax checks every primitive's outputs, anomaly
mode only NaN):

* NaN is always reported: no op needs one, and it spreads to everything.
* Inf is reported only where the op created it: its output holds an Inf though
  none of its inputs did (overflow, ``x / 0``, ``log(0)``, ``exp(1000)``).
  An Inf the op was given is deliberate and passes: a fill value
  (``full(..., -inf)``, ``scalar_tensor(-inf)``, ``masked_fill(mask, -inf)``),
  an operand already infinite (``where``, ``x + mask`` with a -inf attention
  mask, softmax over it). The inputs counted are the op's numbers, 0-dim
  tensors (PyTorch's scalars) and tpu tensors (before the op ran, for the
  tensors it mutates); a tensor copied in from another device is new data
  and is checked.
"""

from __future__ import annotations

import cmath
import math
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


def _checked(t: Any) -> bool:
    """A tensor whose values Debug checks: floating or complex, on the tpu, not empty."""
    return (isinstance(t, torch.Tensor) and t.device.type == "tpu" and (t.is_floating_point() or t.is_complex())
            and t.numel() > 0)


def _storage(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except Exception:  # noqa: BLE001 (a tensor without storage: aliases nothing)
        return -id(t)


def _tensors(value: Any) -> list[torch.Tensor]:
    return [v for v in tree_flatten(value)[0] if isinstance(v, torch.Tensor)]


def _is_finite(value: Any) -> bool:
    """Whether a number, or a tensor's values, are all finite (non-numbers count as finite)."""
    if isinstance(value, torch.Tensor):
        if not (value.is_floating_point() or value.is_complex()) or value.numel() == 0:
            return True
        return bool(torch.isfinite(value).all())
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, complex):
        return cmath.isfinite(value)
    return True


class _Written:
    """A tensor an in-place op mutates (or an ``out=`` argument): its state before the op ran."""

    def __init__(self, tensor: torch.Tensor, name: str, out: bool):
        self.tensor, self.name = tensor, name
        # An ``out=`` argument is overwritten whole (and maybe resized): what it held is no input.
        self.finite = out or bool(torch.isfinite(tensor).all())
        # Where it already held NaN (uninitialized memory, say): not the op's doing.
        self.nan_before = None if self.finite else torch.isnan(tensor)


def _arguments(func: Any, args: tuple, kwargs: dict) -> list[tuple[Any, Any]]:
    """(schema argument, value) of each argument the call passed."""
    pairs = []
    for i, argument in enumerate(func._schema.arguments):
        if i < len(args) and not argument.kwarg_only:
            pairs.append((argument, args[i]))
        elif argument.name in kwargs:
            pairs.append((argument, kwargs[argument.name]))
    return pairs


def _written_before(func: Any, args: tuple, kwargs: dict) -> list[_Written]:
    """Snapshots of the checked tensors the op is about to write."""
    written = []
    for argument, value in _arguments(func, args, kwargs):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        if isinstance(value, torch.Tensor):
            items = [(argument.name, value)]
        else:
            items = [(f"{argument.name}[{j}]", v) for j, v in enumerate(value or [])]
        written.extend(_Written(t, name, argument.kwarg_only) for name, t in items if _checked(t))
    return written


def _fresh_outputs(func: Any, out: Any, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The outputs that hold values the op made: not views or returned inputs."""
    returns = func._schema.returns
    values = list(out) if isinstance(out, (tuple, list)) and len(returns) > 1 else [out]
    if len(values) != len(returns):  # not as the schema says: trust storage alone
        values, returns = [out], [None]
    input_storages = {_storage(t) for t in inputs if t.device.type == "tpu"}
    fresh = []
    for ret, value in zip(returns, values):
        if ret is not None and ret.alias_info is not None:
            continue  # a view or an alias of an input (the written ones are checked as such)
        for t in _tensors(value):
            if _checked(t) and _storage(t) not in input_storages:
                fresh.append(t)
    return fresh


def _inputs_finite(args: tuple, kwargs: dict, written: list[_Written]) -> bool:
    """Whether the op's inputs (numbers, 0-dim tensors, tpu tensors) held no NaN or Inf before it ran."""
    if not all(w.finite for w in written):
        return False
    written_storages = {_storage(w.tensor) for w in written}
    written_ids = {id(w.tensor) for w in written}
    for value in tree_flatten((args, kwargs))[0]:
        if isinstance(value, torch.Tensor):
            if id(value) in written_ids or (value.device.type == "tpu" and _storage(value) in written_storages):
                continue  # its state before the op is in ``written`` (all finite, checked above)
            if value.device.type != "tpu" and value.dim() > 0:
                continue  # data entering the tpu: new values, checked as such
        if not _is_finite(value):
            return False
    return True


def _report(op: Any, what: str, kind: str) -> None:
    message = f"{_name(op)}: {what} holds {kind}; called from {user_frame()}"
    if _nan_check == "raise":
        raise FloatingPointError(message)
    warnings.warn(message, RuntimeWarning, stacklevel=3)


def _check_finite(op: Any, args: tuple, kwargs: dict, out: Any, written: list[_Written]) -> None:
    """Reports a NaN the op produced, or an Inf it created from finite inputs (the module's docstring)."""
    inputs = _tensors((args, kwargs))
    candidates: list[tuple[str, torch.Tensor, Any]] = []  # (what, tensor, NaN already there before)
    flat = tree_flatten(out)[0]

    def output(t: torch.Tensor) -> int | None:  # its index in the flattened result
        return next((k for k, v in enumerate(flat) if v is t), None)

    for w in written:
        index = output(w.tensor)
        candidates.append((f"output {index}" if index is not None else f"argument {w.name}", w.tensor, w.nan_before))
    candidates += [(f"output {output(t)}", t, None) for t in _fresh_outputs(op, out, inputs)]
    inputs_finite = None  # computed when an Inf needs it
    for what, t, nan_before in candidates:
        if bool(torch.isfinite(t).all()):
            continue
        nan = torch.isnan(t)
        if nan_before is not None and nan_before.shape == nan.shape:
            nan = nan & ~nan_before
        if bool(nan.any()):
            _report(op, what, "NaN")
            continue
        if not bool(torch.isinf(t).any()):
            continue  # the NaN it holds was there before the op
        if inputs_finite is None:
            inputs_finite = _inputs_finite(args, kwargs, written)
        if inputs_finite:
            _report(op, what, "Inf")


class DebugChecks(TorchDispatchMode):
    """The dispatch mode Debug enters: checks before and after every op on tpu tensors."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat, _ = tree_flatten((args, kwargs))
        if _on_tpu(flat):
            checker = _checkers.get(func) or _checkers.get(func.overloadpacket)
            if checker is not None:
                checker(func, args, kwargs)
        # (this mode is off while it runs: the check's own ops are not checked)
        check = _nan_check != "off" and func.overloadpacket not in _UNINITIALIZED
        written = _written_before(func, args, kwargs) if check else []
        out = func(*args, **kwargs)
        # Outputs are checked whatever the inputs: torch.full(..., device="tpu") and a
        # copy to the tpu make tpu tensors from none (only tpu tensors are checked).
        if check:
            _check_finite(func, args, kwargs, out, written)
        return out
