"""Inductor on tpu: ATen graphs compiled by Inductor's CPU code generator and
run on zero-copy host views of tpu tensors.

Why not Inductor's own path for a registered device: on torch 2.13 the C++
code generator emits scalar loops for any device but "cpu" (``cpp.simdlen=0``
is required, vectorized codegen asserts), which loses to the vectorized CPU
kernels (``benchmarks/inductor_codegen.py`` measures both). A tpu tensor is
host memory, so a graph compiled for cpu runs on it unchanged:

* inputs enter as host views (``torch.ops.torch_tpu._host_views``: CPU tensors
  on the tpu storage, after the tpu stream's queued work);
* while it runs, CPU allocations on the thread come from the tpu allocator
  (``_redirect_host_allocations``), so buffers and outputs are tpu memory,
  counted in ``torch.tpu.memory_allocated``;
* outputs are re-tagged as tpu tensors (``_adopt_host_results``); an output
  that aliases an input comes back on the input's tpu storage.

A graph with no cpu outputs skips all three when its wrapper code allows: it
runs on the tpu tensors themselves, its buffers allocated as tpu tensors
(``torch_tpu.direct_run``), which saves about 150 us a step on a small-op
training step's three graphs.

Matmul-family nodes become ``torch.ops.torch_tpu.mxu_*``, the tpu kernels on
CPU tensors, so compiled matmuls give Strict's numbers at the precision set
when they run. Nodes a CPU compile cannot run with their tpu semantics -
custom ops (the SparseCore kernels, collectives), higher-order ops, an fp32
matmul-family op with no MXU counterpart here - run as they are, op by op on
tpu; the runs of other nodes between them are compiled (``compile_around``).
Each compiled graph keeps whichever of compiled and op by op measures faster
(``ChoosingRunner``).
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx

from torch_tpu import direct_run
from torch_tpu.compile_cache import compile_cache, graph_key
from torch_tpu.graph_ops import is_graph_op
from torch_tpu.host_norms import norms_at_fp32
from torch_tpu.scalar_hoisting import hoist_scalar_math
from torch_tpu.timed_choice import TimedChoice

logger = logging.getLogger(__name__)

aten = torch.ops.aten
_mxu = torch.ops.torch_tpu

# aten overload packet -> its MXU op (same arguments).
MXU_OPS: dict[Any, Any] = {
    aten.mm: _mxu.mxu_mm,
    aten.bmm: _mxu.mxu_bmm,
    aten.addmm: _mxu.mxu_addmm,
    aten.baddbmm: _mxu.mxu_baddbmm,
    aten.convolution: _mxu.mxu_convolution,
    aten.convolution_backward: _mxu.mxu_convolution_backward,
}
_MXU_TARGETS = frozenset(op.default for op in MXU_OPS.values())
# Matmul-family ops the tpu runs at MXU precision with no compiled counterpart
# here: a graph holding one (at fp32) runs op by op rather than exactly.
UNMAPPED_MXU_OPS = frozenset(
    [aten.mv, aten.dot, aten.addmv, aten.addbmm, aten._addmm_activation, aten.matmul, aten.linear,
     # In place into a real tensor, DeferAndFuse records these as they are (its in-place nodes).
     aten.addmm_, aten.baddbmm_, aten.addbmm_, aten.addmv_]
)


# ATen ops whose CPU kernels shape some outputs unlike their meta functions (the embedding
# bag's fast path returns an empty offset2bag, a mean bag an extra bag_size): a graph
# traced on tpu and compiled for cpu would hand its backward buffers of other shapes.
HOST_SHAPED_OPS = frozenset(
    [aten._embedding_bag, aten._embedding_bag_forward_only, aten._embedding_bag_backward,
     aten._embedding_bag_dense_backward, aten._embedding_bag_sparse_backward,
     aten._embedding_bag_per_sample_weights_backward]
)


class NotCompilable(RuntimeError):
    """The graph holds something the CPU compile cannot run with tpu semantics."""


def _host_device(value: Any) -> Any:
    if isinstance(value, torch.device) and value.type == "tpu":
        return torch.device("cpu")
    if isinstance(value, (list, tuple)):
        return type(value)(_host_device(v) for v in value)
    if isinstance(value, dict):
        return {k: _host_device(v) for k, v in value.items()}
    return value


def _is_fp32_mxu(node: torch.fx.Node) -> bool:
    values = [a.meta.get("val") for a in node.all_input_nodes]
    if any(v is None for v in values):
        return True  # dtype unknown: assume the MXU would round it
    return any(isinstance(v, torch.Tensor) and v.dtype == torch.float32 for v in values)


def _check_compilable(target: Any) -> None:
    """Custom ops (the SparseCore kernels, collectives) and higher-order ops
    (their functionalized forms) keep their own tpu semantics - executors,
    streams, in-place state - which a CPU compile of the graph does not:
    graphs holding them run op by op. Graph ops (torch_tpu.graph_ops) are
    compiled as extern calls of their CPU kernels."""
    if isinstance(target, torch._ops.HigherOrderOperator):
        raise NotCompilable(f"{target.name()}: a higher-order op")
    if isinstance(target, torch._ops.OpOverload) and not is_graph_op(target):
        raise NotCompilable(f"{target}: a custom op")
    if getattr(target, "overloadpacket", None) in HOST_SHAPED_OPS:
        raise NotCompilable(f"{target}: its cpu kernel's outputs are shaped unlike the tpu graph's")


def compilable(node: torch.fx.Node) -> bool:
    """Whether ``node`` would be compiled (in a run of such nodes), not run as it is."""
    try:
        _check_compilable(node.target)
    except NotCompilable:
        return False
    packet = getattr(node.target, "overloadpacket", None)
    return not (packet in UNMAPPED_MXU_OPS and _is_fp32_mxu(node))


def host_graph(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of an ATen graph for the CPU compiler: tpu devices become cpu,
    matmul-family nodes their MXU ops, reduced-precision normalizations keep the
    tpu's fp32 statistics (``torch_tpu.host_norms``), and 0-d math that large
    kernels read is computed once per call (``torch_tpu.scalar_hoisting``). Raises
    NotCompilable for an fp32 matmul-family op without an MXU op."""
    host = copy.deepcopy(gm)
    for node in host.graph.nodes:
        if node.op != "call_function":
            continue
        _check_compilable(node.target)
        node.args = _host_device(node.args)
        node.kwargs = _host_device(node.kwargs)
        packet = getattr(node.target, "overloadpacket", None)
        if packet in MXU_OPS and node.target._overloadname == "default":
            node.target = MXU_OPS[packet].default
        elif packet in UNMAPPED_MXU_OPS and _is_fp32_mxu(node):
            raise NotCompilable(f"{node.target} at fp32 has no MXU-precision op in compiled graphs")
    unfuse_bias_adds(host)
    norms_at_fp32(host)
    host.recompile()
    hoist_scalar_math(host)
    return host


