"""The ops graphs hold: ATen's and prims', and custom tpu ops registered here.

A registered op is a pure function of its arguments - fresh outputs, no state,
no stream of its own - with a Meta kernel, and a CPU kernel that computes its
tpu semantics (the MXU precision included) on host views of tpu tensors.
DeferAndFuse records it instead of materializing its pending graph there, and
a compiled graph (``torch_tpu.inductor``) runs its CPU kernel as an extern
call inside the graph instead of being split around it.

Kernels with effects of their own - the SparseCore engine's (its executor, its
tables updated in place), collectives - are not registered: DeferAndFuse
materializes at them, and compiled graphs are compiled around them.
"""

from __future__ import annotations

import torch

ATEN_NAMESPACES = frozenset(["aten", "prims"])
_registered: set[torch._ops.OpOverload] = set()


def register_graph_op(op: torch._ops.OpOverload) -> None:
    """Lets graphs hold ``op`` (an overload, e.g. ``torch.ops.torch_tpu.dot_interaction.default``)."""
    if not isinstance(op, torch._ops.OpOverload):
        raise TypeError(f"register_graph_op takes an op overload (torch.ops.<ns>.<op>.<overload>), got {op!r}")
    if not op.has_kernel_for_dispatch_key(torch._C.DispatchKey.CPU) or not op.has_kernel_for_dispatch_key(
            torch._C.DispatchKey.Meta):
        raise ValueError(f"{op}: a graph op needs a CPU kernel (its tpu semantics on host views) and a Meta kernel")
    _registered.add(op)


def is_graph_op(op: object) -> bool:
    """Whether DeferAndFuse records ``op`` and compiled graphs run it: an ATen or prims op, or a
    registered one. (Other checks still apply: random ops, data-dependent shapes, ...)"""
    return getattr(op, "namespace", None) in ATEN_NAMESPACES or op in _registered
