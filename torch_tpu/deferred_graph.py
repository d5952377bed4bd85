"""Running DeferAndFuse's pending graphs: op by op, or compiled.

A graph is keyed by its nodes (ops, scalar arguments, which value feeds
which), its inputs' shapes, strides and dtypes and the values it must
return. Until it is compiled a graph replays its ops one by one - the kernels
Strict runs, freeing each value after its last use. Its second run hands it to
a background thread that compiles it (torch_tpu.inductor, through the compile
cache); once compiled, its runs go through its ChoosingRunner: compiled or op
by op, whichever measured faster. Nodes recorded from in-place updates of real
tensors (graph.in_place: parameters, optimizer state) write those tensors in
place either way - the compiled graph as input mutations - so no second copy
of them is made.

Scalar arguments are part of the key, so a graph whose scalars change every
step (an optimizer's bias corrections computed on the host) never recurs and
is never compiled: keep such values in tensors - ``capturable=True``
optimizers, a tensor lr - as on XLA, or let its segment run eagerly, as
DeferAndFuse chooses when recording it does not pay (torch_tpu.defer_segments).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import operator
import os
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from torch_tpu import threads

logger = logging.getLogger(__name__)

COMPILE_VARIABLE = "TORCH_TPU_DEFER_COMPILE"
COMPILE_MODES = ("async", "sync", "off")
MIN_COMPILED_OPS = 2  # a graph of one op gains nothing from compiling
# Graphs are compiled when they recur (their second run): a graph that runs
# once - a first step that creates optimizer state, a one-off - is not worth it.
COMPILE_AT_RUN = 2
# In-place copies into real tensors: Inductor gets a graph wrong that copies a value read
# from an input into another and then updates that input in place (see copies_an_updated_source).
COPY_OPS = frozenset([torch.ops.aten.copy_.default, torch.ops.aten._foreach_copy_.default])
# Graphs that ran once are forgotten past this many (a loop whose graphs never
# recur would otherwise grow the cache without end), with one warning.
MAX_ONE_OFF_GRAPHS = 1000


class Arg:
    """A tensor argument of a recorded op: the graph value it refers to."""

    __slots__ = ("ref",)

    def __init__(self, ref: tuple) -> None:
        self.ref = ref  # ("i", k): graph input k; ("v", n, j): output j of node n


def map_arg(x: Any, fn) -> Any:
    """An op argument with its leaves mapped by `fn`: aten arguments nest at
    most a list (Tensor[], Tensor?[], int[]) inside the argument list."""
    t = type(x)
    if t is list or t is tuple:
        return t([fn(v) for v in x])
    return fn(x)


def arg_refs(args: list, kwargs: dict) -> list[tuple]:
    """The refs a node's arguments hold (see _resolve for the nesting)."""
    refs: list[tuple] = []
    for x in (*args, *kwargs.values()):
        t = type(x)
        if t is Arg:
            refs.append(x.ref)
        elif t is list or t is tuple:
            refs.extend(v.ref for v in x if type(v) is Arg)
    return refs


def graph_key(graph: Any, outputs: list[tuple]) -> tuple:
    # The nodes' signatures hold every input's meta where it is used.
    return (tuple(graph.sigs), tuple(outputs))


def _resolve(x: Any, value) -> Any:
    """An argument with its Args replaced by values (map_arg, inlined: it is
    on every op of an op-by-op run)."""
    t = type(x)
    if t is Arg:
        return value(x.ref)
    if t is list or t is tuple:
        return t([value(v.ref) if type(v) is Arg else v for v in x])
    return x


@dataclass(frozen=True)
class Liveness:
    """Which values each node reads and the last node to read each: the same for every run
    of a graph (its key holds its references)."""

    node_refs: list[list[tuple]]
    last_use: dict[tuple, int]

    @classmethod
    def of(cls, graph: Any) -> Liveness:
        node_refs = [arg_refs(args, kwargs) for _, args, kwargs in graph.nodes]
        last_use: dict[tuple, int] = {}
        for n, refs in enumerate(node_refs):
            for r in refs:
                last_use[r] = n
        return cls(node_refs, last_use)