def unfuse_bias_adds(gm: torch.fx.GraphModule) -> int:
    """Rewrites ``mxu_addmm(bias, a, b)`` as ``mxu_mm(a, b) + bias`` where a kernel that
    Inductor generates reads the result, so the add fuses into that kernel, as XLA fuses a
    dot's bias add into its consumer. The addmm kernel first broadcasts the bias into its
    whole output, then accumulates the GEMM onto it: a pass over the output for every
    Linear layer (on benchmarks.compile's small-op step, four 256 x 256 Linears, 0.12 ms
    of a 3.2 ms step). The sum is fp32 either way; only its order against the GEMM's
    blocks may differ, by an ulp. Returns how many addmms were rewritten."""
    rewritten = 0
    for node in list(gm.graph.nodes):
        if node.target is not _mxu.mxu_addmm.default or len(node.args) != 3:
            continue
        if node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1:
            continue
        if not any(u.op == "call_function" and u.target not in _MXU_TARGETS for u in node.users):
            continue  # no kernel to fuse the add into: it would be a pass of its own
        bias, a, b = node.args
        with gm.graph.inserting_before(node):
            product = gm.graph.call_function(_mxu.mxu_mm.default, (a, b))
        product.meta = dict(node.meta)
        node.target, node.args, node.kwargs = aten.add.Tensor, (product, bias), {}
        rewritten += 1
    return rewritten


def _host_example(t: Any) -> Any:
    """A CPU stand-in for an input (tpu, or meta: its shape only), which the compile reads the
    geometry of."""
    if isinstance(t, torch.Tensor) and t.device.type in ("tpu", "meta"):
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")
    return t


