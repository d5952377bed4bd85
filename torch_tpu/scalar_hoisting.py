"""Scalar math computed once per graph call, not once per element.

Inductor inlines a 0-d computation into every kernel that reads it, and the
C++ compiler cannot lift it out of the kernel's loop (the loop's stores may
alias the 0-d inputs). An optimizer's graph is the common case: AdamW's bias
corrections ``1 - beta ** step`` (a ``pow`` of the step tensor, then a
division, a square root) were evaluated for every 8 elements of every
parameter: the eager-modes benchmark's small-op step spent 390 us a step in
its AdamW kernel, 145 us with them hoisted.

``hoist_scalar_math`` stacks the 0-d values that such a loop reads into one
vector and lets the loop read them from it: on CPU Inductor lowers the stack
to a concat whose inputs are computed straight into one buffer, by one small
kernel, before the loops run. Only values whose computation has a
transcendental op or a division are worth the buffer; a value used by no
large kernel is left where it is.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

aten = torch.ops.aten

# A 0-d value is hoisted when its computation holds one of these (by op name,
# foreach forms included): a call or a long-latency instruction per element.
COSTLY_SCALAR_OPS = frozenset(
    ["pow", "exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "sqrt", "rsqrt", "reciprocal", "div",
     "erf", "tanh", "sigmoid", "sin", "cos", "atan2"]
)
# Elements a reading kernel must loop over for a hoisted value to pay for the stack.
MIN_READER_ELEMENTS = 1024


def _is_scalar(value: object) -> bool:
    return (isinstance(value, torch.Tensor) and value.dim() == 0 and value.dtype.is_floating_point)


def _all_scalars(value: object) -> bool:
    if isinstance(value, (list, tuple)):
        return len(value) > 0 and all(_all_scalars(v) for v in value)
    return _is_scalar(value)


def _elements(value: object) -> int:
    """The largest tensor's element count in a node's value (a tensor or a list of them)."""
    if isinstance(value, torch.Tensor):
        return value.numel()
    if isinstance(value, (list, tuple)):
        return max((_elements(v) for v in value), default=0)
    return 0


def _op_name(node: torch.fx.Node) -> str:
    name = getattr(node.target, "__name__", "").split(".")[0]
    return name.removeprefix("_foreach_").rstrip("_")


class _CostlyCones:
    """Whether a 0-d node's computation, back through 0-d nodes, holds a costly op."""

    def __init__(self) -> None:
        self._memo: dict[torch.fx.Node, bool] = {}

    def __call__(self, node: torch.fx.Node) -> bool:
        if node not in self._memo:
            costly = node.op == "call_function" and (
                node.target is not operator.getitem and _op_name(node) in COSTLY_SCALAR_OPS)
            self._memo[node] = costly or any(
                self(a) for a in node.all_input_nodes if a.op == "call_function" and _all_scalars(a.meta.get("val")))
        return self._memo[node]


def _large_readers(node: torch.fx.Node) -> list[torch.fx.Node]:
    return [u for u in node.users if _elements(u.meta.get("val")) >= MIN_READER_ELEMENTS]


def hoist_scalar_math(gm: torch.fx.GraphModule) -> int:
    """Rewrites ``gm`` in place (see the module docstring); returns how many 0-d
    values large kernels now read from a stacked vector."""
    costly = _CostlyCones()
    hoisted = 0
    pending: list[torch.fx.Node] = []  # hoistable values not yet stacked, in graph order
    for node in list(gm.graph.nodes):
        if pending and any(u is node for p in pending for u in _large_readers(p)):
            hoisted += _stack_before(gm.graph, node, pending)
            pending = []
        if (node.op == "call_function" and _is_scalar(node.meta.get("val")) and _large_readers(node)
                and costly(node)):
            pending.append(node)
    if hoisted:
        gm.graph.lint()
        gm.recompile()
    return hoisted


def _stack_before(graph: torch.fx.Graph, reader: torch.fx.Node, values: list[torch.fx.Node]) -> int:
    """Stacks ``values`` (one vector per dtype) just before ``reader``, the first
    node reading any of them, and points their large readers at the vector's
    elements. Every reader comes at or after ``reader``: it was the first."""
    by_dtype: dict[torch.dtype, list[torch.fx.Node]] = {}
    for v in values:
        by_dtype.setdefault(v.meta["val"].dtype, []).append(v)
    for group in by_dtype.values():
        with graph.inserting_before(reader):
            stacked = graph.call_function(aten.stack.default, (group,))
            stacked.meta["val"] = torch.stack([v.meta["val"] for v in group])
            for i, value in enumerate(group):
                element = graph.call_function(aten.select.int, (stacked, 0, i))
                element.meta["val"] = value.meta["val"]
                for user in _large_readers(value):
                    user.replace_input_with(value, element)
    return len(values)
