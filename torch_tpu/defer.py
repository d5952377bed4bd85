"""DeferAndFuse: ops on tpu tensors are recorded, not run, and run later as
one graph - compiled by Inductor on tpu when that measures faster.

A recorded op's outputs are tpu tensors with their sizes, strides and dtype
and no memory (``torch.ops.torch_tpu._deferred_empty``); views of them share
their (empty) storage. The pending graph runs - is *materialized* - when
something needs real memory:

* an op that cannot be recorded reads or writes a pending tensor: copies to
  cpu, ``.item()``, printing, data-dependent shapes (nonzero, masks), random
  ops (they draw from the tpu generator, as in Strict), in-place ops on views;
* any op outside aten/prims but the graph ops (torch_tpu.graph_ops: the
  fused DLRM interaction) - collectives, the SparseCore kernels -, work
  submitted to a tpu stream, ``torch.tpu.synchronize()``, ``torch.tpu.mark_step()``;
* a graph of ``torch.compile(backend="tpu")``: it runs with the mode off, on
  real memory (``run_unrecorded``); Dynamo compiles with the mode off too;
* the materialization hooks (torch_tpu.materialization_hooks): ``torch.save``,
  ``Tensor.data_ptr``, ``Tensor.untyped_storage``, ``Tensor.numpy``, printing
  - and whatever an extension adds with ``register_materialization_hook``;
* ``MAX_OPS`` recorded ops, and the boundaries of repeating op sequences
  (training steps, layer stacks: see ``_Repeats``), so graphs recur and hit
  the cache.

Only the pending tensors someone still holds (Python, autograd's saved
tensors, a view) become graph outputs: intermediates nobody holds are never
allocated. In-place ops are recorded as their functional forms: a pending
tensor is re-bound to the new value, a real tensor (a parameter, an optimizer
state) gets the value written into it when the graph runs.

Graphs are cached by their op sequence, input shapes/dtypes/strides and scalar
arguments. A graph's first occurrences run op by op (exactly Strict's kernels)
while Inductor compiles it on a background thread; then it runs compiled or op
by op, whichever measured faster (torch_tpu.inductor.ChoosingRunner).

Recording itself costs time, so whether it pays is measured too: once a
*segment* - the ops from one materialization to the next, a training step,
say - recurs with its graph settled, its occurrences run recorded or eagerly
(Strict's kernels as the ops come, nothing recorded), whichever measured
faster (torch_tpu.defer_segments).

The recording is a dispatch mode, entered by ``set_eager_mode`` on the
setting thread; autograd's backward threads inherit it. The pending graph is
one per process, under a lock.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import weakref
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

from torch_tpu import deferred_graph, materialization_hooks
from torch_tpu.defer_segments import UNMATCHED, Segments
from torch_tpu.graph_breaks import hide_from_dynamo
from torch_tpu.graph_ops import is_graph_op
from torch_tpu.materialization_hooks import register_materialization_hook  # noqa: F401 - the public entry
from torch_tpu.deferred_graph import Arg, map_arg

logger = logging.getLogger(__name__)

aten = torch.ops.aten
_ops = torch.ops.torch_tpu
_deferred_empty = _ops._deferred_empty.default
MAX_OPS = 4096
# Host boundaries: materializations the host asks for outside any op, where a
# dormant segment can end (defer_segments).
SYNCHRONIZE = "torch.tpu.synchronize"
MARK_STEP = "torch.tpu.mark_step"
HOST_BOUNDARIES = frozenset([SYNCHRONIZE, MARK_STEP])
MAX_META_CACHE = 100_000
# Allocation only: run at once (nothing to fuse), like views of real memory.
ALLOCATIONS = frozenset([aten.empty.memory_format, aten.empty_strided.default])
# And ops that look functional but must see real memory, or whose result
# depends on more than their arguments.
NEVER_RECORDED = ALLOCATIONS | frozenset([aten._local_scalar_dense.default, aten.lift_fresh.default, aten.set_.source_Storage,
                            aten.set_.source_Storage_storage_offset, aten.set_.source_Tensor, aten.set_.default,
                            aten.resize_.default, aten.record_stream.default])

# Views that set a flag (conjugate, negative) rather than a geometry.
_FLAG_VIEWS = frozenset([aten._conj.default, aten._neg_view.default])
_Ref = tuple  # ("i", k): graph input k; ("v", n, j): output j of node n
# The C methods: torch.Tensor's may be materialization hooks.
_untyped_storage = torch._C.TensorBase.untyped_storage


def _scalar_key(x: Any) -> Any:
    """A non-tensor argument as a key part: Python takes 2 == 2.0 == True and 0.0 == -0.0,
    but they give different result dtypes or values, so floats, complexes and bools are
    keyed with their type (floats by their exact bits)."""
    t = type(x)
    if t is float:
        return (float, x.hex())
    if t is bool:
        return (bool, x)
    if t is complex:
        return (complex, x.real.hex(), x.imag.hex())
    return x


def _storage_id(t: torch.Tensor) -> int:
    return _untyped_storage(t)._cdata


@dataclass
class DeferStats:
    """What DeferAndFuse did since the last reset."""

    graphs: int = 0  # graphs materialized
    ops_recorded: int = 0
    compiled_runs: int = 0
    replayed_runs: int = 0
    eager_segments: int = 0  # segments run eagerly, recording nothing (torch_tpu.defer_segments)
    ops_run_eagerly: int = 0  # their ops
    # Ops on tpu memory that ran eagerly: the materialization points by design
    # (transfers, .item(), random and data-dependent ops, non-aten ops), and
    # the rest - ops recording could not take (its fallbacks).
    sync_points: Counter = field(default_factory=Counter)
    not_recorded: Counter = field(default_factory=Counter)
    materialized_by: Counter = field(default_factory=Counter)  # why graphs ran

    def ops_per_graph(self) -> float:
        return self.ops_recorded / self.graphs if self.graphs else 0.0

    def eager_share(self) -> float:
        """Of the segments (a graph each when recorded), the share run eagerly."""
        return self.eager_segments / max(self.graphs + self.eager_segments, 1)


@dataclass(slots=True)
class _Bound:
    tensor: torch.Tensor
    ref: _Ref
    kind: str  # "base": a pending tensor owning its storage; "view": on a base's storage; "write": a real tensor
    meta: tuple  # the tensor's _tensor_meta


def _tensor_meta(t: torch.Tensor) -> tuple:
    return (tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, "tpu" if t.get_device() >= 0 else t.device.type)


_dtype_codes: dict[torch.dtype, int] = {}


def _dtype_code(dtype: torch.dtype) -> int:
    """The ScalarType number ``_deferred_empty`` takes for ``dtype``."""
    code = _dtype_codes.get(dtype)
    if code is None:
        code = _dtype_codes[dtype] = _ops._dtype_code(dtype)
    return code


def _tpu_index(flat: list) -> tuple[int | None, bool, bool]:
    """The tpu device an op's outputs go to - its first tpu tensor's or tpu device
    argument's index (-1: the current device) or None when it involves no tpu
    memory - whether it names another device (a transfer off the tpu, or to
    another tpu: its output is on another device than the graph's values, so it
    runs on real memory), and whether it names the tpu without an index."""
    index, device, elsewhere, unindexed = None, None, False, False
    for a in flat:
        if isinstance(a, torch.Tensor):
            # get_device is cheap and -1 for cpu and meta: in torch's CPU build the
            # tpu is the only device with indices.
            if index is None:
                i = a.get_device()
                if i >= 0:
                    index = i
        elif isinstance(a, torch.device):
            if a.type != "tpu":
                elsewhere = True
            else:
                unindexed = unindexed or a.index is None
                if device is None:
                    device = -1 if a.index is None else a.index
    if device is None:
        return index, elsewhere, unindexed
    if index is None:
        return device, elsewhere, unindexed
    if device != index and (device >= 0 or torch.accelerator.current_device_index() != index):
        elsewhere = True
    return index, elsewhere, unindexed


def _device_indexed(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The arguments with ``tpu`` devices named by the current device's index: the graph
    may run under another current device (materialized in or out of a ``torch.tpu.device``
    block), where the op as recorded would put its output on another device than its
    pending tensor's. aten takes no lists of devices."""
    current = torch.device("tpu", torch.accelerator.current_device_index())

    def indexed(a: Any) -> Any:
        return current if type(a) is torch.device and a.type == "tpu" and a.index is None else a

    return tuple(indexed(a) for a in args), {k: indexed(v) for k, v in kwargs.items()}