def compile_host(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], *,
                 size_asserts: bool = True) -> Callable[..., Any]:
    """Inductor's CPU compile of ``host_graph(gm)``, through the compile cache:
    a callable on CPU tensors. ``size_asserts=False``: its wrapper does not
    check its inputs' sizes and strides (the caller does: ``input_layouts``)."""
    host = host_graph(gm)
    examples = [_host_example(t) for t in example_inputs]
    with torch._inductor.config.patch(size_asserts=size_asserts):  # part of the key too
        key = graph_key(host, examples)
        return compile_cache().get(
            key, lambda: torch._inductor.standalone_compile(host, examples, dynamic_shapes="from_example_inputs")
        )


Layouts = tuple[tuple[int, tuple[int, ...], tuple[int, ...]], ...]


def input_layouts(example_inputs: Sequence[Any]) -> Layouts | None:
    """``(position, sizes, strides)`` of every tensor input, which a graph compiled for these
    inputs indexes its inputs by; None when some are symbolic (Inductor's wrapper then checks
    them itself)."""
    layouts = []
    for i, t in enumerate(example_inputs):
        if isinstance(t, torch.Tensor):
            if any(not isinstance(n, int) for n in (*t.shape, *t.stride())):
                return None
            layouts.append((i, tuple(t.shape), tuple(t.stride())))
    return tuple(layouts)


def _tpu_device(example_inputs: Sequence[Any]) -> int:
    for t in example_inputs:
        if isinstance(t, torch.Tensor) and t.device.type == "tpu":
            return t.device.index or 0
    return torch.tpu.current_device()


def _output_devices(gm: torch.fx.GraphModule) -> list[bool | None]:
    """For each output of the graph, whether it is a tpu tensor: True, False (a
    cpu tensor, or a node of unknown value), None (no tensor: a gradient that
    is not computed)."""
    (output,) = [n for n in gm.graph.nodes if n.op == "output"]
    flat = torch.utils._pytree.tree_leaves(output.args[0])
    vals = [n.meta.get("val") if isinstance(n, torch.fx.Node) else None for n in flat]
    return [None if not isinstance(n, torch.fx.Node) else isinstance(v, torch.Tensor) and v.device.type == "tpu"
            for n, v in zip(flat, vals)]


class HostRunner:
    """Runs a CPU-compiled graph on tpu tensors (see the module docstring).

    A step's graphs are called every step with the same argument kinds, and an
    optimizer's graph takes every parameter and state (a hundred tensors and
    more), so the per-call work is two ops over lists and no per-argument
    Python: which arguments are tensors and which outputs are tpu or cpu is
    worked out at the first call and kept."""

    def __init__(self, compiled: Callable[..., Any], device: int, tpu_outputs: Sequence[bool | None],
                 layouts: Layouts | None = None) -> None:
        """``tpu_outputs``: per output, whether it is a tpu tensor (None: not a tensor).
        ``layouts``: the inputs' sizes and strides (``input_layouts``), checked at every
        call in one builtin call, when ``compiled`` does not check them itself."""
        self.compiled = compiled
        self._layouts = layouts
        self._check_layouts = direct_run.layout_check()
        self.device = device
        self._num_outputs = len(tpu_outputs)
        self._tpu_slots = [i for i, tpu in enumerate(tpu_outputs) if tpu]
        self._other_slots = [i for i, tpu in enumerate(tpu_outputs) if not tpu]
        self._tensor_args: list[int] | None = None  # positions of the tensor arguments
        # A graph with no cpu outputs runs on the tpu tensors themselves when its
        # wrapper allows (torch_tpu.direct_run): the host views and adoption cost
        # more than a small graph's kernels.
        self.direct = False not in tpu_outputs and direct_run.prepare(compiled)
        self._enter_direct, self._exit_direct = direct_run.switches()

    def __call__(self, *args: Any) -> Any:
        if self._layouts is not None:
            self._check_layouts(args, self._layouts)
        if self.direct:
            previous = self._enter_direct(self.device)
            try:
                return self.compiled(*args)
            finally:
                self._exit_direct(previous)
        host_args = self._host_args(args)
        previous = torch.ops.torch_tpu._redirect_host_allocations(self.device)
        try:
            outputs = self.compiled(*host_args)
        finally:
            torch.ops.torch_tpu._redirect_host_allocations(previous)
        return self._adopt(outputs)

    def _host_args(self, args: tuple) -> list:
        if self._tensor_args is None:  # the first call: a graph's argument kinds never change
            self._tensor_args = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        if len(self._tensor_args) == len(args):
            return torch.ops.torch_tpu._host_views(args)
        # Some arguments are not tensors (symbolic sizes, scalars): they keep their places.
        views = torch.ops.torch_tpu._host_views([args[i] for i in self._tensor_args])
        host_args = list(args)
        for i, v in zip(self._tensor_args, views):
            host_args[i] = v
        return host_args

    def _adopt(self, outputs: Any) -> Any:
        flat_outputs = isinstance(outputs, (list, tuple)) and len(outputs) == self._num_outputs
        if flat_outputs:
            flat, spec = list(outputs), None
        else:
            flat, spec = torch.utils._pytree.tree_flatten(outputs)
        slots = [i for i in self._tpu_slots if isinstance(flat[i], torch.Tensor)]
        adopted = torch.ops.torch_tpu._adopt_host_results([flat[i] for i in slots], self.device)
        for i, t in zip(slots, adopted):
            flat[i] = t
        for i in self._other_slots:
            o = flat[i]
            if isinstance(o, torch.Tensor) and o.device.type == "cpu":
                flat[i] = o.clone()  # a cpu output: out of the tpu memory it was allocated in
        if spec is None:
            return type(outputs)(flat) if isinstance(outputs, tuple) else flat
        return torch.utils._pytree.tree_unflatten(flat, spec)