def replay(graph: Any, outputs: list[tuple], liveness: Liveness | None = None,
           errors: list[BaseException] | None = None,
           inputs: list[torch.Tensor] | None = None) -> list[torch.Tensor | None]:
    """The graph's ops run one by one on tpu; values freed after their last use.

    ``errors`` (a list): an op that raises does not stop the run; its error is appended,
    and the values it and the ops reading it would make are None, the others computed.
    ``inputs``: the tensors to read for graph.inputs (default: those)."""
    liveness = liveness or Liveness.of(graph)
    node_refs, last_use = liveness.node_refs, liveness.last_use
    keep = set(outputs)
    env: dict[tuple, torch.Tensor] = {}
    inputs = graph.inputs if inputs is None else inputs
    lost: set[int] = set()  # nodes that raised or read a value of one that did

    def value(r: tuple) -> torch.Tensor:
        return inputs[r[1]] if r[0] == "i" else env[r]

    for n, (func, args, kwargs) in enumerate(graph.nodes):
        if lost and any(r[0] == "v" and r[1] in lost for r in node_refs[n]):
            lost.add(n)
            continue
        try:
            resolved = [_resolve(a, value) for a in args]
            out = func(*resolved, **{k: _resolve(v, value) for k, v in kwargs.items()})
        except Exception as error:
            if errors is None:
                raise
            errors.append(error)  # kept for the caller to raise
            lost.add(n)
            continue
        if n in graph.in_place:  # its outputs are the tensors it wrote
            out = resolved[0]
        outs = out if isinstance(out, (list, tuple)) else (out,)
        for j, o in enumerate(outs):
            r = ("v", n, j)
            if r in last_use or r in keep:  # an output nothing reads is dropped at once
                env[r] = o
        del out, outs
        for r in node_refs[n]:
            if r[0] == "v" and last_use[r] == n and r not in keep:
                env.pop(r, None)
    return [None if r[0] == "v" and r[1] in lost else value(r) for r in outputs]


def to_fx(graph: Any, outputs: list[tuple]) -> torch.fx.GraphModule:
    """The pending graph as an FX graph of ATen ops (meta tensors as node values)."""
    fx = torch.fx.Graph()
    env: dict[tuple, torch.fx.Node] = {}
    for k, t in enumerate(graph.inputs):
        node = fx.placeholder(f"in_{k}")
        node.meta["val"] = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
        env[("i", k)] = node
    def node_of(x: Any) -> Any:
        return env[x.ref] if type(x) is Arg else x

    for n, (func, args, kwargs) in enumerate(graph.nodes):
        fx_args = tuple(map_arg(a, node_of) for a in args)
        node = fx.call_function(func, fx_args, {k: map_arg(v, node_of) for k, v in kwargs.items()})
        metas = graph.metas[n]
        if n in graph.in_place:  # its outputs are the inputs it wrote
            targets = fx_args[0] if isinstance(fx_args[0], (list, tuple)) else [fx_args[0]]
            for j, target in enumerate(targets):
                env[("v", n, j)] = target
            continue
        vals = [None if m is None else torch.empty_strided(m[0], m[1], dtype=m[3], device="meta") for m in metas]
        single = len(func._schema.returns) == 1 and not isinstance(func._schema.returns[0].type, torch.ListType)
        node.meta["val"] = vals[0] if single else vals
        if single:
            env[("v", n, 0)] = node
        else:
            for j in range(len(metas)):
                item = fx.call_function(operator.getitem, (node, j))
                item.meta["val"] = vals[j]
                env[("v", n, j)] = item
    fx.output(tuple(env[r] for r in outputs))
    return torch.fx.GraphModule(torch.nn.Module(), fx)


def written_inputs(graph: Any) -> list[int]:
    """The inputs the graph's in-place nodes write (graph.in_place: real tensors updated in place)."""
    written: dict[int, None] = {}
    for n in sorted(graph.in_place):
        first = graph.nodes[n][1][0]
        for a in first if isinstance(first, (list, tuple)) else (first,):
            if type(a) is Arg and a.ref[0] == "i":
                written[a.ref[1]] = None
    return list(written)


def _written_refs(graph: Any, n: int) -> list[tuple]:
    """The refs in-place node ``n`` writes (its first argument: a tensor or a list)."""
    first = graph.nodes[n][1][0]
    return [a.ref for a in (first if isinstance(first, (list, tuple)) else (first,)) if type(a) is Arg]