def _meta_tensor(meta: tuple) -> torch.Tensor:
    shape, stride, offset, dtype, _ = meta
    size = offset + sum((s - 1) * st for s, st in zip(shape, stride)) + 1 if all(shape) else 0
    return torch.empty(max(size, 0), dtype=dtype, device="meta").as_strided(shape, stride, offset)


def _copy_unversioned(dst: torch.Tensor, value: torch.Tensor) -> None:
    """dst's memory gets value, through an alias with a version counter of its
    own: the op that made dst bumped dst's version when it was recorded (and
    autograd may hold dst for backward)."""
    alias = _ops._deferred_alias(dst, list(dst.shape), list(dst.stride()), dst.storage_offset())
    alias.copy_(value)


def _fill(targets: list[_Bound], values: list[torch.Tensor | None]) -> None:
    """Each target gets its value (None: none was computed, see deferred_graph.replay): a
    pending tensor its memory, a real tensor the value written in."""
    # A compiled graph may return one tensor for several outputs (two clones of a value):
    # _fill_deferred would hand its memory to the first, leaving none to copy.
    shared = {k for k, n in Counter(v._cdata for v in values if v is not None).items() if n > 1}
    for b, value in zip(targets, values):
        if value is None:
            continue
        if b.kind != "write" and value._cdata in shared:
            value = value.clone()  # memory of its own for this target
        if b.kind == "write" or _ops._fill_deferred(b.tensor, value):
            _copy_unversioned(b.tensor, value)


def _covers_storage(t: torch.Tensor) -> bool:
    """Whether `t` is its whole storage, densely from offset 0 (a parameter, say):
    then a view's storage offsets index its value."""
    return (t.storage_offset() == 0 and t.is_contiguous()
            and t.numel() * t.element_size() == _untyped_storage(t).nbytes())


def _functional_of(func: torch._ops.OpOverload) -> torch._ops.OpOverload | None:
    """``aten.add.Tensor`` for ``aten.add_.Tensor``; None without one."""
    name = func.overloadpacket.__name__
    if not name.endswith("_") or name.startswith("_") and not name.startswith("_foreach"):
        return None
    packet = getattr(aten, name[:-1], None)
    if packet is None or func._overloadname not in packet.overloads():
        return None
    return getattr(packet, func._overloadname)


def _mutated_args(func: torch._ops.OpOverload) -> list[int]:
    return [i for i, a in enumerate(func._schema.arguments) if a.alias_info is not None and a.alias_info.is_write]


@dataclass(frozen=True)
class _OpInfo:
    """What recording needs to know of an op, worked out once per op."""

    recordable: bool
    mutated: list[int]
    functional: torch._ops.OpOverload | None
    is_view: bool
    returns: str  # "one": a tensor; "list": Tensor[]; "tuple": several; "none"