class ChoosingRunner(TimedChoice):
    """Runs a graph compiled or op by op, whichever measures faster (the
    policy is TimedChoice's: variant 0 compiled, 1 op by op; each timed call
    synchronizes the tpu around it). Both compute the same functional graph,
    so which ran is invisible to the caller."""

    def __init__(self, compiled: Callable[..., Any], replay: Callable[..., Any], name: str = "graph") -> None:
        super().__init__(name, ("compiled", "op by op"))
        self._variants = (compiled, replay)
        self.last_ran_compiled = False

    def __call__(self, *args: Any) -> Any:
        variant, timed = self.next()
        self.last_ran_compiled = variant == 0
        run = self._variants[variant]
        if not timed:
            return run(*args)
        torch.tpu.synchronize()
        start = time.perf_counter()
        out = run(*args)
        torch.tpu.synchronize()
        self.report(variant, time.perf_counter() - start)
        return out

    @property
    def runs_compiled(self) -> bool | None:
        """True/False once chosen; None while still measuring."""
        return None if self.chosen is None else self.chosen == 0


def compile_graph(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    *,
    choose: bool = True,
    tpu_outputs: Sequence[bool] | None = None,
    device: int | None = None,
) -> Callable[..., Any]:
    """A callable running the ATen graph ``gm`` on tpu tensors: Inductor-compiled
    for cpu and run on host views, or - when the graph cannot be compiled with
    tpu semantics or (``choose``) runs slower compiled - op by op on tpu.
    ``tpu_outputs`` says which outputs are tpu tensors (default: from the
    graph's node values). Only the inputs' geometry is read: ``example_inputs``
    may be meta tensors, with ``device`` the tpu they will be on (default: the
    tpu inputs')."""
    if _has_unbacked_sizes(gm):
        # Sizes known only from values (Dynamo's capture_dynamic_output_shape_ops /
        # capture_scalar_outputs): the host copy's compile cannot rebind them.
        logger.info("graph runs op by op: sizes that depend on tensor values")
        return gm
    # Inductor's wrapper would assert every input's sizes and strides with a Python call
    # each: 140 calls a step on a small-op training step's three graphs, 2% of its time.
    layouts = input_layouts(example_inputs)
    try:
        compiled = compile_host(gm, example_inputs, size_asserts=layouts is None)
    except NotCompilable as reason:
        split = compile_around(gm, choose)
        logger.info("graph %s: %s", "compiled around the ops that cannot be" if split is not None
                    else "runs op by op", reason)
        return gm if split is None else split
    outputs = _output_devices(gm) if tpu_outputs is None else list(tpu_outputs)
    runner = HostRunner(compiled, _tpu_device(example_inputs) if device is None else device, outputs, layouts)
    # A graph drawing random numbers stays with one variant: compiled and op by op draw
    # different streams, and alternating them would break a seed's reproducibility.
    return ChoosingRunner(runner, gm) if choose and not _draws_random_numbers(gm) else runner