def _inputs_read_by(graph: Any, refs: list[tuple], node_refs: list[list[tuple]]) -> set[int]:
    """The graph inputs these values are computed from, through any chain of nodes."""
    inputs: set[int] = set()
    seen: set[int] = set()
    stack = list(refs)
    while stack:
        r = stack.pop()
        if r[0] == "i":
            inputs.add(r[1])
        elif r[1] not in seen:
            seen.add(r[1])
            stack.extend(node_refs[r[1]])
    return inputs


def copies_an_updated_source(graph: Any) -> bool:
    """Whether an in-place copy into a real tensor takes its value from an input (through any
    ops) whose memory a later node updates in place. Compiled, such a graph is wrong (upstream
    Inductor on torch 2.13: plain CPU Inductor compiles the same function wrong): the copy of
    a plain input (or of a clone, a same-dtype cast) is removed as a no-op, so the destination
    is written from the source's buffer - after the source's own update, when the source
    comes first in the graph's inputs. Such a graph runs op by op. Conservative: any chain of
    ops from the source counts."""
    copies = {n for n in graph.in_place if graph.nodes[n][0] in COPY_OPS}
    if not copies:
        return False
    # TensorBase's method: torch.Tensor's may be a materialization hook.
    storages = [torch._C.TensorBase.untyped_storage(t)._cdata if isinstance(t, torch.Tensor) else None
                for t in graph.inputs]
    node_refs = [arg_refs(args, kwargs) for _, args, kwargs in graph.nodes]
    updated_after: set[int] = set()  # storages written by in-place nodes after the one looked at
    for n in range(len(graph.nodes) - 1, min(copies) - 1, -1):
        if n in graph.in_place:
            if n in copies:
                written = set(_written_refs(graph, n))
                sources = [r for r in node_refs[n] if r not in written]
                if any(storages[k] in updated_after for k in _inputs_read_by(graph, sources, node_refs)):
                    return True
            updated_after.update(storages[r[1]] for r in _written_refs(graph, n) if r[0] == "i")
    return False


@contextlib.contextmanager
def versions_kept(tensors: list[torch.Tensor]) -> Iterator[None]:
    """Running a graph leaves the version counters of the real tensors it updates in place
    as they are: recording each update bumped them once already, as Strict's update does,
    and a second bump would fail autograd's check of a view saved in between (a layer's
    weight.t(), saved before its graph ran the optimizer's update).

    Only for a graph whose in-place updates were all recorded on the running thread: another
    recording thread bumps a version after the op's recording, outside the graph's lock, so
    its bump may land during the run and be undone here (see ``unversioned``)."""
    tensors = [t for t in tensors if not t.is_inference()]  # those keep no version
    versions = [t._version for t in tensors]
    try:
        yield
    finally:
        if tensors:
            torch._C._autograd._unsafe_set_version_counter(tensors, versions)


def unversioned(inputs: list[torch.Tensor], written: list[int]) -> list[torch.Tensor]:
    """``inputs`` with the written ones replaced by aliases with version counters of their
    own: the run then bumps none of the real tensors' versions, and leaves alone the bumps
    other threads make meanwhile (what versions_kept cannot). An alias costs about an
    in-place op, so only graphs recorded on other threads pay it."""
    inputs = list(inputs)
    alias = torch.ops.torch_tpu._deferred_alias.default
    for k in written:
        t = inputs[k]
        if not t.is_inference():  # those keep no version
            inputs[k] = alias(t, list(t.shape), list(t.stride()), t.storage_offset())
    return inputs


@dataclass
class _Entry:
    runs: int = 0
    runner: Any = None  # the ChoosingRunner once compiled
    liveness: Liveness | None = None  # for op by op runs, worked out at the first
    future: concurrent.futures.Future | None = None
    written: list[int] | None = None  # written_inputs, worked out at the first run

    def settled(self) -> bool:
        """Whether the graph runs as it will from now on: its compile, if any, is
        done and its runner has chosen (a later check may still change that)."""
        if self.runs < COMPILE_AT_RUN or (self.future is not None and not self.future.done()):
            return False
        return self.runner is None or self.runner.chosen is not None


