"""What the SparseCore embedding modules share: tables, stacks, weights, the fused optimizer.

Tables are stacked and mod-sharded over the device's SparseCores
(sparsecore.stacking); each stack's weights are one physical table. The
module's ``state_dict`` shows every table in logical row order under
TorchRec's keys (``<prefix>.<table>.weight``), and ``fused_optimizer`` (when
the module trains) holds the optimizer state the same way.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import math
from collections.abc import Callable, Sequence

import torch
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from sparsecore.config import SparseCoreEmbeddingConfig, TorchRecConfig, as_sparsecore_config
from sparsecore.errors import InputError
from sparsecore.executor import Pending, Resolved, completed, executor_for, run_on
from sparsecore.fused import exchanged_update, fused_lookup, fused_update, placeholder, trained_rows
from sparsecore.fused_optimizer import FusedOptimizer, StepCount, TableState
from sparsecore.kernels import lookup
from sparsecore.optim import Optimizer, from_torch_optim
from sparsecore.preprocess import PreprocessedBatch, Preprocessor, StackBatch, preprocess_and_look_up
from sparsecore.stacking import StackSpec, plan_stacks
from sparsecore.traced_preprocess import register, traced_batch

logger = logging.getLogger(__name__)


def default_num_sparsecores(device: torch.device) -> int:
    """The chip's SparseCores for a tpu device; 1 elsewhere (a plain-CPU run of the engine)."""
    if device.type == "tpu":
        return torch.tpu.get_device_properties(device).sparsecores_per_chip
    return 1


COPY_SLICE_BYTES = 1 << 20


def logical_to_physical(stack: StackSpec, table: str, device: torch.device | None = None) -> torch.Tensor:
    """Physical row of each logical row of a table (sparsecore.stacking's mod sharding)."""
    config = next(t for t in stack.tables if t.name == table)
    return stack.physical_row(table, torch.arange(config.num_embeddings, device=device))