_op_infos: dict[Any, _OpInfo] = {}


def _op_info(func) -> _OpInfo:
    info = _op_infos.get(func)
    if info is None:
        mutated = _mutated_args(func)
        functional = _functional_of(func) if mutated else None
        recordable = (func not in NEVER_RECORDED and is_graph_op(func)
                      and torch.Tag.nondeterministic_seeded not in func.tags
                      and torch.Tag.dynamic_output_shape not in func.tags
                      # unsqueeze_, t_, as_strided_...: they change the tensor's geometry, not its values
                      and not (functional is not None and functional.is_view))
        returns = func._schema.returns
        kind = ("none" if not returns else "tuple" if len(returns) > 1 else
                "list" if isinstance(returns[0].type, torch.ListType) else "one")
        info = _op_infos[func] = _OpInfo(recordable, mutated, functional, func.is_view, kind)
    return info


class _NotRecordable(Exception):
    """This op runs eagerly (materializing first if it touches pending tensors).
    ``by_design``: None (views of real memory, allocations: not counted),
    True (a materialization point) or False (a fallback)."""

    def __init__(self, by_design: bool | None = False) -> None:
        super().__init__()
        self.by_design = by_design


class _Graph:
    """The pending graph: recorded nodes, their inputs, the tensors bound to values."""

    def __init__(self) -> None:
        self.nodes: list[tuple[Any, list, dict]] = []  # (func, args, kwargs) with refs for tensors
        self.sigs: list[tuple] = []  # per node: (op, its arguments with tensors as (ref, meta)): the graph's key
        self.metas: list[list[tuple]] = []  # per node, its outputs' metas
        self.inputs: list[torch.Tensor] = []
        self.input_index: dict[int, int] = {}  # TensorImpl address -> input number
        self.input_metas: list[tuple] = []
        self.input_storages: Counter = Counter()  # StorageImpl address -> tpu inputs on it (a tensor and its views)
        self.bound: dict[int, _Bound] = {}  # TensorImpl address -> binding
        self.pending_storages: dict[int, int] = {}  # StorageImpl address -> TensorImpl address of its base
        self.write_storages: dict[int, int] = {}  # StorageImpl address -> TensorImpl address written
        self.views_of: dict[int, list[_Bound]] = {}  # pending StorageImpl address -> its bound views
        # Nodes that are in-place ops on real tensors, run in place (as issued)
        # when the graph runs: their outputs are those tensors.
        self.in_place: set[int] = set()
        # The threads that recorded them: their version bumps follow the recording,
        # outside the lock, so may land while another thread runs the graph.
        self.writers: set[int] = set()

    def empty(self) -> bool:
        return not self.nodes and not self.bound


class DeferAndFuse(TorchDispatchMode):
    """The recording dispatch mode (see the module docstring)."""

    def __init__(self, engine: _Engine) -> None:
        super().__init__()
        self.engine = engine

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # No _disable_dynamo wrapper: it costs microseconds on every op. Dynamo is
        # kept out of the mode's frames by hide_from_dynamo instead, at no cost per op.
        return False

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # torch.compile works under the mode: Dynamo compiles with every mode off (as
        # always), and the compiled graphs run as sync points (run_unrecorded). Were this
        # False, Dynamo would refuse to compile a function first called under the mode -
        # for good: it skips that code from then on, in Strict too.
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        engine = self.engine
        segments = engine.segments
        eager = segments.eager
        if eager is not None:
            # An eager segment's next op, as expected: the fast path (it costs the
            # segment about as much as the dispatch mode itself).
            if eager.ops[segments.pos] is func:
                with engine.lock:
                    if segments.eager is eager:  # not ended meanwhile by another thread
                        return engine.run_eagerly(func, args, kwargs or {})
            if func in UNMATCHED:
                return func(*args, **(kwargs or {}))
        return engine.dispatch(func, args, kwargs or {})


