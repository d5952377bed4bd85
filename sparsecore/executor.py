"""The SparseCore engine's own executor: a tpu stream.

SparseCore work (host preprocessing and the lookup) submitted here runs in
order on the stream's worker thread, so it overlaps TensorCore work issued
from the main thread; the kernels release the GIL. Being a tpu stream,
``torch.tpu.synchronize()`` waits for it and events order it against other
streams.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from typing import Any

import torch

from sparsecore._library import set_kernel_threads
from sparsecore.trace import StageTrace


class SparseCoreExecutor:
    """One ordered queue of SparseCore work per device."""

    def __init__(self, device: torch.device | str = "tpu"):
        self.device = torch.device(device)
        self.stream = torch.tpu.Stream(self.device)
        self._deferred: list[concurrent.futures.Future] = []
        self.trace: StageTrace | None = None
        self._lock = threading.Lock()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        # torch.tpu.submit carries the caller's grad mode over. ATen ops on the
        # stream's worker run on one thread; the kernels take the caller's
        # thread count onto the engine's own threads.
        threads = torch.get_num_threads()

        def with_kernel_threads() -> Any:
            set_kernel_threads(threads)
            return fn(*args, **kwargs)

        return torch.tpu.submit(self.stream, with_kernel_threads)

    def run(self, stage: str, fn: Callable[..., Any], /, *args: Any) -> concurrent.futures.Future:
        """``submit``, timed as ``stage`` when a trace is set (``trace``: sparsecore.trace.StageTrace)."""
        if self.trace is not None:
            fn = self.trace.wrap(fn, stage, "sparsecore")
        return self.submit(fn, *args)

    def defer(self, stage: str, fn: Callable[..., Any], /, *args: Any) -> None:
        """Queues work nobody waits for (a deferred sparse update); its error, if any,
        is raised by the next :meth:`synchronize` or :meth:`raise_deferred_error`."""
        future = self.run(stage, fn, *args)
        with self._lock:
            self._deferred = [f for f in self._deferred if not f.done() or f.exception() is not None]
            self._deferred.append(future)

    def raise_deferred_error(self) -> None:
        """Raises the first error of finished deferred work (once)."""
        with self._lock:
            failed = [f for f in self._deferred if f.done() and f.exception() is not None]
            self._deferred = [f for f in self._deferred if not f.done()]
        if failed:
            raise failed[0].exception()

    def synchronize(self) -> None:
        """Waits for everything queued so far, deferred work included."""
        self.stream.synchronize()
        self.raise_deferred_error()


class Pending:
    """Work on the executor and what the caller finishes it with: ``result()`` waits for the
    work, then runs ``finish(work's result)`` in the calling thread, once (later calls
    return the same value). Has the Future calls callers use: ``result(timeout)``, ``done()``."""

    def __init__(self, work: concurrent.futures.Future, finish: Callable[[Any], Any]) -> None:
        self._work, self._finish = work, finish
        self._value: Any = None
        self._finished = False

    def done(self) -> bool:
        return self._work.done()

    def result(self, timeout: float | None = None) -> Any:
        if not self._finished:
            self._value = self._finish(self._work.result(timeout))
            self._finished = True
        return self._value


class Resolved:
    """A ``Pending`` whose value is already there: what a traced (``torch.compile``) step gets,
    whose lookups are ops of its graph rather than work handed to the executor's thread."""

    def __init__(self, value: Any) -> None:
        self._value = value

    def done(self) -> bool:
        return True

    def result(self, timeout: float | None = None) -> Any:
        return self._value


def completed(value: Any) -> concurrent.futures.Future:
    """A Future that is already done with ``value``."""
    done: concurrent.futures.Future = concurrent.futures.Future()
    done.set_result(value)
    return done


def run_on(device: torch.device, stage: str, fn: Callable[..., Any], /, *args: Any) -> concurrent.futures.Future:
    """``fn(*args)`` on the device's SparseCore executor; off the tpu (no executor) at once."""
    if device.type != "tpu":
        return completed(fn(*args))
    return executor_for(device).run(stage, fn, *args)


_executors: dict[torch.device, SparseCoreExecutor] = {}


def executor_for(device: torch.device | str) -> SparseCoreExecutor:
    """The device's executor, created on first use."""
    device = torch.device(device)
    if device.type == "tpu" and device.index is None:
        device = torch.device("tpu", torch.tpu.current_device())
    if device not in _executors:
        _executors[device] = SparseCoreExecutor(device)
    return _executors[device]
