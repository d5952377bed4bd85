"""Normalization statistics in host graphs keep the dtypes the tpu graph gave them.

PyTorch's decompositions of the normalization ops depend on the device type:
on a cpu tensor of bf16 or fp16 they round the saved mean and inverse
standard deviation to the input's dtype, on any other device they keep them
at fp32. A tpu graph is traced with the tpu's rules - its backward is
compiled for fp32 statistics - and then compiled for cpu (torch_tpu.inductor),
where Inductor decomposes it again with the cpu's: the forward would hand the
backward bf16 buffers it reads as fp32.

``norms_at_fp32`` runs each such op on fp32 copies of its reduced-precision
arguments, so the cpu rules have nothing to round, and casts every result back
to the dtype the tpu graph gave it: the normalized output to the input's
dtype (computed at fp32 and rounded once, as the op does), the statistics
staying fp32.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

aten, prims = torch.ops.aten, torch.ops.prims

NORMS = frozenset([
    aten.native_layer_norm.default,
    aten.native_group_norm.default,
    aten.native_batch_norm.default,
    aten._native_batch_norm_legit.default,
    aten._native_batch_norm_legit.no_stats,
    aten._native_batch_norm_legit_no_training.default,
    aten._native_batch_norm_legit_functional.default,
])
REDUCED = frozenset([torch.bfloat16, torch.float16])


def _reduced(value: object) -> bool:
    return isinstance(value, torch.Tensor) and value.dtype in REDUCED


def _convert(graph: torch.fx.Graph, node: torch.fx.Node, dtype: torch.dtype) -> torch.fx.Node:
    converted = graph.call_function(prims.convert_element_type.default, (node, dtype))
    converted.meta["val"] = node.meta["val"].to(dtype)
    return converted


def norms_at_fp32(gm: torch.fx.GraphModule) -> int:
    """Rewrites ``gm`` in place (see the module docstring); returns how many ops it moved to fp32."""
    graph = gm.graph
    moved = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in NORMS:
            continue
        source = node.args[0]
        if not (isinstance(source, torch.fx.Node) and _reduced(source.meta.get("val"))):
            continue
        results = node.meta.get("val")
        if not isinstance(results, (tuple, list)) or not all(u.target is operator.getitem for u in node.users):
            continue
        with graph.inserting_before(node):
            args = [_convert(graph, a, torch.float32) if isinstance(a, torch.fx.Node) and _reduced(a.meta.get("val"))
                    else a for a in node.args]
            wide = graph.call_function(node.target, tuple(args), dict(node.kwargs))
            wide.meta["val"] = tuple(r.to(torch.float32) if _reduced(r) else r for r in results)
        for user in list(node.users):
            index = user.args[1]
            with graph.inserting_before(user):
                item = graph.call_function(operator.getitem, (wide, index))
                item.meta["val"] = wide.meta["val"][index]
                value = _convert(graph, item, results[index].dtype) if _reduced(results[index]) else item
            user.replace_all_uses_with(value)
            graph.erase_node(user)
        graph.erase_node(node)
        moved += 1
    if moved:
        graph.lint()
        gm.recompile()
    return moved