class _Engine:
    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.graph = _Graph()
        self.stats = DeferStats()
        self.meta_cache: dict[tuple, Any] = {}
        self.graphs = deferred_graph.GraphCache()
        self.repeats = _Repeats()
        self.segments = Segments(4 * MAX_OPS)
        self._holder_base = self._calibrate()
        # Pending tensors a failed graph left without values (see _salvage): TensorImpl
        # address -> (the tensor, weakly; why). Ops reading them say why, not "no memory yet".
        self.lost: dict[int, tuple[weakref.ref, str]] = {}

    @staticmethod
    def _calibrate() -> tuple[int, int, int]:
        """Python, TensorImpl and storage holders of a pending tensor only the graph holds."""
        t = _deferred_empty([1], [1], _dtype_code(torch.float32), -1)
        _storage_id(t)  # as _bind does: the storage's Python object then holds the storage too
        entry = _Bound(t, ("v", 0, 0), "base", ())
        del t
        impl, storage = _ops._holders([entry.tensor])
        return sys.getrefcount(entry.tensor), impl, storage

    # ---- dispatch ----

    def dispatch(self, func, args, kwargs):
        flat = _flat(args, kwargs)
        index, elsewhere, unindexed = _tpu_index(flat)
        if index is None:
            return func(*args, **kwargs)  # no tpu memory involved: nothing of the graph's to lock
        with self.lock:
            if self.lost:
                self._check_lost(flat)
            segments = self.segments
            if segments.eager is not None:
                if segments.advance_to(func):
                    return self.run_eagerly(func, args, kwargs)
                self._leave_eager_segment()
            segments.log_op(func)
            try:
                if unindexed:
                    return self._record(func, *_device_indexed(args, kwargs), index, elsewhere)
                return self._record(func, args, kwargs, index, elsewhere)
            except _NotRecordable as why:
                if why.by_design is not None:
                    counter = self.stats.sync_points if why.by_design else self.stats.not_recorded
                    counter[str(func)] += 1
                return self._eager(func, args, kwargs, flat)

    def _check_lost(self, flat: list) -> None:
        """Raises why, when an argument is a tensor a failed graph left without a value."""
        lost = self.lost
        for a in flat:
            entry = lost.get(a._cdata) if isinstance(a, torch.Tensor) else None
            if entry is not None and entry[0]() is a:
                raise RuntimeError(entry[1])
        for impl in [impl for impl, (ref, _) in lost.items() if ref() is None]:
            del lost[impl]  # freed: its address may be another tensor's now

    def run_eagerly(self, func, args, kwargs):
        """An op of a segment running eagerly: Strict's kernel on real memory."""
        try:
            out = func(*args, **kwargs)
        except BaseException:
            self._leave_eager_segment()
            raise
        self.stats.ops_run_eagerly += 1
        if self.segments.ran_eagerly():
            self.stats.eager_segments += 1
        return out

    def _leave_eager_segment(self) -> None:
        """Recording resumes mid-segment: the repeat detector's period, if any, is out of phase."""
        self.segments.diverged()
        self.repeats.forget()

    def _eager(self, func, args, kwargs, flat):
        if not self.graph.empty() and self._must_materialize_for(func, flat):
            self.materialize(str(func))
        return func(*args, **kwargs)

    def _must_materialize_for(self, func, flat) -> bool:
        if not is_graph_op(func):
            return True  # collectives, SparseCore kernels: sync points
        g = self.graph
        if any(isinstance(a, torch.Tensor) and self.touches(a) for a in flat):
            return True
        if _op_info(func).mutated:
            for a in flat:  # conservative: any mutable op over a tensor the graph reads
                if isinstance(a, torch.Tensor) and _storage_id(a) in g.input_storages:
                    return True
        return False

    # ---- recording ----

    def _record(self, func, args, kwargs, index: int, elsewhere: bool):
        """Records ``func`` with outputs on tpu device ``index``; ``elsewhere``: it names another device."""
        info = _op_info(func)
        if not info.recordable:
            raise _NotRecordable(None if func in ALLOCATIONS else True)
        if elsewhere:
            raise _NotRecordable(True)  # a transfer off the device
        if info.mutated:
            return self._record_in_place(func, args, kwargs, info)
        if info.is_view:
            self_arg = args[0] if args else None
            if not isinstance(self_arg, torch.Tensor):
                raise _NotRecordable
            if not self._is_pending(self_arg):
                if _storage_id(self_arg) in self.graph.write_storages:
                    return self._record_view_of_written(func, args, kwargs)
                raise _NotRecordable(None)  # a view of real memory: metadata only, run at once
        refs_args, refs_kwargs, sig, shapes = self._refs(func, args, kwargs)
        out_metas = self._out_metas(func, args, kwargs, shapes)
        if info.is_view and (func in _FLAG_VIEWS or any(m is not None and m[3] != args[0].dtype for m in out_metas)):
            # view(dtype), view_as_real/complex: other bytes per element on the same memory,
            # which a pending alias (the base's dtype) and as_strided cannot express; conj(),
            # _neg_view: a flag on the view the alias would not carry - a materialization
            # point: the view is taken on real memory.
            raise _NotRecordable(True)
        node = self._add_node(func, refs_args, refs_kwargs, out_metas, sig)
        outputs = []
        for j, meta in enumerate(out_metas):
            if meta is None:  # an optional output not asked for (convolution_backward's grad_bias, say)
                outputs.append(None)
                continue
            shape, stride, offset, dtype, _ = meta
            if info.is_view:
                t = _ops._deferred_alias(args[0], list(shape), list(stride), offset)
                self._bind(t, ("v", node, j), "view", meta)
            else:
                t = _deferred_empty(shape, stride, _dtype_code(dtype), index)
                self._bind(t, ("v", node, j), "base", meta)
            outputs.append(t)
        self._after_record()
        return outputs[0] if info.returns == "one" else outputs if info.returns == "list" else tuple(outputs)

    def _record_in_place(self, func, args, kwargs, info: _OpInfo):
        """An in-place op as its functional form: the targets are re-bound to the
        results. Writes to pending memory are functionalized (the base gets the
        written region scattered in, its views are re-derived); a real tensor
        gets its new value written when the graph runs."""
        functional = info.functional
        if functional is None or info.mutated != [0]:
            raise _NotRecordable
        targets = list(args[0]) if isinstance(args[0], (list, tuple)) else [args[0]]
        g = self.graph
        if any(not isinstance(t, torch.Tensor) or t.get_device() < 0 for t in targets):  # see _tpu_index
            raise _NotRecordable
        storages = [_storage_id(t) for t in targets]
        for t, storage in zip(targets, storages):
            if storage not in g.pending_storages and g.write_storages.get(storage, t._cdata) != t._cdata:
                raise _NotRecordable  # a second tensor writing the same real memory
            if storage in g.views_of and storage not in g.pending_storages and not _covers_storage(t):
                raise _NotRecordable
        # Writes to real memory whose every earlier write in the graph ran in
        # place run in place too: no second copy of the tensor, no copy back.
        # Not when another input reads the same memory (a view of a parameter, taken before
        # this write): a compiled graph takes its inputs as independent and could read that
        # view after the write; written functionally, the value is copied in after the graph.
        in_place = all(storage not in g.pending_storages and self._written_in_place(t)
                       and g.input_storages[storage] <= (t._cdata in g.input_index)
                       for t, storage in zip(targets, storages))
        op = func if in_place else functional
        refs_args, refs_kwargs, sig, shapes = self._refs(op, args, kwargs)
        out_metas = self._out_metas(functional, args, kwargs, shapes)
        if len(out_metas) != len(targets) or any(
                m is None or m[0] != tuple(t.shape) or m[3] != t.dtype for m, t in zip(out_metas, targets)):
            # A result of another shape or dtype: run eagerly, which casts or raises as Strict does.
            raise _NotRecordable
        node = self._add_node(op, refs_args, refs_kwargs, out_metas, sig)
        if in_place:
            g.in_place.add(node)
            g.writers.add(threading.get_ident())
        for j, (t, storage) in enumerate(zip(targets, storages)):
            if storage in g.pending_storages:
                self._write_pending(t, ("v", node, j))
            else:
                old = g.bound.get(t._cdata)
                self._bind(t, ("v", node, j), "write", old.meta if old is not None else _tensor_meta(t))
                self._rederive_views(storage, ("v", node, j))
        self._after_record()
        return None if info.returns == "none" else args[0]

    def _written_in_place(self, t: torch.Tensor) -> bool:
        bound = self.graph.bound.get(t._cdata)
        return bound is None or (bound.kind == "write" and bound.ref[1] in self.graph.in_place)

    def _record_view_of_written(self, func, args, kwargs):
        """A view of a real tensor whose new value is pending: a real view (it
        aliases that memory, which gets the value when the graph runs) that
        recorded ops read as the view of the pending value."""
        g = self.graph
        storage = _storage_id(args[0])
        written = g.bound[g.write_storages[storage]]
        if not _covers_storage(written.tensor):
            raise _NotRecordable
        view = func(*args, **kwargs)  # metadata only
        if not isinstance(view, torch.Tensor):
            raise _NotRecordable
        if view.dtype != written.tensor.dtype or view.is_conj() or view.is_neg():
            # a bitcast or a conjugate of the pending value: taken on real memory
            raise _NotRecordable(True)
        meta = _tensor_meta(view)
        self._bind(view, ("v", self._add_as_strided(written.ref, meta), 0), "written view", meta)
        return view

    def _rederive_views(self, storage: int, value: _Ref) -> None:
        """The views on `storage` re-bound to their regions of its new `value`."""
        for view in self.graph.views_of.get(storage, []):
            view.ref = ("v", self._add_as_strided(value, view.meta), 0)

    def _write_pending(self, t: torch.Tensor, value: _Ref) -> None:
        """`t` (on a pending storage) now holds `value`: its base and every view re-bound."""
        g = self.graph
        storage = _storage_id(t)
        base = g.bound[g.pending_storages[storage]]
        if t._cdata == base.tensor._cdata:
            base.ref = value
        else:
            shape, stride, offset = _tensor_meta(t)[:3]
            op = aten.as_strided_scatter.default
            node = self._add_node(op, [Arg(base.ref), Arg(value), list(shape), list(stride), offset], {},
                                  [base.meta], (op, base.ref, value, shape, stride, offset))
            base.ref = ("v", node, 0)
        self._rederive_views(storage, base.ref)

    def _is_pending(self, t: torch.Tensor) -> bool:
        g = self.graph
        bound = g.bound.get(t._cdata)
        return (bound is not None and bound.kind in ("base", "view")) or _storage_id(t) in g.pending_storages

    def _refs(self, func, args, kwargs):
        """args/kwargs with each tensor replaced by its Arg; the node's signature: the
        op, its arguments with tensors as (ref, meta); and the arguments with tensors as
        their metas only, which is all their output metas depend on."""
        sig: list = [func]
        shapes: list = []
        sig_append, shapes_append, ref = sig.append, shapes.append, self._ref  # on every argument of every op

        def leaf(x):
            if isinstance(x, torch.Tensor):
                r, meta = ref(x)
                sig_append((r, meta))
                shapes_append(meta)
                return Arg(r)
            key = _scalar_key(x)
            sig_append(key)
            shapes_append(key)
            return x

        def conv(x):  # aten nests at most a list inside the arguments
            t = type(x)
            if t is list or t is tuple:
                sig_append(len(x))
                shapes_append(len(x))
                return t([leaf(v) for v in x])
            return leaf(x)

        refs_args = [conv(a) for a in args]
        keys = tuple(kwargs)
        sig_append(keys)
        shapes_append(keys)
        refs_kwargs = {k: conv(v) for k, v in kwargs.items()} if kwargs else {}
        return refs_args, refs_kwargs, tuple(sig), tuple(shapes)

    def _ref(self, t: torch.Tensor) -> tuple[_Ref, tuple]:
        """The graph value `t` holds, and t's meta."""
        g = self.graph
        bound = g.bound.get(t._cdata)
        if bound is not None:
            return bound.ref, bound.meta
        storage = None
        if g.write_storages:
            # Memory with a pending write through another tensor: its reads (a graph input
            # read before the write included) see the written value, not the input's.
            storage = _storage_id(t)
            if storage in g.write_storages:
                return self._read_written(t, storage)
        k = g.input_index.get(t._cdata)
        if k is not None:
            return ("i", k), g.input_metas[k]
        if storage is None:
            storage = _storage_id(t)
        meta = _tensor_meta(t)
        if storage in g.pending_storages:
            # Another TensorImpl on a pending storage (autograd's unpacked saved
            # tensor, say): a strided view of its base's value.
            base = g.bound[g.pending_storages[storage]]
            if meta == base.meta:
                return base.ref, meta
            if meta[3] != base.meta[3]:
                raise _NotRecordable(True)  # another dtype on the same bytes: a bitcast, on real memory
            return ("v", self._add_as_strided(base.ref, meta), 0), meta
        on_tpu = meta[4] == "tpu"
        if not on_tpu and t.dim() != 0:
            raise _NotRecordable(True)  # cpu operands other than scalars: a transfer to the device
        k = len(g.inputs)
        if on_tpu:
            g.inputs.append(t)  # held: its address stays its own while the graph is pending
            g.input_index[t._cdata] = k
            g.input_storages[storage] += 1
        else:
            # A cpu scalar may change before the graph runs (a step count), or be freed and
            # its address taken by another: its value now, an input of its own at each read.
            g.inputs.append(t.clone())
        g.input_metas.append(meta)
        return ("i", k), meta

    def _read_written(self, t: torch.Tensor, storage: int) -> tuple[_Ref, tuple]:
        """A real tensor (not the one written) on memory with a pending write: bound, as a
        written view, to its region of the written value - when that value is the whole
        storage (or t's very region) in t's dtype; else the op runs on real memory, after
        the graph (it materializes: the storage has a pending write)."""
        g = self.graph
        written = g.bound[g.write_storages[storage]]
        meta = _tensor_meta(t)
        if meta == written.meta and t.is_conj() == written.tensor.is_conj() and t.is_neg() == written.tensor.is_neg():
            ref = written.ref
        elif meta[3] == written.meta[3] and _covers_storage(written.tensor) and not (t.is_conj() or t.is_neg()):
            ref = ("v", self._add_as_strided(written.ref, meta), 0)
        else:
            raise _NotRecordable
        self._bind(t, ref, "written view", meta)
        return ref, meta

    def _add_as_strided(self, source: _Ref, meta: tuple) -> int:
        """A node taking `meta`'s geometry of `source`'s value (storage offsets into it)."""
        shape, stride, offset = meta[:3]
        args = [Arg(source), list(shape), list(stride), offset]
        return self._add_node(aten.as_strided.default, args, {}, [meta], (aten.as_strided.default, source, meta))

    def _out_metas(self, func, args, kwargs, shapes: tuple) -> list[tuple]:
        """``func``'s output metas on arguments of these ``shapes`` (see _refs), cached."""
        key = (func, shapes)
        try:
            cached = self.meta_cache.get(key)
        except TypeError:  # an unhashable argument
            key, cached = None, None
        if cached is None:
            cached = self._compute_metas(func, args, kwargs)
            if key is not None:
                if len(self.meta_cache) >= MAX_META_CACHE:
                    self.meta_cache.clear()  # graphs that never recur: start over rather than grow
                self.meta_cache[key] = cached
        if cached is False:
            raise _NotRecordable
        return cached

    @staticmethod
    def _compute_metas(func, args, kwargs):
        def to_meta(a):
            if isinstance(a, torch.Tensor):
                return _meta_tensor(_tensor_meta(a))
            if isinstance(a, torch.device) and a.type == "tpu":
                return torch.device("meta")
            return a

        try:
            out = func(*[map_arg(a, to_meta) for a in args], **{k: map_arg(v, to_meta) for k, v in kwargs.items()})
        except Exception:  # no meta kernel, data-dependent shape, ...: run it for real
            return False
        leaves = out if isinstance(out, (list, tuple)) else [out]
        if not leaves or not all(isinstance(o, torch.Tensor) or o is None for o in leaves):
            return False
        return [None if o is None else (tuple(o.shape), o.stride(), o.storage_offset(), o.dtype, "tpu")
                for o in leaves]

    def _add_node(self, func, refs_args, refs_kwargs, out_metas, sig: tuple) -> int:
        g = self.graph
        n = len(g.nodes)
        g.nodes.append((func, refs_args, refs_kwargs))
        g.metas.append(out_metas)
        g.sigs.append(sig)
        self.stats.ops_recorded += 1
        return n

    def _bind(self, t: torch.Tensor, ref: _Ref, kind: str, meta: tuple) -> None:
        g = self.graph
        g.bound[t._cdata] = _Bound(t, ref, kind, meta)
        storage = _storage_id(t)
        if kind == "base":
            g.pending_storages[storage] = t._cdata
        elif kind in ("view", "written view"):
            g.views_of.setdefault(storage, []).append(g.bound[t._cdata])
        elif kind == "write":
            g.write_storages[storage] = t._cdata

    def _after_record(self) -> None:
        g = self.graph
        if len(g.nodes) >= MAX_OPS:
            self.materialize("size limit")
        elif self.repeats.at_boundary(g.nodes[-1][0]):
            self.materialize("repeat boundary")

    # ---- materialization ----

    def touches(self, t: torch.Tensor) -> bool:
        """Whether `t`'s memory is pending or has a pending write."""
        if t.get_device() < 0:  # see _tpu_index
            return False
        g = self.graph
        storage = _storage_id(t)
        return t._cdata in g.bound or storage in g.pending_storages or storage in g.write_storages

    def involves(self, t: torch.Tensor) -> bool:
        """Whether the pending graph reads `t`'s memory, or it is pending or has a pending write."""
        return self.touches(t) or (t.get_device() >= 0 and _storage_id(t) in self.graph.input_storages)

    def _holders(self, entries: list[_Bound]) -> dict[int, tuple[int, int]]:
        """TensorImpl address -> (TensorImpl holders, storage holders) of the entries' tensors, in one call."""
        tensors = [e.tensor for e in entries]
        counts = _ops._holders(tensors)
        del tensors  # its references would count as holders in _held
        return {e.tensor._cdata: (counts[2 * i], counts[2 * i + 1]) for i, e in enumerate(entries)}

    def _held(self, entry: _Bound, impl: int, own: int = 0) -> bool:
        """Whether anyone but the graph holds this tensor (Python or C++), given its
        TensorImpl's holders. `own`: references the graph itself makes (its views'
        autograd base)."""
        py_base, impl_base, _ = self._holder_base
        if impl > impl_base + own:
            return True
        # While C++ holds a TensorImpl, the TensorImpl holds its Python object.
        return sys.getrefcount(entry.tensor) > py_base + (impl > impl_base)

    def _alive(self, base: _Bound, graph: _Graph, holders: dict[int, tuple[int, int]]) -> bool:
        """A pending base is needed if it, one of its views, or any other tensor on its storage is held."""
        views = graph.views_of.get(_storage_id(base.tensor), [])
        impl, storage = holders[base.tensor._cdata]
        if self._held(base, impl, own=len(views)):  # a view's autograd data holds its base
            return True
        if storage > self._holder_base[2] + len(views):
            return True  # a TensorImpl the graph does not know shares the storage (a saved tensor)
        return any(self._held(v, holders[v.tensor._cdata][0]) for v in views)

    def materialize(self, reason: str = "materialize()") -> None:
        """Runs the pending graph; every pending tensor still held gets its value."""
        with self.lock:
            g = self.graph
            if g.empty():
                if reason not in HOST_BOUNDARIES and self.segments.ends_eagerly_at(reason):
                    self.stats.eager_segments += 1
                return
            self.graph = _Graph()
            self.repeats.flushed()
            holders = self._holders([b for b in g.bound.values() if b.kind in ("base", "view", "written view")])
            targets = [b for b in g.bound.values() if (b.kind == "write" and b.ref[1] not in g.in_place)
                       or (b.kind == "base" and self._alive(b, g, holders))]
            at_host_boundary = reason in HOST_BOUNDARIES
            if not targets and not g.in_place:
                self.segments.materialized(False, reason, at_host_boundary)
                return
            outputs = [b.ref for b in targets]
            self.stats.graphs += 1
            self.stats.materialized_by[reason] += 1
            errors: list[BaseException] = []
            with _no_dispatch_modes(), torch.no_grad():
                try:
                    values, compiled, settled, first_run = self.graphs.run(g, outputs, errors)
                except Exception as error:
                    self._salvage(g, targets, outputs, error)
                    raise
                if compiled:
                    self.stats.compiled_runs += 1
                else:
                    self.stats.replayed_runs += 1
                _fill(targets, values)
                del values
            if errors:
                # Run op by op, the graph went on past the failed op (see deferred_graph.replay):
                # the rest has Strict's values, its in-place updates ran once.
                self._interrupted()
                raise errors[0]
            self.segments.materialized(settled, reason, at_host_boundary, new_graph=first_run)

    def _interrupted(self) -> None:
        self.segments.interrupted()  # no segment's timing or plan spans a failed graph
        self.repeats.forget()

    def _salvage(self, g: _Graph, targets: list[_Bound], outputs: list[_Ref], error: Exception) -> None:
        """A recorded op failed as the graph's runner ran it (compiled, or op by op as its
        ChoosingRunner measures: both stop at the error; an index out of range, say: Strict
        would have raised at the op): the pending tensors that do not depend on it still get
        their values, as they would have in Strict. Only a graph without in-place nodes is run
        again for them: its first run wrote nothing; one with them may have written some of
        its real tensors already, and a second run would update them twice - its pending
        tensors keep no value, which the error says."""
        self._interrupted()
        if g.in_place:
            error.add_note(f"DeferAndFuse: this error stopped a graph of {len(g.nodes)} ops that "
                           "updates tensors in place; its pending tensors were left without values")
            why = (f"this tpu tensor has no value: the DeferAndFuse graph that was to compute it stopped at "
                   f"an error of one of its ops ({type(error).__name__}: {error}) after it had updated "
                   "tensors in place, so it could not be run again for the values the error spared")
            for b in targets:
                if b.kind == "base":
                    self.lost[b.tensor._cdata] = (weakref.ref(b.tensor), why)
            return
        _fill(targets, deferred_graph.replay(g, outputs, errors=[]))

    def host_boundary(self, reason: str, may_sleep: bool | None) -> bool:
        """A host boundary on the recording thread: counted, the pending graph run,
        then whether the segment to come (or still running) is dormant
        (Segments.after_host_boundary; ``may_sleep`` None: the thread is not
        where the mode can leave or come back, nothing changes)."""
        with self.lock:
            segments = self.segments
            segments.count_host_boundary(reason)
            self.materialize(reason)
            if may_sleep is None:
                return segments.dormant is not None
            sleep, ended = segments.after_host_boundary(may_sleep)
            for segment, dormant in ended:
                self.stats.eager_segments += 1
                if dormant:  # an eager segment's ops are counted as they run
                    self.stats.ops_run_eagerly += len(segment.ops)
            return sleep


