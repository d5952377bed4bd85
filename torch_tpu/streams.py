"""Streams and events on tpu (``torch.tpu.Stream`` and friends).

A stream is an ordered queue. TensorCore ops run synchronously on the calling
thread (the default stream); other streams each have a worker thread that
runs submitted work in order. Packages with work of their own (the SparseCore
executor) put it on a tpu stream with :func:`submit`, so events order it
against other streams and ``torch.tpu.synchronize()`` waits for it.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import itertools
import threading
from collections.abc import Callable
from typing import Any

import torch

from torch_tpu import _backend, eager
from torch_tpu.device import _device_t, _index
from torch_tpu.graph_breaks import F, outside_compiled_graphs


def _streams(api: str) -> Callable[[F], F]:
    # A stream object is made or looked up by C code Dynamo cannot trace (torch.Stream's
    # constructor): traced, these failed with Dynamo's generic message.
    return outside_compiled_graphs(f"torch.tpu.{api}", "streams")


class Stream(torch.Stream):
    """A new stream on a tpu device (``torch.tpu.Stream(device=None)``)."""

    @_streams("Stream")
    def __new__(cls, device: _device_t = None, priority: int = 0, **kwargs: Any) -> Stream:
        if kwargs:  # wrapping an existing stream: stream_id, device_index, device_type
            return super().__new__(cls, priority=priority, **kwargs)
        return super().__new__(cls, device=torch.device("tpu", _index(device)), priority=priority)


class Event:
    """``torch.tpu.Event(enable_timing=False)``: a ``torch.Event`` on the tpu.

    Returns a plain torch.Event: torch's event methods accept no subclass as
    their peer (``elapsed_time`` of a subclass instance fails).
    """

    def __new__(cls, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> torch.Event:
        return torch.Event(device="tpu", enable_timing=enable_timing, blocking=blocking, interprocess=interprocess)


def _wrap(s: torch.Stream) -> Stream:
    return Stream(stream_id=s.stream_id, device_index=s.device_index, device_type=s.device_type)


@_streams("current_stream")
def current_stream(device: _device_t = None) -> Stream:
    return _wrap(torch.accelerator.current_stream(_index(device)))


@_streams("default_stream")
def default_stream(device: _device_t = None) -> Stream:
    idx = _index(device)
    return Stream(stream_id=0, device_index=idx, device_type=current_stream(idx).device_type)


@_streams("set_stream")
def set_stream(stream: torch.Stream) -> None:
    if stream is not None:
        torch.accelerator.set_stream(stream)


class StreamContext:
    """Makes ``stream`` current inside a ``with`` block, and its device current (as
    torch.cuda.StreamContext); on leaving, the previous stream of each device and the
    previous device are current again."""

    def __init__(self, stream: torch.Stream | None):
        self.stream = stream
        self.previous: list[torch.Stream] = []  # restored in this order: the device left last

    # Traced, Dynamo split the block's frame at torch.accelerator's stream functions, and under
    # fullgraph failed on the stream's device index with its generic message.
    @_streams("stream")
    def __enter__(self) -> torch.Stream | None:
        if self.stream is not None:
            here = torch.accelerator.current_device_index()
            self.previous = [torch.accelerator.current_stream(here)]
            if self.stream.device_index != here:
                self.previous.insert(0, torch.accelerator.current_stream(self.stream.device_index))
            torch.accelerator.set_stream(self.stream)
        return self.stream

    @_streams("stream")
    def __exit__(self, *exc: object) -> None:
        for previous in self.previous:  # set_stream makes the stream's device current
            torch.accelerator.set_stream(previous)
        self.previous = []


def stream(stream: torch.Stream | None) -> StreamContext:
    return StreamContext(stream)


# One trampoline for all submitted work: the C side passes back a key into
# _tasks, so no ctypes callback object is ever freed while it runs.
_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_tasks: dict[int, Callable[[], None]] = {}
_keys = itertools.count(1)
_lock = threading.Lock()


@functools.cache
def _submit_c():
    """The C entry point, with its prototype declared once."""
    fn = _backend.library.torch_tpu_stream_submit
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, _CALLBACK, ctypes.c_void_p]
    return fn


@_CALLBACK
def _run_task(key: int) -> None:
    with _lock:
        task = _tasks.pop(key)
    task()


@_streams("submit")
def submit(stream: torch.Stream, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
    """Runs ``fn(*args, **kwargs)`` on ``stream`` after the work queued before it.

    Returns a Future with the result or the exception. On the default stream
    the call runs at once on the calling thread. The work runs with the
    submitting thread's grad mode (per thread: the worker would otherwise keep
    its own). ATen ops on a stream's worker run on one thread: a second thread
    starting OpenMP teams would slow every parallel op of the process
    (csrc/TpuThreads.h); work that needs more threads brings its own.
    """
    eager.materialize_deferred("work submitted to a tpu stream")  # the work may read any tensor it was given
    future: concurrent.futures.Future = concurrent.futures.Future()
    grad = torch.is_grad_enabled()

    def task() -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            with torch.set_grad_enabled(grad):
                future.set_result(fn(*args, **kwargs))
        except BaseException as error:  # noqa: BLE001 - handed to the caller
            future.set_exception(error)

    if eager.is_synchronous():  # Debug: after what the stream holds, at once, on this thread
        if stream.device.type != "tpu":
            raise ValueError(f"Cannot submit to {stream}: not a tpu stream")
        stream.synchronize()
        task()
        return future
    with _lock:
        key = next(_keys)
        _tasks[key] = task
    if _submit_c()(stream.device_index, stream.stream_id, _run_task, key) != 0:
        with _lock:
            _tasks.pop(key, None)
        raise ValueError(f"Cannot submit to {stream}: not a tpu stream")
    return future