def _draws_random_numbers(gm: torch.fx.GraphModule) -> bool:
    return any(isinstance(n.target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in n.target.tags
               for n in gm.graph.nodes if n.op == "call_function")


def _has_unbacked_sizes(gm: torch.fx.GraphModule) -> bool:
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    return any(free_unbacked_symbols(n.meta["val"]) for n in gm.graph.nodes if "val" in n.meta)


MIN_COMPILED_SEGMENT = 2  # ops: a lone op gains nothing from compiling


class _Compiled(torch.nn.Module):
    """A compiled segment where split_module put its submodule. split_module's caller
    takes a single output bare; the segment is compiled returning a 1-tuple (as compiled
    graphs, and so its op by op alternative, return sequences), unwrapped here."""

    def __init__(self, runner: Callable[..., Any], single_output: bool) -> None:
        super().__init__()
        self.runner = runner
        self.single_output = single_output

    def forward(self, *args: Any) -> Any:
        outputs = self.runner(*args)
        return outputs[0] if self.single_output else outputs


def reinplace_mutating_ops(gm: torch.fx.GraphModule) -> None:
    """Functionalized in-place custom ops (``auto_functionalized``: clone the inputs the op
    mutates, run it on the clones, copy the results back into the inputs at the end) become
    the in-place op itself wherever nothing reads the old values, as Inductor's post-grad
    passes do for the graphs it compiles. Run op by op they would otherwise copy every
    mutated input twice per call: for SparseCore's fused update, whole tables."""
    functionalized = (torch.ops.higher_order.auto_functionalized, torch.ops.higher_order.auto_functionalized_v2)
    if not any(n.target in functionalized for n in gm.graph.nodes):
        return
    from torch._inductor.fx_passes.post_grad import decompose_auto_functionalized
    from torch._inductor.fx_passes.reinplace import reinplace_inplaceable_ops
    from torch._inductor.fx_utils import FakeTensorUpdater

    reinplace_inplaceable_ops(FakeTensorUpdater(gm), gm.graph)
    decompose_auto_functionalized(gm.graph)
    for node in list(gm.graph.nodes):  # the copy-back epilogue, now from each input to itself
        if node.target is torch.ops.aten.copy_.default and node.args[0] is node.args[1] and not node.users:
            gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()


def compile_around(gm: torch.fx.GraphModule, choose: bool = True) -> torch.fx.GraphModule | None:
    """``gm`` split at the nodes that cannot be compiled with tpu semantics
    (custom ops, higher-order ops, unmapped fp32 matmuls): they run op by op,
    each run of compilable nodes between them is compiled. None when no run
    is worth compiling."""
    from torch.fx.passes.split_module import split_module

    reinplace_mutating_ops(gm)
    partition: dict[torch.fx.Node, int] = {}
    ops_of: dict[int, int] = {}  # partition -> its ops, for the compilable ones
    current, previous_ok = 0, None
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        ok = compilable(node)
        if not ok or previous_ok is not True:
            current += 1
        partition[node] = current
        if ok:
            ops_of[current] = ops_of.get(current, 0) + 1
        previous_ok = ok
    worth = {p for p, ops in ops_of.items() if ops >= MIN_COMPILED_SEGMENT}
    if not worth:
        return None
    split = split_module(gm, None, lambda node: partition[node], keep_original_order=True)
    for name, sub in list(split.named_children()):
        if int(name.rsplit("_", 1)[1]) not in worth:
            continue
        examples = [n.meta.get("val") for n in sub.graph.nodes if n.op == "placeholder"]
        if any(not isinstance(v, torch.Tensor) for v in examples):
            continue  # an input whose value tracing did not record: leave the segment op by op
        output = sub.graph.output_node()
        single = not isinstance(output.args[0], (tuple, list))
        if single:
            output.args = ((output.args[0],),)
            sub.recompile()
        setattr(split, name, _Compiled(compile_graph(sub, examples, choose=choose), single))
    return split