class GraphCache:
    """Graphs by key, and their compiles."""

    def __init__(self) -> None:
        self.entries: dict[tuple, _Entry] = {}
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._warned = False

    @staticmethod
    def compile_mode() -> str:
        mode = os.environ.get(COMPILE_VARIABLE, "async").strip().lower() or "async"
        if mode not in COMPILE_MODES:
            raise ValueError(f"{COMPILE_VARIABLE}={mode!r}: expected one of {COMPILE_MODES}")
        return mode

    def run(self, graph: Any, outputs: list[tuple],
            errors: list[BaseException] | None = None) -> tuple[list[torch.Tensor | None], bool, bool, bool]:
        """The output values, whether the compiled graph produced them, whether
        the graph now runs as it will from now on (_Entry.settled), and whether
        this was its first run. ``errors`` (a list): an op run op by op that raises
        does not stop the run (see replay); a compiled run raises."""
        key = graph_key(graph, outputs)
        entry = self.entries.get(key)
        if entry is None:
            if len(self.entries) >= MAX_ONE_OFF_GRAPHS:
                self._forget_one_offs()
            entry = self.entries[key] = _Entry()
        entry.runs += 1
        if entry.written is None:
            entry.written = written_inputs(graph)
        if entry.written and graph.writers - {threading.get_ident()}:
            values, compiled = self._run(entry, graph, outputs, errors, unversioned(graph.inputs, entry.written))
        else:
            with versions_kept([graph.inputs[k] for k in entry.written]):
                values, compiled = self._run(entry, graph, outputs, errors, graph.inputs)
        return values, compiled, entry.settled(), entry.runs == 1

    def _run(self, entry: _Entry, graph: Any, outputs: list[tuple], errors: list[BaseException] | None,
             inputs: list[torch.Tensor]) -> tuple[list[torch.Tensor | None], bool]:
        if entry.runs == COMPILE_AT_RUN:
            mode = self.compile_mode()
            if mode != "off" and len(graph.nodes) >= MIN_COMPILED_OPS and self._compilable(graph):
                from torch_tpu import inductor

                gm = to_fx(graph, outputs)
                # Their geometry only: a queued compile must not keep the step's tensors alive.
                examples = [inductor.shape_of(t) for t in graph.inputs]
                device = next((t.device.index or 0 for t in graph.inputs
                               if isinstance(t, torch.Tensor) and t.device.type == "tpu"), None)
                if mode == "sync":
                    self._compile(entry, gm, examples, device)
                else:
                    entry.future = self._executor().submit(self._compile, entry, gm, examples, device)
        if entry.runner is not None:
            values = entry.runner(*inputs)
            return list(values), entry.runner.last_ran_compiled
        if entry.liveness is None:
            entry.liveness = Liveness.of(graph)
        return replay(graph, outputs, entry.liveness, errors, inputs), False

    @staticmethod
    def _compilable(graph: Any) -> bool:
        if copies_an_updated_source(graph):
            logger.info("DeferAndFuse: a graph of %d ops copies an input it then updates in place: "
                        "it runs op by op (Inductor would copy the updated value)", len(graph.nodes))
            return False
        return True

    def _forget_one_offs(self) -> None:
        one_offs = [k for k, e in self.entries.items() if e.runs <= 1]
        if len(one_offs) > MAX_ONE_OFF_GRAPHS // 2 and not self._warned:
            self._warned = True
            logger.warning(
                "DeferAndFuse: %d graphs ran once and never recurred: they run op by op. Graphs are keyed by "
                "their scalar arguments - keep per-step values (an optimizer's step, a scheduled lr) in tpu "
                "tensors, e.g. capturable=True optimizers", len(one_offs))
        for k in one_offs:
            del self.entries[k]

    def _executor(self) -> concurrent.futures.ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = threads.worker("torch_tpu-compile")
            return self._pool

    @staticmethod
    def _compile(entry: _Entry, gm: torch.fx.GraphModule, examples: list, device: int | None) -> None:
        from torch_tpu import inductor

        outputs = len(gm.graph.output_node().args[0])
        try:
            compiled = inductor.compile_graph(gm, examples, tpu_outputs=[True] * outputs, device=device)
        except Exception as error:  # noqa: BLE001 - the graph keeps running op by op
            if sys.is_finalizing() or "shutdown" in str(error):
                return  # the process is exiting
            logger.warning("DeferAndFuse: a graph of %d ops does not compile (%s): it runs op by op",
                           sum(1 for n in gm.graph.nodes if n.op == "call_function"), error)
            return
        if isinstance(compiled, inductor.ChoosingRunner):
            entry.runner = compiled  # else: cannot keep tpu semantics compiled, so op by op

    def wait_for_compiles(self) -> None:
        """Blocks until the compiles started so far are done (tests, benchmarks)."""
        for entry in list(self.entries.values()):
            if entry.future is not None:
                entry.future.result()