class _Repeats:
    """Finds repeating op sequences and says where their boundaries fall.

    When the first ``WINDOW`` ops of the pending graph recur at least
    ``MIN_PERIOD`` ops later, the ops before the recurrence are a period (a
    training step without a sync point, a stack of large layers): the graph
    is materialized there, and from then on whenever a pending graph has
    matched the period op for op to its end. A mismatch forgets the period.
    Shorter periods (a stack of small layers) are not cut: graphs that small
    fuse too little.
    """

    WINDOW = 16
    MIN_PERIOD = 64

    def __init__(self) -> None:
        self.ops: list[Any] = []  # the ops of the pending graph, in order
        self.period: list[Any] | None = None
        self._cutting = False  # the next flush is the cut at_boundary asked for

    def at_boundary(self, op: Any) -> bool:
        """`op` was just recorded: whether the graph should be materialized now."""
        ops = self.ops
        ops.append(op)
        n = len(ops)
        if self.period is not None:
            p = self.period
            if n > len(p) or op != p[n - 1]:
                self.period = None
                return False
            self._cutting = n == len(p)
            return self._cutting
        w = self.WINDOW
        if n >= self.MIN_PERIOD + w and ops[n - w:] == ops[:w]:
            # Materialized now; the next graph starts w ops into the period.
            period = ops[:n - w]
            self.period = period[w:] + period[:w]
            self._cutting = True
            return True
        return False

    def forget(self) -> None:
        """The ops to come are not where the period left off (recording resumed mid-segment)."""
        self.ops, self.period, self._cutting = [], None, False

    def flushed(self) -> None:
        """A graph ran: unless it is the cut asked for, keep the period only if it ended on a boundary."""
        if self._cutting:
            self._cutting = False
        elif self.period is not None and len(self.ops) not in (0, len(self.period)):
            self.period = None
        self.ops = []