class SparseCoreCollection(nn.Module):
    """Base of the pooled and sequence collections; subclasses set the two class attributes."""

    _weight_prefix = ""  # TorchRec's state_dict prefix: "embedding_bags" or "embeddings"
    _pooled = True

    def __init__(
        self,
        tables: Sequence[SparseCoreEmbeddingConfig | TorchRecConfig],
        optimizer: Optimizer | tuple | None = None,
        device: torch.device | str | None = None,
        *,
        num_sparsecores: int | None = None,
        allow_id_dropping: bool = False,
        is_weighted: bool = False,
    ):
        super().__init__()
        self._configs = [as_sparsecore_config(t) for t in tables]
        self._check_tables()
        self._device = torch.device(device if device is not None else "tpu")
        self._num_sparsecores = num_sparsecores  # None: the device's (re-planned when a meta module lands)
        n = num_sparsecores or default_num_sparsecores(self._device)
        if is_weighted and not self._pooled:
            raise ValueError("is_weighted=True: a sequence collection has no pooling for weights to scale "
                             "(TorchRec's EmbeddingCollection takes none)")
        self._is_weighted = is_weighted
        self._stacks = plan_stacks(self._configs, n, weighted=is_weighted)
        self._allow_id_dropping = allow_id_dropping
        self._deferred_updates = False  # see set_deferred_updates
        self._observed: dict[str, tuple[int, int]] = {}  # per stack: most (ids, unique ids) of a partition so far
        self._dropped: dict[str, int] = {}  # per stack: ids dropped at the limits so far (allow_id_dropping)
        self._prefetched: tuple[object, Pending] | None = None  # see prefetch
        self._weights = nn.ParameterDict()
        for stack in self._stacks:
            weight = torch.zeros((stack.physical_rows, stack.embedding_dim), dtype=stack.tables[0].dtype,
                                 device=self._device)
            self._weights[stack.name] = nn.Parameter(weight, requires_grad=False)
        self.reset_parameters()
        self._optimizer = None if optimizer is None else from_torch_optim(optimizer)
        self._row_exchanges: dict[str, Callable] = {}
        self._init_optimizer_state()
        self._register_state_dict_hook(_logical_state_dict)
        self._register_load_state_dict_pre_hook(_load_logical_state_dict, with_module=True)
        self._traced_key = register(self)

    def _init_optimizer_state(self) -> None:
        """Fresh optimizer state on the module's device (none without an optimizer)."""
        self._optimizer_state: dict[str, dict[str, torch.Tensor]] = {}
        self._steps: dict[str, torch.Tensor] = {}  # per stack: int64 [1], updated by the kernel
        if self._optimizer is None:
            return
        self._placeholder = placeholder(self._device)
        # [lr, eps, beta1, beta2] on the host; fused_optimizer keeps lr in step with param_groups.
        self._hyper = torch.tensor(self._optimizer.hyper(self._optimizer.lr), dtype=torch.float64)
        for stack in self._stacks:
            self._optimizer_state[stack.name] = {
                name: torch.full(shape, initial, dtype=torch.float32, device=self._device)
                for name, (shape, initial) in self._optimizer.state(stack.physical_rows, stack.embedding_dim).items()
            }
            self._steps[stack.name] = torch.zeros(1, dtype=torch.int64)
        self.fused_optimizer = self._make_fused_optimizer()

    def _apply(self, fn: Callable, recurse: bool = True) -> SparseCoreCollection:
        """``nn.Module``'s move of the tables, which the optimizer state and the autograd
        placeholder (plain attributes) follow: ``to(device)`` and ``to_empty(device=...)``
        reach a module inside a model only through here. A module built on the meta device
        gets fresh state; call reset_parameters() (or load) next."""
        if self._device.type != "meta":
            self.wait_for_updates()  # the tables are copied next
        super()._apply(fn, recurse)
        device = next(iter(self._weights.values())).device if len(self._weights) else self._device
        if device.type == self._device.type and self._device.index in (None, device.index):
            return self  # "tpu" is the current tpu: .to("tpu") of a model on tpu:0 moves nothing
        if self._device.type == "meta":
            self._device = device
            self._replan_for(device)
            self._init_optimizer_state()
            return self
        self._device = device
        for group in self._optimizer_state.values():
            for key, value in group.items():
                group[key] = value.to(device)
        if self._optimizer is not None:
            self._placeholder = placeholder(device)
            # Over the moved state; the lr (in the host hyperparameters) and step counts stay.
            self.fused_optimizer = self._make_fused_optimizer()
        return self

    def _replan_for(self, device: torch.device) -> None:
        """A module built on meta, materialized on ``device``: its stacks laid out over the
        device's SparseCores, as a module built there (the meta device has one), and the
        tables (no values yet) shaped for them."""
        n = self._num_sparsecores or default_num_sparsecores(device)
        if all(s.num_sparsecores == n for s in self._stacks):
            return
        self._stacks = plan_stacks(self._configs, n, weighted=self._is_weighted)
        self.__dict__.pop("stacks", None)  # the cached public list
        for stack in self._stacks:
            self._weights[stack.name] = nn.Parameter(
                torch.empty((stack.physical_rows, stack.embedding_dim), dtype=self._weights[stack.name].dtype,
                            device=device), requires_grad=False)

    def is_weighted(self) -> bool:
        """Whether a KJT's weights scale its ids' rows (as TorchRec's ``is_weighted``; default
        False: they are ignored)."""
        return self._is_weighted

    def to_torchrec(self) -> nn.Module:
        """The TorchRec module with these tables and weights (see sparsecore.convert)."""
        from sparsecore.convert import to_torchrec  # convert imports the subclasses of this one

        return to_torchrec(self)

    def memory_breakdown(self) -> dict[str, int]:
        """Bytes of the tables, the optimizer state and the COO buffers (at the partition limits)."""
        tables = sum(w.numel() * w.element_size() for w in self._weights.values())
        state = sum(t.numel() * t.element_size() for group in self._optimizer_state.values() for t in group.values())
        entry_bytes = 4 + 4 + 4  # local row, bag, gain
        buffers = sum(
            max(s.num_sparsecores * s.num_sparsecores * (s.max_ids_per_partition * entry_bytes + 4),
                (s.coo_buffer_size_per_device or 0) * entry_bytes)
            for s in self._stacks
        )
        return {"tables": tables, "optimizer_state": state, "buffers": buffers, "total": tables + state + buffers}

    def _check_tables(self) -> None:
        names, features = set(), {}
        kind = "pooled (EmbeddingBagConfig)" if self._pooled else "sequence (EmbeddingConfig)"
        for t in self._configs:
            if t.is_pooled != self._pooled:
                raise InputError(f"table {t.name!r} is not a {kind} table, which {type(self).__name__} takes")
            if t.name in names:
                raise InputError(f"table name {t.name!r} is used twice")
            names.add(t.name)
            for f in t.feature_names:
                if f in features:
                    raise InputError(f"feature {f!r} is served by both {features[f]!r} and {t.name!r}")
                features[f] = t.name

    def _weight_key(self, table: str) -> str:
        return f"{self._weight_prefix}.{table}.weight"

    def _make_fused_optimizer(self) -> FusedOptimizer:
        params, state = {}, {}
        for t in self._configs:
            stack = self._stack_of(t.name)
            # Parameter handles: the optimizer keys its state by them (TorchRec's keys).
            handle = torch.empty(0)
            params[self._weight_key(t.name)] = handle
            rows = functools.partial(self._physical_rows, t.name)  # a bound method pickles, a lambda not
            entries = {f"{t.name}.{key}": TableState(value, rows) for key, value in self._optimizer_state[stack.name].items()}
            entries[f"{t.name}.step"] = StepCount(self._steps[stack.name])
            state[handle] = entries
        hyper = {k: v for k, v in vars(self._optimizer).items() if k != "lr"}
        return FusedOptimizer(params=params, state=state, lr_tensor=self._hyper, hyper=hyper,
                              before_state_access=self.wait_for_updates)

    # ---- weights ----

    def _physical_rows(self, table: str) -> torch.Tensor:
        """The table's logical rows' rows in its stack, on the module's device."""
        return logical_to_physical(self._stack_of(table), table, self._device)

    def __getstate__(self) -> dict:
        self.wait_for_updates()  # pickling and deepcopy read the tables
        return super().__getstate__()

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self._traced_key = register(self)  # a copy's own: the op finds the module by it

    def _stack_of(self, table: str) -> StackSpec:
        return next(s for s in self._stacks if table in s.placements)

    def table_weight(self, table: str) -> torch.Tensor:
        """A copy of the table's (num_embeddings, dim) weights in logical row order."""
        self.wait_for_updates()
        stack = self._stack_of(table)
        weight = self._weights[stack.name]
        return weight.detach().index_select(0, logical_to_physical(stack, table, weight.device))

    def table_optimizer_state(self, table: str) -> dict[str, torch.Tensor]:
        """Copies of the table's rows of each optimizer state tensor, in logical row order."""
        self.wait_for_updates()
        stack = self._stack_of(table)
        state = self._optimizer_state.get(stack.name, {})
        return {name: t.index_select(0, logical_to_physical(stack, table, t.device)) for name, t in state.items()}

    @torch.no_grad()
    def set_table_optimizer_state(self, table: str, name: str, value: torch.Tensor) -> None:
        """Writes the table's rows (logical order) of the optimizer state tensor ``name``."""
        self.wait_for_updates()
        stack = self._stack_of(table)
        self._write_rows(self._optimizer_state[stack.name][name], stack, table, value, name)

    @torch.no_grad()
    def set_table_weight(self, table: str, weight: torch.Tensor) -> None:
        self.wait_for_updates()
        stack = self._stack_of(table)
        self._write_rows(self._weights[stack.name], stack, table, weight, "weight")

    @staticmethod
    def _write_rows(target: torch.Tensor, stack: StackSpec, table: str, value: torch.Tensor, what: str) -> None:
        """``value`` (the table's rows in logical order) into its rows of the stack's ``target``."""
        rows = logical_to_physical(stack, table)
        expected = (rows.numel(), *target.shape[1:])
        if tuple(value.shape) != expected:
            raise ValueError(f"table {table!r}: {what} of shape {tuple(value.shape)}; expected {expected}")
        # In slices: a whole table's copy on the device, on top of the stacks, could be what
        # does not fit in a full HBM (optimizer state can be twice the table).
        row = max(1, math.prod(target.shape[1:]) * target.element_size())
        step = max(1, COPY_SLICE_BYTES // row)
        for start in range(0, rows.numel(), step):
            target.index_copy_(0, rows[start:start + step].to(target.device),
                               value[start:start + step].to(device=target.device, dtype=target.dtype))

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Initializes every table with its config's init_fn (as TorchRec does).

        init_fn fills a table in logical row order, which is not how its rows lie in the stack:
        it runs on a host copy, one table at a time, so device memory never holds more than
        the stacks (a device copy would need a table's worth of HBM on top, at the worst
        moment: a plan that fills HBM would not survive its own construction)."""
        if self._device.type == "meta":
            return
        for t in self._configs:
            weight = torch.empty(t.num_embeddings, t.embedding_dim, dtype=t.dtype)
            if t.init_fn is not None:
                t.init_fn(weight)
            self.set_table_weight(t.name, weight)

    @property
    def stacks(self) -> list[StackSpec]:
        return list(self._stacks)

    @property
    def table_configs(self) -> list[SparseCoreEmbeddingConfig]:
        """The tables as constructed, in order (TorchRec's key order follows them)."""
        return list(self._configs)

    # ---- lookups ----

    def preprocess(self, features: KeyedJaggedTensor) -> PreprocessedBatch:
        return self._preprocess(features, {})[0]

    def _preprocess(self, features: KeyedJaggedTensor, weights: dict[str, torch.Tensor]
                    ) -> tuple[PreprocessedBatch, dict[str, torch.Tensor]]:
        """``preprocess_and_look_up`` of ``features`` for this module's stacks, observed."""
        device = self._device if self._device.type != "meta" else torch.device("cpu")
        batch, rows = preprocess_and_look_up(features, self._stacks, weights,
                                             allow_id_dropping=self._allow_id_dropping, device=device)
        self._observe(batch)
        return batch, rows

    def _preprocess_and_look_up(self, features: KeyedJaggedTensor | PreprocessedBatch
                                ) -> tuple[PreprocessedBatch, dict[str, torch.Tensor]]:
        """The batch and, for a KJT, the pooled stacks' rows looked up while it is preprocessed
        (detached; the rest are looked up from the batch). A traced step keeps the two apart:
        its lookups are ops of the graph, its preprocessing one opaque op (but for tables with a
        max_seq_len)."""
        if torch.compiler.is_exporting() and isinstance(features, KeyedJaggedTensor):
            raise InputError("an exported program takes its batch preprocessed (module.preprocess(kjt)), not a "
                             "KeyedJaggedTensor: host preprocessing is not part of the program, as a TPU's infeed "
                             "is not")
        if (torch.compiler.is_compiling() and isinstance(features, KeyedJaggedTensor) and self._device.type != "meta"
                and all(t.max_seq_len is None for t in self._configs)):
            return traced_batch(self, features, self._traced_key, self._device), {}
        if isinstance(features, PreprocessedBatch) or torch.compiler.is_compiling() or self._device.type == "meta":
            return self._batch_of(features), {}
        return self._preprocess(features, {s.name: self._weights[s.name].detach() for s in self._stacks if s.is_pooled})

    def preprocessor(self) -> Preprocessor:
        """What a data loader needs to preprocess ahead for this module (host buffers; the
        forward moves them to the device)."""
        return Preprocessor(tuple(self._stacks), self._allow_id_dropping)

    def _device_coo(self, stack: StackSpec, coo: StackBatch) -> tuple:
        device = self._weights[stack.name].device
        return (coo.row_pointers.to(device), coo.embedding_ids.to(device), coo.sample_ids.to(device),
                coo.gains.to(device), coo.num_bags, coo.batch_size)

    def _rows(self, stack: StackSpec, coo: tuple, rows: torch.Tensor | None) -> torch.Tensor:
        """``rows`` if they were looked up while preprocessing, else the lookup of ``coo`` (on the device)."""
        return lookup(self._weights[stack.name], *coo) if rows is None else rows

    def _lookup(self, stack: StackSpec, coo: StackBatch, rows: torch.Tensor | None = None) -> torch.Tensor:
        """(bags, dim) rows of one stack (``rows``: already looked up from ``coo``); trains the
        stack in the backward if there is an optimizer."""
        weight = self._weights[stack.name]
        args = self._device_coo(stack, coo)
        if self._optimizer is None or not torch.is_grad_enabled():
            return self._rows(stack, args, rows)
        if rows is not None or stack.name in self._row_exchanges:
            return trained_rows(self._placeholder, self._rows(stack, args, rows), self._update_of(stack, args))
        # A compiled graph's backward has no executor order to keep: its updates run inline.
        deferred = self._defers_updates and not torch.compiler.is_compiling()
        return fused_lookup(self._placeholder, weight, list(self._optimizer_state[stack.name].values()),
                            self._steps[stack.name], self._hyper, *args, self._optimizer.kernel_code, deferred)

    def _update_of(self, stack: StackSpec, coo: tuple, hyper: torch.Tensor | None = None,
                   deferred: bool | None = None) -> Callable[[torch.Tensor], None]:
        """The stack's optimizer step for a batch's ``coo``, given its output's gradient; with
        ``hyper`` (a snapshot) instead of the live hyperparameters, and ``deferred`` overriding
        whether the step is queued on the executor."""
        state = (self._weights[stack.name], list(self._optimizer_state[stack.name].values()),
                 self._steps[stack.name], self._hyper if hyper is None else hyper, coo, self._optimizer.kernel_code)
        exchange = self._row_exchanges.get(stack.name)
        if exchange is not None:
            return functools.partial(exchanged_update, *state, exchange, stack.rows_per_sparsecore)
        return functools.partial(fused_update, *state, self._defers_updates if deferred is None else deferred)

    def _batch_of(self, features: KeyedJaggedTensor | PreprocessedBatch) -> PreprocessedBatch:
        if not isinstance(features, PreprocessedBatch):
            return self.preprocess(features)
        # A traced step leaves this to preprocess (outside the graph): a Python record
        # read in the graph would be guarded on, and every new maximum would recompile.
        if not torch.compiler.is_compiling():
            self._observe(features)
        return features

    def _observe(self, batch: PreprocessedBatch) -> None:
        """Folds a batch's partition statistics into observed_limits and dropped_ids."""
        for name, stats in batch.stats.items():
            ids, unique = self._observed.get(name, (0, 0))
            self._observed[name] = (max(ids, stats.max_ids_per_partition),
                                    max(unique, stats.max_unique_ids_per_partition))
            if stats.dropped_ids:
                if name not in self._dropped:
                    logger.warning("stack %s: %d ids dropped at its partition limits (allow_id_dropping); "
                                   "dropped_ids() counts them from now on", name, stats.dropped_ids)
                self._dropped[name] = self._dropped.get(name, 0) + stats.dropped_ids

    def dropped_ids(self) -> dict[str, int]:
        """Per table, the ids dropped so far because a partition passed its limits (with
        ``allow_id_dropping``; its stack's count: stacked tables share partitions)."""
        return {t.name: self._dropped.get(self._stack_of(t.name).name, 0) for t in self._configs}

    def observed_limits(self) -> dict[str, dict[str, int]]:
        """Per table, the most ids and distinct ids any SparseCore partition carried in a
        batch so far (its stack's: stacked tables share partitions), to seed the limits
        (``max_ids_per_partition``, ``max_unique_ids_per_partition``) of a later run."""
        out = {}
        for stack in self._stacks:
            ids, unique = self._observed.get(stack.name, (0, 0))
            for t in stack.tables:
                out[t.name] = {"max_ids_per_partition": ids, "max_unique_ids_per_partition": unique}
        return {t.name: out[t.name] for t in self._configs}

    def _detached_lookups(self, features: KeyedJaggedTensor | PreprocessedBatch) -> tuple[PreprocessedBatch, dict]:
        """Preprocessing and the lookup kernels without autograd (what the executor runs):
        the batch and, per stack, (rows, coo on the device)."""
        with torch.no_grad():
            batch, rows = self._preprocess_and_look_up(features)
            out = {}
            for stack in self._stacks:
                coo = self._device_coo(stack, batch.stacks[stack.name])
                out[stack.name] = (self._rows(stack, coo, rows.get(stack.name)), coo)
        return batch, out

    def _attach(self, batch: PreprocessedBatch, looked_up: dict) -> dict[str, torch.Tensor]:
        """Detached lookups joined to the autograd graph (in the calling thread) when training."""
        if self._optimizer is None or not torch.is_grad_enabled():
            return {name: rows for name, (rows, _) in looked_up.items()}
        return {stack.name: trained_rows(self._placeholder, looked_up[stack.name][0],
                                         self._update_of(stack, looked_up[stack.name][1]))
                for stack in self._stacks}

    def set_deferred_updates(self, enabled: bool = True) -> None:
        """Deferred: the backward queues each fused update on the SparseCore executor and
        returns, so the dense backward and optimizer step run meanwhile (TrainPipeline
        turns this on). The executor runs work in order, so the next lookup still sees
        the updated rows; reading weights or optimizer state here waits for the queue.
        On a device without a SparseCore executor (cpu) updates always run inline.
        Stacks with a row exchange (sharded data-parallel or column-wise row-wise
        Adagrad tables) always update inline: their exchanges are collectives, which
        must stay in the calling thread's order."""
        if not enabled:
            self.wait_for_updates()  # reads stop waiting once this is off: the queue first
        self._deferred_updates = enabled

    @property
    def _defers_updates(self) -> bool:
        """Deferred updates asked for, and an executor to defer them to (the tpu's)."""
        return self._deferred_updates and self._device.type == "tpu"

    def wait_for_updates(self) -> None:
        """Waits for the deferred updates queued so far (and raises their error, if any)."""
        if self._defers_updates:
            executor_for(self._device).synchronize()

    def close(self) -> None:
        """Waits for the work in flight (this module has no threads of its own to stop)."""
        self.wait_for_updates()

    def set_row_exchange(self, stack: str, exchange: Callable) -> None:
        """Splits the stack's fused backward around ``exchange(rows, grads) -> (rows, grads,
        row_mean_sq | None)``: the batch's touched physical rows and summed gradients go
        through it before the optimizer steps (sparsecore.distributed combines them across
        ranks there). ``row_mean_sq``, if given, is row-wise Adagrad's whole-row statistic."""
        if stack not in {s.name for s in self._stacks}:
            raise KeyError(f"no stack {stack!r}; the stacks are {[s.name for s in self._stacks]}")
        self._row_exchanges[stack] = exchange

    def forward(self, features: KeyedJaggedTensor | PreprocessedBatch):
        """The lookup of ``features`` (see the subclass's ``_assemble``), or the result of
        its :meth:`prefetch` when one was started for this very object."""
        pending = self._take_prefetched(features)
        if pending is not None:
            return pending.result()
        if not torch.compiler.is_compiling():
            # This thread's lookup would not queue behind the updates queued on the executor.
            self.wait_for_updates()
        return self._assemble(*self._lookup_all(features))

    def forward_async(self, features: KeyedJaggedTensor | PreprocessedBatch) -> Pending | Resolved:
        """Runs forward's preprocessing and lookups on the device's SparseCore executor.

        Returns a Future-like ``Pending`` of what forward returns; TensorCore work
        issued meanwhile overlaps it. Its ``result()``, in the calling thread, joins
        the rows to the autograd graph (under that thread's grad mode). Off the tpu
        there is no SparseCore stream: the lookups run at once. Under ``torch.compile``
        too: they are traced into the step's graph (and its updates run inline).
        """
        if torch.compiler.is_compiling():
            return Resolved(self.forward(features))
        pending = self._take_prefetched(features)
        if pending is not None:
            return pending
        return self._pending(run_on(self._device, "lookup", self._detached_lookups, features))

    def _pending(self, looked_up: concurrent.futures.Future) -> Pending:
        return Pending(looked_up, lambda result: self._assemble(result[0], self._attach(*result)))

    def prepare(self, features: KeyedJaggedTensor | PreprocessedBatch) -> concurrent.futures.Future:
        """Starts the host preprocessing of a batch (on the SparseCore executor, after the
        work queued there): the first stage of :meth:`prefetch`, which reads no weights,
        so it may run any time ahead."""
        if isinstance(features, PreprocessedBatch):
            return completed(features)
        return run_on(self._device, "preprocess", self.preprocess, features)

    def prefetch(self, features: KeyedJaggedTensor | PreprocessedBatch,
                 prepared: concurrent.futures.Future | None = None) -> None:
        """Queues the lookups of ``features`` now; the next ``forward``/``forward_async`` of the
        same object takes their result instead of looking up again. Lookups queue behind the
        deferred updates already queued, so prefetching after a backward sees its updates.
        ``prepared``: the Future :meth:`prepare` returned for these features."""
        if prepared is None:
            prepared = self.prepare(features)
        looked_up = run_on(self._device, "lookup", lambda: self._detached_lookups(prepared.result()))
        self._prefetched = (features, self._pending(looked_up))

    def _take_prefetched(self, features) -> Pending | None:
        if self._prefetched is not None and self._prefetched[0] is features:
            pending, self._prefetched = self._prefetched[1], None
            return pending
        return None

    def _lookup_all(self, features: KeyedJaggedTensor | PreprocessedBatch) -> tuple[PreprocessedBatch, dict[str, torch.Tensor]]:
        batch, rows = self._preprocess_and_look_up(features)
        return batch, {s.name: self._lookup(s, batch.stacks[s.name], rows.get(s.name)) for s in self._stacks}


def _logical_state_dict(module: SparseCoreCollection, state: dict, prefix: str, _meta) -> dict:
    for stack in module._stacks:
        state.pop(f"{prefix}_weights.{stack.name}", None)
    for t in module._configs:
        state[prefix + module._weight_key(t.name)] = module.table_weight(t.name)
    return state


def _load_logical_state_dict(module: SparseCoreCollection, state: dict, prefix: str, _metadata, _strict,
                             missing_keys: list[str], *_args) -> None:
    for t in module._configs:
        key = prefix + module._weight_key(t.name)
        if key not in state:
            missing_keys.append(key)  # TorchRec's key, not the stack's, which is put in below
        else:
            weight = state.pop(key)
            expected = (t.num_embeddings, t.embedding_dim)
            if tuple(weight.shape) != expected:
                raise InputError(f"{key}: shape {tuple(weight.shape)} does not match the table's {expected}")
            module.set_table_weight(t.name, weight)
    for stack in module._stacks:
        state[f"{prefix}_weights.{stack.name}"] = module._weights[stack.name].detach()
