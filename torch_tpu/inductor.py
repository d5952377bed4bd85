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

Both variants must give every tensor the next graph (a backward) reads the
sizes and strides the traced values record: it is compiled for them. Where a
tpu kernel disagrees with the value tracing gave it, the graphs are rewritten
first, for both: a convolution laid out channels_last is copied into the
traced layout (``conform_convolution_layouts``); an eval-mode batch norm's
saved statistics, empty, are left unread by its backward
(``drop_eval_batch_norm_statistics``). A graph runs on one tpu device: one whose
tensors are on several is compiled around the nodes that move between them. A
``with stream:`` block's ops run with the rest of the graph, after the streams'
queued work (``AfterStreams``).
"""

from __future__ import annotations

import copy
import logging
import operator
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch
import torch.fx

from torch_tpu import direct_run
from torch_tpu.compile_cache import compile_cache, graph_key, tensor_constants
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


# Batch norm backwards -> the position of their training flag (native_batch_norm_backward's
# train, batch_norm_backward's update) and of save_mean and save_invstd. In eval mode (the flag
# False) they read the running statistics, never the saved ones - which an eval-mode forward's
# CPU kernel, the tpu's, returns empty, where its meta function gives any device but cpu (C,)
# ones (the "inconsistency between devices" torch._decomp's native_batch_norm_helper notes).
BATCH_NORM_BACKWARDS: dict[Any, tuple[int, tuple[int, int]]] = {
    aten.native_batch_norm_backward.default: (7, (5, 6)),
    aten.batch_norm_backward.default: (7, (5, 6)),
}

# The convolutions of a tpu graph -> their MXU ops, whose Meta kernels lay the outputs out as
# the tpu kernels do (torch_tpu/csrc/TpuMxuOps.cpp).
CONVOLUTIONS: dict[Any, Any] = {
    aten.convolution.default: _mxu.mxu_convolution.default,
    aten.convolution_backward.default: _mxu.mxu_convolution_backward.default,
}

# Bumped when what a host graph compiles to changes while its code does not (the MXU ops' Meta
# kernels, which Inductor's own cache key does not cover): no cache tier, ours or Inductor's,
# then hands back an entry compiled before.
HOST_COMPILE_REVISION = 3


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
    """Whether ``node`` would be compiled (in a run of such nodes), not run as it is. A node
    moving a tensor between tpu devices is not: a compiled graph runs on one device."""
    return _compilable_op(node) and len(node_devices(node)) <= 1


def _compilable_op(node: torch.fx.Node) -> bool:
    """``compilable`` but for the devices."""
    try:
        _check_compilable(node.target)
    except NotCompilable:
        return False
    packet = getattr(node.target, "overloadpacket", None)
    return not (packet in UNMAPPED_MXU_OPS and _is_fp32_mxu(node))


def shape_of(x: Any) -> Any:
    """A tensor's geometry without its memory (a meta tensor); other values as they are."""
    if isinstance(x, torch.Tensor):
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
    return x


def is_symbolic(value: Any) -> bool:
    """Whether ``value`` is a symbolic size or a tensor with one in its sizes or strides."""
    if isinstance(value, torch.SymInt):
        return True
    return isinstance(value, torch.Tensor) and any(isinstance(s, torch.SymInt) for s in (*value.shape,
                                                                                         *value.stride()))


def reaches_symbolic_size(node: torch.fx.Node) -> bool:
    """Whether ``node`` reads or makes a value of symbolic size (Dynamo's graphs record
    values as ``example_value``, AOTAutograd's as ``val``)."""
    return any(is_symbolic(n.meta.get("example_value", n.meta.get("val"))) for n in (node, *node.all_input_nodes))


def _tpu_indices(value: Any) -> set[int]:
    """The tpu devices of the tensors and devices in ``value`` (nested); a tpu device without
    an index is the current one, as a factory given it would use."""
    found = set()
    for leaf in torch.utils._pytree.tree_leaves(value):
        device = leaf.device if isinstance(leaf, torch.Tensor) else leaf
        if isinstance(device, torch.device) and device.type == "tpu":
            found.add(torch.tpu.current_device() if device.index is None else device.index)
    return found