def _flat(args, kwargs) -> list:
    """The leaves of an op's arguments (aten nests at most a list inside them)."""
    leaves: list = []
    for x in (*args, *kwargs.values()):
        t = type(x)
        if t is list or t is tuple:
            leaves.extend(x)
        else:
            leaves.append(x)
    return leaves


@contextlib.contextmanager
def _no_dispatch_modes() -> Iterator[None]:
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        yield


# ---- the process-wide engine, the mode per thread, the hooks ----

_engine: _Engine | None = None
_engine_lock = threading.Lock()
_local = threading.local()


def engine() -> _Engine:
    global _engine
    with _engine_lock:
        if _engine is None:
            _engine = _Engine()
        return _engine


def materialize(reason: str = "materialize()") -> None:
    """Runs the pending graph, if any (a no-op outside DeferAndFuse). At a host
    boundary (``HOST_BOUNDARIES``) on the recording thread the mode also leaves
    or comes back for the segment to come (see defer_segments)."""
    if _engine is None:
        return
    mode = getattr(_local, "mode", None)
    if mode is None or reason not in HOST_BOUNDARIES:
        _engine.materialize(reason)
        return
    from torch.utils._python_dispatch import _get_current_dispatch_mode, _len_torch_dispatch_stack

    dormant = getattr(_local, "dormant_depth", None)  # the mode stack's depth when the mode left
    if dormant is not None:
        # The mode comes back only where it was: not while a mode entered since is active.
        may_sleep = True if _len_torch_dispatch_stack() == dormant else None
    else:  # it leaves only from the top of the stack: popping would otherwise take another mode
        may_sleep = _get_current_dispatch_mode() is mode
    sleep = _engine.host_boundary(reason, may_sleep)
    if may_sleep is None:
        return
    if sleep and dormant is None:
        mode.__exit__(None, None, None)
        _local.dormant_depth = _len_torch_dispatch_stack()
    elif not sleep and dormant is not None:
        _local.dormant_depth = None
        mode.__enter__()


