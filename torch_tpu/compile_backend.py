"""``torch.compile(model, backend="tpu")``: Dynamo's graph, AOTAutograd's
forward and backward on tpu tensors, each compiled by Inductor on tpu
(torch_tpu.inductor) through the three-tier compile cache.

Graphs are compiled for static shapes only. When Dynamo hands over a graph
with symbolic sizes (it does once a function has been called with other
shapes: "automatic dynamic"), the backend compiles one specialization per
shape signature seen, at its first call, up to ``MAX_SPECIALIZATIONS``; past
that it warns once and runs new shapes op by op (uncompiled), so a loop over
ever-changing shapes never compiles without bound. A graph whose symbolic
sizes reach only ops that run as they are (a KJT's ids, which vary with every
batch, into SparseCore's preprocessing) is compiled once for all sizes; so is
one whose symbolic sizes are those of flat inputs only (a KJT's ids, weights
and lengths, say, into TorchRec's position weighting): the ops of those sizes
run as they are, the rest is compiled.

Registered with Dynamo by the ``torch_dynamo_backends`` entry point, so
importing torch_tpu does not import Dynamo.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx

from torch_tpu import eager, inductor

logger = logging.getLogger(__name__)

MAX_SPECIALIZATIONS = 8


def _compile_boxed(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
    from torch.utils._python_dispatch import _disable_current_modes

    # With every dispatch mode off: AOTAutograd compiles a backward at its first call,
    # inside autograd, where Dynamo's own compile-time switch-off does not reach, and
    # DeferAndFuse would otherwise record the compile's ops on fake tensors.
    with _disable_current_modes():
        run = inductor.compile_graph(gm, example_inputs)

    def call(args: list) -> Any:  # AOTAutograd's boxed convention: the arguments as one list
        if torch._C._len_torch_dispatch_stack():  # DeferAndFuse, say: the graph is a sync point
            return eager.run_unrecorded(run, args, "torch.compile graph")
        return run(*args)

    call._boxed_call = True
    return call


def _aot_compile(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Callable[..., Any]:
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    # No decompositions: the graphs keep ATen's own ops (native_layer_norm, softmax,
    # their backwards). Inductor decomposes them itself when it compiles a graph (the
    # matmul family excepted: those become MXU ops first, torch_tpu.inductor), and a
    # graph that runs faster op by op then runs Strict's kernels, not decompositions of
    # them: the transformer block's forward took 89 ms op by op decomposed, 70 whole.
    backend = aot_autograd(
        fw_compiler=_compile_boxed,
        bw_compiler=_compile_boxed,
        inference_compiler=_compile_boxed,
        decompositions={},
        partition_fn=min_cut_rematerialization_partition,
        keep_inference_input_mutations=True,
    )
    return backend(gm, example_inputs, **kwargs)


def _signature(args: Sequence[Any]) -> tuple:
    return tuple((tuple(a.shape), a.stride(), a.dtype, a.device) if isinstance(a, torch.Tensor) else a
                 for a in args)


class ShapeSpecializations:
    """A symbolic-shape graph run as static-shape compiles, one per signature."""

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        self.gm = gm
        self.compiled: dict[tuple, Callable[..., Any]] = {}
        self._warned = False

    def __call__(self, *args: Any) -> Any:
        key = _signature(args)
        fn = self.compiled.get(key)
        if fn is None:
            if len(self.compiled) >= MAX_SPECIALIZATIONS:
                if not self._warned:
                    self._warned = True
                    warnings.warn(
                        f"torch.compile(backend='tpu'): {len(self.compiled)} shape specializations of one graph "
                        f"(MAX_SPECIALIZATIONS); further shapes run uncompiled. Pad inputs to a few fixed "
                        f"sizes to stay compiled.", RuntimeWarning, stacklevel=2)
                return self.gm(*args)
            fn = self.compiled[key] = _aot_compile(self.gm, list(args))
        return fn(*args)


def _symbolic_sizes_reach_compiled_ops(gm: torch.fx.GraphModule) -> bool:
    """Whether a node that would be compiled reads or makes a value of symbolic size. When
    none does, the symbolic sizes end at ops run as they are (custom ops: say, SparseCore's
    preprocessing of a KJT, whose ids per batch vary and whose buffers do not), so one
    compile serves every size."""
    def compiled(node: torch.fx.Node) -> bool:
        # Dynamo's graph calls tensor methods (x.sum()) and modules too: all compiled.
        return node.op in ("call_method", "call_module") or (node.op == "call_function" and inductor.compilable(node))

    return any(compiled(node) and inductor.reaches_symbolic_size(node) for node in gm.graph.nodes)


def _sizes_vary_in_ids_only(gm: torch.fx.GraphModule) -> bool:
    """Whether only flat inputs have symbolic sizes: a KJT's ids, weights and lengths, whose
    counts vary from batch to batch, while batch-shaped inputs (dense features: two or more
    dimensions) keep theirs. Read off the graph's inputs as traced: the example inputs
    Dynamo hands over are real tensors."""
    inputs = (n.meta.get("example_value") for n in gm.graph.nodes if n.op == "placeholder")
    return not any(isinstance(x, torch.Tensor) and x.dim() > 1 and inductor.is_symbolic(x) for x in inputs)


def tpu_backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Callable[..., Any]:
    """The Dynamo backend: AOTAutograd with Inductor-on-tpu for every graph."""
    if any(inductor.is_symbolic(x) for x in example_inputs) and _symbolic_sizes_reach_compiled_ops(gm):
        if _sizes_vary_in_ids_only(gm):
            # A compile per id count would be one per batch: the ops of those sizes (say,
            # position weights) run as they are, the rest compiles once (inductor.compile_graph).
            logger.info("graph with symbolic id counts: compiled once around their ops")
            return _aot_compile(gm, example_inputs, **kwargs)
        logger.info("graph with symbolic shapes: compiled per shape signature at first call")
        return ShapeSpecializations(gm)
    return _aot_compile(gm, example_inputs, **kwargs)
