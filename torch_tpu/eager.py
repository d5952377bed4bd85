"""Eager execution modes of the tpu device: Strict, Debug, DeferAndFuse.

* Strict (the default): one ATen op at a time, as issued.
* Debug: every op synchronous (work submitted to tpu streams, e.g. the
  SparseCore engine's, runs at once on the calling thread), indices of
  indexing ops bounds-checked and floating outputs checked for NaN/Inf
  (torch_tpu.debug). Errors name the op, the tensor, the offending value and
  the line of user code that issued it.
* DeferAndFuse: ops recorded and run as fused graphs (torch_tpu.defer).

Chosen by ``TORCH_TPU_LAUNCH_BLOCKING=1`` (also the upstream spelling
``TPU_LAUNCH_BLOCKING=1``) -> Debug, ``TORCH_TPU_DEFER_AND_FUSE=1`` ->
DeferAndFuse, read when the mode is first asked for; or by
``set_eager_mode(...)`` and the ``eager_mode(...)`` context manager. Debug's
checks run in a dispatch mode, which is per thread: they cover the thread
that set the mode (and whatever work it submits to tpu streams, which runs
inline in Debug); another thread enters or leaves them when it next asks for
the mode (as submitting to a stream does). DeferAndFuse's recording is a
dispatch mode too, entered by the thread that chose it (autograd's backward
threads inherit it); other threads asking for the mode only leave it, so
stream workers never record.
"""

from __future__ import annotations

import contextlib
import enum
import os
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any


class EagerMode(enum.Enum):
    STRICT = "strict"
    DEBUG = "debug"
    DEFER_AND_FUSE = "defer_and_fuse"


DEBUG_VARIABLES = ("TORCH_TPU_LAUNCH_BLOCKING", "TPU_LAUNCH_BLOCKING")
DEFER_VARIABLE = "TORCH_TPU_DEFER_AND_FUSE"
_FLAGS = {"": False, "0": False, "1": True}

_lock = threading.Lock()
_mode: EagerMode | None = None  # None: not read from the environment yet
_local = threading.local()  # the Debug dispatch mode this thread entered, if any


def mode_from_environment(environ: Mapping[str, str] | None = None) -> EagerMode:
    """The mode the environment variables ask for (see the module docstring)."""
    environ = os.environ if environ is None else environ

    def flag(name: str) -> bool:
        value = environ.get(name, "").strip()
        if value not in _FLAGS:
            raise ValueError(f"{name}={value!r}: expected 1 (on) or 0 (off)")
        return _FLAGS[value]

    debug = any([flag(name) for name in DEBUG_VARIABLES])
    defer = flag(DEFER_VARIABLE)
    if debug and defer:
        raise ValueError(f"{DEFER_VARIABLE}=1 and {'/'.join(DEBUG_VARIABLES)}=1 ask for two eager modes; set one")
    return EagerMode.DEBUG if debug else EagerMode.DEFER_AND_FUSE if defer else EagerMode.STRICT


def _as_mode(mode: EagerMode | str) -> EagerMode:
    if isinstance(mode, EagerMode):
        return mode
    try:
        return EagerMode(str(mode).lower())
    except ValueError:
        raise ValueError(f"eager mode {mode!r}: expected one of {[m.value for m in EagerMode]}") from None


def get_eager_mode() -> EagerMode:
    """The current eager mode (the environment's until set)."""
    global _mode
    mode = _mode  # read without the lock: it is on every stream submission's path
    first_read = False
    if mode is None:
        with _lock:
            if _mode is None:
                _mode = mode_from_environment()
                first_read = True
            mode = _mode
    # DeferAndFuse records on the thread that chose it (and the backward
    # threads that inherit its modes), not on stream workers that ask.
    _enter_mode_on_this_thread(mode, record=first_read)
    return mode


def set_eager_mode(mode: EagerMode | str) -> None:
    """Switches the eager mode: ``EagerMode`` or its value (``"strict"``, ``"debug"``, ...)."""
    global _mode
    mode = _as_mode(mode)
    if mode is EagerMode.DEBUG:
        import torch

        torch.tpu.synchronize()  # what was queued before runs under the old mode, then all is synchronous
    with _lock:
        _mode = mode
    _enter_mode_on_this_thread(mode)


@contextlib.contextmanager
def eager_mode(mode: EagerMode | str) -> Iterator[None]:
    """``set_eager_mode(mode)`` for the block, the previous mode after it."""
    previous = get_eager_mode()
    set_eager_mode(mode)
    try:
        yield
    finally:
        set_eager_mode(previous)


def materialize_deferred(reason: str) -> None:
    """Runs DeferAndFuse's pending graph, if DeferAndFuse was ever entered
    (torch_tpu.defer is imported only then: Strict pays nothing)."""
    defer = sys.modules.get("torch_tpu.defer")
    if defer is not None:
        defer.materialize(reason)


def run_unrecorded(fn: Callable[..., Any], args: Sequence[Any], reason: str) -> Any:
    """``fn(*args)``, as a sync point of DeferAndFuse if it was ever entered
    (torch_tpu.defer.run_unrecorded); Strict imports nothing for it."""
    defer = sys.modules.get("torch_tpu.defer")
    return fn(*args) if defer is None else defer.run_unrecorded(fn, args, reason)


def is_synchronous() -> bool:
    """Whether work submitted to tpu streams must run at once (Debug)."""
    return get_eager_mode() is EagerMode.DEBUG


def _enter_mode_on_this_thread(mode: EagerMode, record: bool = True) -> None:
    """The mode's dispatch mode - Debug's checks or DeferAndFuse's recording -
    entered on this thread (and the other left)."""
    if mode is not EagerMode.DEFER_AND_FUSE and getattr(_local, "deferring", False):
        from torch_tpu import defer

        try:
            defer.leave_on_this_thread()
        finally:  # left even when the pending graph's run raised; not when leaving was refused
            _local.deferring = defer.on_this_thread()
    active = getattr(_local, "checks", None)
    if mode is EagerMode.DEBUG and active is None:
        from torch_tpu.debug import DebugChecks

        _local.checks = DebugChecks()
        _local.checks.__enter__()
    elif mode is not EagerMode.DEBUG and active is not None:
        from torch.utils._python_dispatch import _get_current_dispatch_mode

        if _get_current_dispatch_mode() is not active:
            # Popping now would pop the mode entered after Debug's, not Debug's.
            raise RuntimeError("cannot leave the Debug eager mode while a dispatch mode entered after it is "
                               f"active ({type(_get_current_dispatch_mode()).__name__}); exit that mode first")
        _local.checks = None
        active.__exit__(None, None, None)
    if mode is EagerMode.DEFER_AND_FUSE and record and not getattr(_local, "deferring", False):
        from torch_tpu import defer

        defer.enter_on_this_thread()
        _local.deferring = True