def node_devices(node: torch.fx.Node) -> frozenset[int]:
    """The tpu devices a node reads, makes or names: its inputs' and its own traced values,
    its device arguments."""
    values = [node.meta.get("val")]
    for leaf in torch.utils._pytree.tree_leaves((node.args, node.kwargs)):
        values.append(leaf.meta.get("val") if isinstance(leaf, torch.fx.Node) else leaf)
    return frozenset(_tpu_indices(values))


def _graph_devices(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], device: int | None) -> set[int]:
    """The tpu devices of ``gm``'s tensors (inputs, traced values, device arguments) and ``device``."""
    found = _tpu_indices(list(example_inputs))
    for node in gm.graph.nodes:
        if node.op == "call_function":
            found |= node_devices(node)
    if device is not None:
        found.add(device)
    return found


def graph_device(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], device: int | None = None) -> int:
    """The tpu device a compiled ``gm`` runs on and adopts its results onto: the one its tensors
    are on (inputs, traced values, device arguments), else ``device``, else the current one.
    Raises NotCompilable for a graph on several tpu devices, or on another than ``device``:
    compiled for cpu, it would hand back every result on the one device."""
    found = _graph_devices(gm, example_inputs, device)
    if len(found) > 1:
        raise NotCompilable(f"tensors on tpu devices {sorted(found)}: a compiled graph runs on one")
    return found.pop() if found else torch.tpu.current_device()


def _constants_to_host(gm: torch.fx.GraphModule) -> None:
    """tpu tensor constants become CPU copies: the CPU compile traces the graph with CPU
    example inputs, and a tpu constant met there failed it on a device mismatch."""
    for target, value in tensor_constants(gm).items():
        if value.device.type == "tpu":
            owner, _, name = target.rpartition(".")
            setattr(gm.get_submodule(owner) if owner else gm, name, value.cpu())