def run_unrecorded(fn: Any, args: Any, reason: str) -> Any:
    """``fn(*args)`` - a compiled graph, whose kernels read and write memory without
    aten ops - as a sync point when DeferAndFuse is on this thread's dispatch stack
    (autograd's backward threads included): the pending graph is materialized, so the
    arguments are real, and ``fn`` runs with the dispatch modes off (all of them: a
    mode entered above DeferAndFuse does not see the graph's ops either), so its own
    ops run at once on real memory and its outputs are real tensors. Otherwise, or while
    the mode is dormant (nothing pending), just ``fn(*args)``."""
    if _engine is None or not any(isinstance(m, DeferAndFuse) for m in _get_current_dispatch_mode_stack()):
        return fn(*args)
    _engine.materialize(reason)
    with _no_dispatch_modes():
        return fn(*args)


# Inside its own ``__torch_dispatch__`` the mode is off the stack, so while a compiled
# function runs (the ops of a graph break, say) Dynamo would otherwise take the mode's
# Python for user code and trace it.
hide_from_dynamo(DeferAndFuse.__torch_dispatch__.__code__, materialize.__code__,
                 *materialization_hooks.wrapper_codes())


def stats() -> DeferStats:
    return engine().stats


def reset_stats() -> None:
    engine().stats = DeferStats()


