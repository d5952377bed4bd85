"""Compiled graphs run directly on tpu tensors.

Inductor's CPU wrapper code passes its kernels data pointers, and a tpu
tensor's data pointer is host memory, so a graph compiled for cpu can take
the tpu tensors themselves - no host views in, no adoption out - provided
its buffers are tpu tensors too. The wrapper module allocates every buffer
through one global, ``empty_strided_cpu``; ``prepare`` points it at
``empty_strided`` (csrc/TpuDirectRun.cpp), which allocates tpu memory while
the thread is inside ``enter_direct``/``exit_direct`` and CPU memory
otherwise: the module may be shared with a CPU compile of the same code.
Matmuls in the graph are ``torch.ops.torch_tpu.mxu_*``, whose tpu kernels are
the eager ones, so the numbers are those of the host-view path.

A graph whose wrapper makes CPU tensors of its own (a ``device(type='cpu')``
in its code: factories, random seeds) keeps the host-view path, where every
tensor it meets is a CPU tensor.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

CPU_DEVICE_LITERAL = "device(type='cpu')"
_WRAPPER_SEARCH_DEPTH = 8


@functools.cache
def _builtins() -> dict[str, Callable[..., Any]]:
    from torch_tpu import _backend

    make = ctypes.PyDLL(str(_backend._LIBRARY)).torch_tpu_direct_run_functions
    make.restype = ctypes.py_object
    make.argtypes = []
    return make()


def switches() -> tuple[Callable[[int], int], Callable[[int], None]]:
    """``(enter_direct, exit_direct)``: ``enter_direct(device)`` waits for the device's queued
    stream work (as a tpu op does), then makes the buffers of graphs run on this thread tpu
    memory, and returns the previous setting, which ``exit_direct`` restores. Builtins, for
    the per-call path."""
    functions = _builtins()
    return functions["enter_direct"], functions["exit_direct"]


def layout_check() -> Callable[[Any, tuple], None]:
    """``check_layouts(args, layouts)``: raises AssertionError unless every ``(position, sizes,
    strides)`` of ``layouts`` holds for ``args[position]`` (strides of dims of size 1 free). One
    builtin call for all of a graph's inputs, in place of Inductor's assert per input."""
    return _builtins()["check_layouts"]


def _wrapper_globals(compiled: Any) -> dict[str, Any] | None:
    """The globals of the Inductor wrapper module behind ``compiled`` (a standalone_compile
    artifact, loaded or fresh): found through the AOTAutograd wrappers' closures down to the
    compiled FX graph's ``current_callable``."""
    seen: set[int] = set()
    todo: list[tuple[Any, int]] = [(compiled, 0)]
    while todo:
        obj, depth = todo.pop()
        if id(obj) in seen or depth > _WRAPPER_SEARCH_DEPTH:
            continue
        seen.add(id(obj))
        call = getattr(obj, "current_callable", None)
        if call is not None:
            fn = getattr(call, "__func__", call)
            return getattr(fn, "__globals__", None)
        for attr in ("_compiled_fn", "compiled_fn", "_torchdynamo_orig_callable", "__wrapped__"):
            if hasattr(obj, attr):
                todo.append((getattr(obj, attr), depth + 1))
        for cell in getattr(obj, "__closure__", None) or ():
            try:
                todo.append((cell.cell_contents, depth + 1))
            except ValueError:  # an empty cell
                pass
    return None


def _makes_cpu_tensors(module_globals: dict[str, Any]) -> bool:
    path = module_globals.get("__file__")
    if path is None:
        return True  # no source to check: assume it might
    try:
        with open(path, encoding="utf-8") as f:
            return CPU_DEVICE_LITERAL in f.read()
    except OSError:
        return True


def prepare(compiled: Any) -> bool:
    """Whether ``compiled`` can run directly on tpu tensors; if so, its wrapper module now
    allocates through ``empty_strided``."""
    module_globals = _wrapper_globals(compiled)
    if module_globals is None or "empty_strided_cpu" not in module_globals:
        logger.debug("direct run: no Inductor wrapper module found behind %r", compiled)
        return False
    if _makes_cpu_tensors(module_globals):
        logger.debug("direct run: %s makes CPU tensors; it runs on host views", module_globals.get("__file__"))
        return False
    module_globals["empty_strided_cpu"] = _builtins()["empty_strided"]
    return True