def host_graph(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of an ATen graph for the CPU compiler: tpu devices and tensor constants
    become cpu ones, matmul-family nodes their MXU ops, reduced-precision normalizations keep the
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
    _constants_to_host(host)
    norms_at_fp32(host)
    host.recompile()
    hoist_scalar_math(host)
    return host


def drop_eval_batch_norm_statistics(gm: torch.fx.GraphModule) -> int:
    """An eval-mode batch norm backward's save_mean and save_invstd arguments become None: it
    reads the running statistics instead (ATen's kernels and decompositions alike). A graph
    traced on tpu records the saved statistics as (C,), but the forward - op by op or
    compiled for cpu - makes them empty, so a backward reading them would be handed other
    sizes than it was compiled for; not read, they are not checked either (``input_layouts``).
    Rewrites ``gm`` in place; returns how many backwards it rewrote."""
    rewritten = 0
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in BATCH_NORM_BACKWARDS:
            continue
        flag, saved = BATCH_NORM_BACKWARDS[node.target]
        if len(node.args) <= flag or node.args[flag] is not False or all(node.args[i] is None for i in saved):
            continue
        node.args = tuple(None if i in saved else a for i, a in enumerate(node.args))
        rewritten += 1
    if rewritten:
        gm.graph.lint()
        gm.recompile()
    return rewritten


def conform_convolution_layouts(gm: torch.fx.GraphModule) -> int:
    """Each convolution output of ``gm`` laid out by the tpu kernel unlike its traced value
    gets copied into the traced layout where it is made. The tpu's convolutions are ATen's
    CPU ones on host views, channels_last when the input or the weight is; tracing picks the
    format by the device's convolution backend, and an out-of-tree device's gets contiguous
    (FakeTensor's conv rule; meta tensors the same). The traced layout is the one the graph's
    readers were compiled for - the backward's inputs - so both variants must give it.
    Rewrites ``gm`` in place; returns how many outputs it copied."""
    graph = gm.graph
    conformed = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in CONVOLUTIONS:
            continue
        laid_out = _kernel_layouts(node)
        if laid_out is None:
            continue
        for index, made in _convolution_results(node):
            traced, actual = made.meta.get("val"), laid_out[index]
            if not isinstance(traced, torch.Tensor) or actual is None or _same_layout(traced, actual):
                continue
            layout = _memory_format(traced)
            if layout is None:
                logger.warning("%s: traced strides %s are no memory format to copy into; the kernel makes %s",
                               made, traced.stride(), actual.stride())
                continue
            with graph.inserting_after(made):
                copied = graph.call_function(aten.clone.default, (made,), {"memory_format": layout})
            made.replace_all_uses_with(copied, delete_user_cb=lambda user: user is not copied)
            copied.meta["val"] = traced
            made.meta["val"] = _restrided(traced, actual.stride())
            if made is not node:  # a backward's getitem: its tuple of values too
                node.meta["val"] = tuple(made.meta["val"] if i == index else v for i, v in enumerate(node.meta["val"]))
            conformed += 1
    if conformed:
        graph.lint()
        gm.recompile()
    return conformed


def _convolution_results(node: torch.fx.Node) -> list[tuple[int, torch.fx.Node]]:
    """(output index, the node holding it): a convolution itself; a convolution backward's
    getitems."""
    if node.target is aten.convolution.default:
        return [(0, node)]
    return [(u.args[1], u) for u in node.users if u.target is operator.getitem]


def _kernel_layouts(node: torch.fx.Node) -> list[torch.Tensor | None] | None:
    """Meta tensors laid out as the tpu kernel lays out ``node``'s outputs (its MXU op's Meta
    kernel on the traced inputs); None when some input's geometry is unknown or symbolic."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    def meta(value: Any) -> Any:
        if not isinstance(value, torch.fx.Node):
            return value
        traced = value.meta.get("val")
        if not isinstance(traced, torch.Tensor) or is_symbolic(traced):
            raise LookupError(value)
        return shape_of(traced)

    try:
        args, kwargs = torch.fx.node.map_aggregate((node.args, node.kwargs), meta)
    except LookupError:
        return None
    try:
        with unset_fake_temporarily():
            outputs = CONVOLUTIONS[node.target](*args, **kwargs)
    except RuntimeError as error:  # arguments the op rejects: the node itself will say so when it runs
        logger.debug("%s: no layout from its MXU op's Meta kernel: %s", node, error)
        return None
    return list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same sizes, and strides on every dimension longer than 1 (as the layout checks have it)."""
    return a.shape == b.shape and all(n == 1 or x == y for n, x, y in zip(a.shape, a.stride(), b.stride()))


def _memory_format(t: torch.Tensor) -> torch.memory_format | None:
    formats = {4: torch.channels_last, 5: torch.channels_last_3d}
    if t.is_contiguous():
        return torch.contiguous_format
    if t.dim() in formats and t.is_contiguous(memory_format=formats[t.dim()]):
        return formats[t.dim()]
    return None


def _restrided(t: torch.Tensor, stride: tuple[int, ...]) -> torch.Tensor:
    """A value like ``t`` (fake or meta) with these strides."""
    from torch._subclasses.fake_tensor import FakeTensor

    def make() -> torch.Tensor:
        return torch.empty_strided(t.shape, stride, dtype=t.dtype, device=t.device)

    if isinstance(t, FakeTensor):
        with t.fake_mode:
            return make()
    return make()


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
    tag = _cache_key_tag()
    # size_asserts is part of our key (Inductor's configuration), the tag of Inductor's caches too.
    with torch._inductor.config.patch(size_asserts=size_asserts), torch.compiler.config.patch(cache_key_tag=tag):
        key = graph_key(host, examples, salt=tag)
        # A saved artifact loses the graph's tensor constants (torch 2.13's CompiledArtifact:
        # loaded, its wrapper fails on them), so such a graph stays in the in-process tier.
        return compile_cache().get(
            key, lambda: torch._inductor.standalone_compile(host, examples, dynamic_shapes="from_example_inputs"),
            persist=not tensor_constants(host),
        )


def _cache_key_tag() -> str:
    """torch.compiler's cache key tag (the user's, if any) with our HOST_COMPILE_REVISION."""
    ours = f"torch_tpu-host-r{HOST_COMPILE_REVISION}"
    theirs = torch.compiler.config.cache_key_tag
    return f"{theirs}+{ours}" if theirs else ours


Layouts = tuple[tuple[int, tuple[int, ...], tuple[int, ...]], ...]


def input_layouts(example_inputs: Sequence[Any], unread: Collection[int] = ()) -> Layouts | None:
    """``(position, sizes, strides)`` of every tensor input, which a graph compiled for these
    inputs indexes its inputs by, but those at the ``unread`` positions (the graph never reads
    them: their layouts do not matter); None when some are symbolic (Inductor's wrapper then
    checks them itself)."""
    layouts = []
    for i, t in enumerate(example_inputs):
        if isinstance(t, torch.Tensor) and i not in unread:
            if is_symbolic(t):
                return None
            layouts.append((i, tuple(t.shape), tuple(t.stride())))
    return tuple(layouts)


def _unread_inputs(gm: torch.fx.GraphModule) -> frozenset[int]:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return frozenset(i for i, p in enumerate(placeholders) if not p.users)


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
        cpu = [i for i in self._other_slots if isinstance(flat[i], torch.Tensor) and flat[i].device.type == "cpu"]
        for i, t in zip(cpu, _copied_out([flat[i] for i in cpu])):
            flat[i] = t
        if spec is None:
            return type(outputs)(flat) if isinstance(outputs, tuple) else flat
        return torch.utils._pytree.tree_unflatten(flat, spec)


def _copied_out(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """CPU outputs, out of the tpu memory they were allocated in, as the graph made them: each
    storage is copied once and every output over it is the same view of the copy, so outputs
    that alias one another still do, with their strides and offsets (a clone apiece made
    copies of views and materialized expands)."""
    copies: dict[int, torch.UntypedStorage] = {}
    out = []
    for t in tensors:
        storage = t.untyped_storage()
        copy = copies.get(storage.data_ptr())
        if copy is None:
            copy = copies[storage.data_ptr()] = storage.clone()
        out.append(torch.empty(0, dtype=t.dtype).set_(copy, t.storage_offset(), t.size(), t.stride()))
    return out


class ChoosingRunner(TimedChoice):
    """Runs a graph compiled or op by op, whichever measures faster (the
    policy is TimedChoice's: variant 0 compiled, 1 op by op; each timed call
    synchronizes the tpu around it). Both compute the same functional graph,
    to rounding: fused kernels round differently from ATen's, so while the
    choice is measured the same inputs may give results a few ulps apart, and
    which variant a run settles on follows its timings. Under
    ``torch.use_deterministic_algorithms(True)`` the graph always runs
    compiled, so a call's results never depend on timings."""

    def __init__(self, compiled: Callable[..., Any], replay: Callable[..., Any], name: str = "graph") -> None:
        super().__init__(name, ("compiled", "op by op"))
        self._variants = (compiled, replay)
        self.last_ran_compiled = False

    def __call__(self, *args: Any) -> Any:
        if torch.are_deterministic_algorithms_enabled():
            self.last_ran_compiled = True
            return self._variants[0](*args)
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
    one the graph's tensors are on, ``graph_device``). Rewrites ``gm`` in place
    where tpu kernels would make tensors unlike its traced values (both
    variants run it)."""
    if take_stream_annotations(gm):
        runner = compile_graph(gm, example_inputs, choose=choose, tpu_outputs=tpu_outputs, device=device)
        return AfterStreams(runner, _stream_devices(gm, example_inputs, device))
    # Both variants run ``gm``'s nodes: it must make the tensors its values record first.
    drop_eval_batch_norm_statistics(gm)
    conform_convolution_layouts(gm)
    if _has_unbacked_sizes(gm):
        # Sizes known only from values (Dynamo's capture_dynamic_output_shape_ops /
        # capture_scalar_outputs): the host copy's compile cannot rebind them.
        logger.info("graph runs op by op: sizes that depend on tensor values")
        return gm
    if any(reaches_symbolic_size(n) for n in gm.graph.nodes if n.op == "call_function"):
        # Compiles are for static shapes (torch_tpu.compile_backend hands over symbolic
        # graphs only when their symbolic sizes are ids counts): the ops of those sizes
        # run as they are, the rest is compiled once for every size.
        return _around(gm, choose, "symbolic sizes")
    # Inductor's wrapper would assert every input's sizes and strides with a Python call
    # each: 140 calls a step on a small-op training step's three graphs, 2% of its time.
    layouts = input_layouts(example_inputs, _unread_inputs(gm))
    try:
        runs_on = graph_device(gm, example_inputs, device)
        compiled = compile_host(gm, example_inputs, size_asserts=layouts is None)
    except NotCompilable as reason:
        return _around(gm, choose, reason)
    outputs = _output_devices(gm) if tpu_outputs is None else list(tpu_outputs)
    runner = HostRunner(compiled, runs_on, outputs, layouts)
    # A graph drawing random numbers stays with one variant: compiled and op by op draw
    # different streams, and alternating them would break a seed's reproducibility.
    return ChoosingRunner(runner, gm) if choose and not _draws_random_numbers(gm) else runner


def _around(gm: torch.fx.GraphModule, choose: bool, reason: object) -> torch.fx.GraphModule:
    """``gm`` compiled around the ops that cannot be (``reason``), or as it is, op by op."""
    split = compile_around(gm, choose)
    logger.info("graph %s: %s", "compiled around the ops that cannot be" if split is not None
                else "runs op by op", reason)
    return gm if split is None else split


def take_stream_annotations(gm: torch.fx.GraphModule) -> bool:
    """Removes the stream annotations Dynamo puts on the nodes of a ``with stream:`` block
    (``meta["custom"]["stream"]``); returns whether there were any. Inductor would compile
    them into ``with streamN:`` blocks, whose stream objects only its device-guarded
    (GPU) wrapper declares: the CPU compile referred to undefined names."""
    found = False
    for node in gm.graph.nodes:
        custom = node.meta.get("custom")
        if isinstance(custom, dict) and "stream" in custom:
            del custom["stream"]
            if not custom:
                del node.meta["custom"]
            found = True
    return found


def _stream_devices(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], device: int | None) -> list[int]:
    """The tpu devices whose streams a graph's stream blocks may be on: its tensors' devices."""
    return sorted(_graph_devices(gm, example_inputs, device)) or [torch.tpu.current_device()]


class AfterStreams:
    """Runs a graph holding ``with stream:`` blocks after the work queued on every stream of
    its devices. On tpu, ops on a stream run on the calling thread once that stream's queued
    work is done: a graph runs all of its ops on the calling thread, and waiting for every
    stream at its start (work cannot be queued while it runs) orders the block's ops after
    their stream's work, as eager does, whichever stream the block names."""

    def __init__(self, runner: Callable[..., Any], devices: Sequence[int]) -> None:
        self.runner = runner
        self.devices = list(devices)

    def __call__(self, *args: Any) -> Any:
        for index in self.devices:
            torch.accelerator.synchronize(index)
        return self.runner(*args)


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
    (custom ops, higher-order ops, unmapped fp32 matmuls, moves between tpu
    devices) or for static shapes (symbolic sizes): they run op by op, each run
    of compilable nodes between them on one tpu device is compiled. None when
    no run is worth compiling."""
    from torch.fx.passes.split_module import split_module

    reinplace_mutating_ops(gm)
    partition: dict[torch.fx.Node, int] = {}
    ops_of: dict[int, int] = {}  # partition -> its ops, for the compilable ones
    current, previous_ok, device = 0, None, None  # device: the current run's tpu device, once known
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        devices = node_devices(node)
        # compilable(node), its devices read once, and of static sizes
        ok = _compilable_op(node) and len(devices) <= 1 and not reaches_symbolic_size(node)
        moved = bool(devices) and device is not None and devices != {device}
        if not ok or previous_ok is not True or moved:
            current, device = current + 1, None
        partition[node] = current
        if ok:
            ops_of[current] = ops_of.get(current, 0) + 1
            device = next(iter(devices), device)
        previous_ok = ok
    worth = {p for p, ops in ops_of.items() if ops >= MIN_COMPILED_SEGMENT}
    if not worth or list(ops_of.values()) == [len(partition)]:
        return None  # nothing to compile; or one run of every node, which would be this graph again
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
