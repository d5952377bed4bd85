"""Our Python and Dynamo: the functions of process state that compiled graphs read but
cannot hold run as Python at a graph break inside a ``torch.compile``d function
(``outside_compiled_graphs``); our frames that run inside a compiled function's ops
are never traced (``hide_from_dynamo``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from torch._C._dynamo import eval_frame

F = TypeVar("F", bound=Callable)


def outside_compiled_graphs(api: str, state: str) -> Callable[[F], F]:
    """Inside a function compiled by torch.compile, ``api`` runs as Python at a graph
    break, as ``torch.manual_seed`` does upstream: it reads or sets ``state``, which
    compiled graphs read when they run but cannot hold. Traced, it failed (the
    generator is an opaque object to Dynamo) or was dropped from the graph as an op
    with no outputs (the precision setter: it then took effect on the first call only)."""
    reason = (f"{api} reads or sets the tpu {state}, which runs as Python at a graph break; "
              "under fullgraph=True call it outside the compiled function")

    def mark(fn: F) -> F:
        # The two marks torch._dynamo.disable(fn, reason=...) leaves on its wrapper: Dynamo
        # breaks the graph at a call, or under fullgraph raises with the reason. Not called
        # itself: `import torch` loads this package, and importing Dynamo then doubles that time.
        fn._torchdynamo_disable = True  # type: ignore[attr-defined]
        fn._torchdynamo_disable_msg = reason  # type: ignore[attr-defined]
        # disable's run-time half, at no cost per call: when the function runs at the graph
        # break, neither its frame nor any it calls is compiled.
        hide_from_dynamo(fn.__code__)
        return fn

    return mark


def hide_from_dynamo(*codes: Any) -> None:
    """Dynamo never traces these frames nor any frame they call, at no cost per call: for
    our own Python that runs inside a compiled function's ops (a dispatch mode, a kernel
    registered in Python), which Dynamo would otherwise take for user code."""
    skip = eval_frame._FrameExecStrategy(eval_frame._FrameAction.SKIP, eval_frame._FrameAction.SKIP)
    for code in codes:
        eval_frame.set_code_exec_strategy(code, skip)