def enter_on_this_thread() -> None:
    if getattr(_local, "mode", None) is None:
        eng = engine()
        materialization_hooks.install(eng.materialize, eng.touches, eng.involves)
        _local.mode = DeferAndFuse(eng)
        _local.mode.__enter__()


def leave_on_this_thread() -> None:
    mode = getattr(_local, "mode", None)
    if mode is None:
        return
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    dormant = getattr(_local, "dormant_depth", None) is not None  # the mode is off the stack already
    if not dormant and _get_current_dispatch_mode() is not mode:
        raise RuntimeError("cannot leave DeferAndFuse while a dispatch mode entered after it is active "
                           f"({type(_get_current_dispatch_mode()).__name__}); exit that mode first")
    try:
        materialize("leaving DeferAndFuse")  # may raise a recorded op's error: the mode is left all the same
        # Compiles still running in the background would overlap whatever runs
        # next (a torch.compile of its own): done before leaving.
        engine().graphs.wait_for_compiles()
    finally:
        _local.mode = None
        if dormant:
            _local.dormant_depth = None
        else:
            mode.__exit__(None, None, None)
        with _engine.lock:
            _engine.segments.interrupted()
        materialization_hooks.uninstall()


def on_this_thread() -> bool:
    """Whether DeferAndFuse is entered on this thread (recording or dormant)."""
    return getattr(_local, "mode", None) is not None
