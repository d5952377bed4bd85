"""A SparseCore embedding-bag collection sharded over a process group.

``shard(module, plan)`` gives every rank an engine holding its shards (an
ordinary ``SparseCoreEmbeddingBagCollection`` over the local tables) between
the input and output distributions. ``forward(local KJT) -> KeyedTensor`` has
the unsharded module's contract for the rank's own samples; the backward runs
each shard's fused optimizer on its rows, with the gradient of every sample of
the global batch that touched them.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import hashlib
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizer
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from sparsecore.distributed.input_dist import InputDist, select
from sparsecore.distributed.layout import ShardLayout
from sparsecore.distributed.output_dist import OutputDist
from sparsecore.distributed.plan import COLUMN_WISE, PlanError, ShardingPlan, default_plan
from sparsecore.distributed.row_exchange import merge_across_ranks, whole_row_statistic
from sparsecore.executor import Pending, completed, executor_for, run_on
from sparsecore.collection import SparseCoreCollection
from sparsecore.modules import SparseCoreEmbeddingBagCollection
from sparsecore.optim import RowWiseAdagrad
from sparsecore.weight_gradient import refuse_trainable_weights
from torch_tpu import threads


@dataclasses.dataclass(frozen=True)
class LocalShard:
    """The rows and columns of one table this rank holds, with their optimizer state."""

    table: str
    rows: torch.Tensor
    """Table id of each row of ``weight`` (row-sharded: the ids this shard owns)."""
    columns: tuple[int, int]
    """(first column, width) of the table's dim."""
    weight: torch.Tensor
    state: dict[str, torch.Tensor]
    """Per optimizer state name (e.g. ``"momentum"``): its rows, aligned with ``weight``."""


class ShardedSparseCoreCollection(nn.Module):
    """What the sharded pooled and sequence collections share: the rank's engines (its shards,
    and replicas of data-parallel tables), their weights and optimizer state, and the input
    distribution. Subclasses add their output distribution and forward."""


    def __init__(self, module: SparseCoreCollection, plan: ShardingPlan,
                 process_group: dist.ProcessGroup | None = None):
        super().__init__()
        self._group = process_group
        self._rank, world = dist.get_rank(process_group), dist.get_world_size(process_group)
        _check_same_plan(plan, process_group)
        if plan.world_size != world:
            raise ValueError(f"the plan is for {plan.world_size} ranks but the process group has {world}")
        self._configs = list(module._configs)
        self._weight_prefix = module._weight_prefix  # the unsharded module's state_dict prefix
        self._optimizer = module._optimizer
        self.plan = plan
        self._layout = ShardLayout(self._configs, plan)
        local = self._layout.local[self._rank]
        device = module._device if module._device.type != "meta" else torch.device("tpu")
        if device.type == "tpu" and device.index is None:
            # Explicit: the lookups run on the executor's thread, whose current device is not ours.
            device = torch.device("tpu", torch.tpu.current_device())
        self._device = device
        self._is_weighted = module.is_weighted()

        def engine(configs, weighted):
            return type(module)(configs, module._optimizer, device,
                                                    num_sparsecores=plan.sparsecores_per_chip,
                                                    allow_id_dropping=module._allow_id_dropping,
                                                    is_weighted=weighted and module._pooled)

        # The shards take the routed gains as weights (InputDist drops the batch's own when
        # the collection is unweighted); a replica sees the local batch, as the collection would.
        self.engine = engine([s.local_config() for s in local], True) if local else None
        # data_parallel tables: a replica here, trained on every rank's row gradients.
        self.replicas = engine(self._layout.replicated, self._is_weighted) if self._layout.replicated else None
        if module._device.type != "meta":
            self._copy_weights(module)
        if self.replicas is not None:
            self._broadcast_replicas()
            for stack in self.replicas.stacks:
                self.replicas.set_row_exchange(stack.name, functools.partial(merge_across_ranks, group=process_group))
        if isinstance(module._optimizer, RowWiseAdagrad):
            self._share_row_statistics()
        self._input_dist = InputDist(self._layout, self._rank, process_group, self._is_weighted)
        self._combined_optimizer: KeyedOptimizer | None = None  # see fused_optimizer

    def _share_row_statistics(self) -> None:
        """Row-wise Adagrad on column-wise tables: peer column shards (one stack per slice of
        tables split alike) sum their rows' squared gradients before stepping
        (row_exchange.whole_row_statistic): one all-reduce per stack and step."""
        groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
        for c in self._configs:
            if self.plan.tables[c.name].sharding_type != COLUMN_WISE:
                continue
            shards = self._layout.shards[c.name]
            ranks = tuple(s.rank for s in shards)
            if len(set(ranks)) != len(ranks):
                raise NotImplementedError(f"table {c.name!r}: row-wise Adagrad with two column shards on one rank "
                                          f"({list(ranks)}) is not supported; give each column shard its own rank")
            if ranks not in groups:  # every rank creates every group, in the same order
                groups[ranks] = dist.new_group(sorted(ranks))
            for s in shards:
                if s.rank == self._rank:
                    self.engine.set_row_exchange(s.stack, functools.partial(
                        whole_row_statistic, group=groups[ranks], dim=c.embedding_dim))

    @torch.no_grad()
    def _broadcast_replicas(self) -> None:
        """The data-parallel replicas start as rank 0's (weights and optimizer state), as DDP's
        parameters do: every rank then steps them alike (a module built on meta, or seeded
        differently per rank, would otherwise hold a different replica on every rank)."""
        if dist.get_world_size(self._group) == 1:
            return
        source = dist.get_global_rank(self._group or dist.group.WORLD, 0)
        # The physical tables and state, in place: every rank lays the replicas out alike (one
        # plan), and no copy of a table is made on the way.
        replicas = self.replicas
        for stack in replicas.stacks:
            dist.broadcast(replicas._weights[stack.name].data, src=source, group=self._group)
            for _, value in sorted(replicas._optimizer_state.get(stack.name, {}).items()):
                dist.broadcast(value, src=source, group=self._group)

    @torch.no_grad()
    def _copy_weights(self, module: SparseCoreCollection) -> None:
        for c in self._layout.replicated:
            self.replicas.set_table_weight(c.name, module.table_weight(c.name))
        for s in self._layout.local[self._rank]:
            full = module.table_weight(s.table)
            ids = s.global_ids()
            rows = torch.zeros(s.num_rows, s.width, dtype=full.dtype)
            valid = ids < s.source.num_embeddings
            rows[valid] = full[ids[valid].to(full.device)][:, s.column_offset:s.column_offset + s.width].cpu()
            self.engine.set_table_weight(s.local_table, rows)

    @property
    def fused_optimizer(self) -> KeyedOptimizer | None:
        """The KeyedOptimizer of this rank's tables, shards and replicas alike: their state, and
        param groups whose learning rate (e.g. set by an LR scheduler) drives them all. None
        only for a module without an optimizer. A rank holding no table gets an empty one (no
        state, no param groups; as TorchRec's sharded modules give it): training code drives
        the optimizer on every rank (LR schedulers, state_dict, zero_grad, step)."""
        if self._optimizer is None:
            return None
        if self._combined_optimizer is None:
            optimizers = [e.fused_optimizer for e in self._engines()]
            self._combined_optimizer = optimizers[0] if len(optimizers) == 1 else CombinedOptimizer(optimizers)
        return self._combined_optimizer

    def _apply(self, fn: Callable, recurse: bool = True) -> ShardedSparseCoreCollection:
        """``nn.Module``'s move (``to``, ``to_empty``): the engines move their state and make
        new fused optimizers over it, so the combined one is made again from theirs (the old
        one would read and write the tensors the engines left behind). The learning rate
        lives in the engines' hyperparameters, which a move keeps."""
        super()._apply(fn, recurse)
        self._combined_optimizer = None
        return self

    def observed_limits(self) -> dict[str, dict[str, int]]:
        """Per table, the most ids and distinct ids any SparseCore partition of any rank
        carried in a batch so far (the max over its shards, all-reduced over the group:
        collective, every rank calls it), to seed a later run's limits under this plan."""
        local = {c.name: [0, 0] for c in self._configs}
        shard_tables = {s.local_table: s.table for s in self._layout.local[self._rank]}
        for engine in self._engines():
            for name, seen in engine.observed_limits().items():
                table = local[shard_tables.get(name, name)]
                table[0] = max(table[0], seen["max_ids_per_partition"])
                table[1] = max(table[1], seen["max_unique_ids_per_partition"])
        maxima = torch.tensor([local[c.name] for c in self._configs], dtype=torch.int64)
        dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=self._group)
        return {c.name: {"max_ids_per_partition": int(ids), "max_unique_ids_per_partition": int(unique)}
                for c, (ids, unique) in zip(self._configs, maxima.tolist())}

    def _engines(self) -> list[SparseCoreCollection]:
        return [e for e in (self.engine, self.replicas) if e is not None]

    def _peer_group(self) -> dist.ProcessGroup:
        """A new process group of the same ranks (for collectives on another thread or queue)."""
        return dist.new_group(dist.get_process_group_ranks(self._group or dist.group.WORLD))

    def wait_for_updates(self) -> None:
        for engine in self._engines():
            engine.wait_for_updates()

    def local_shards(self) -> list[LocalShard]:
        """This rank's pieces of every table (for checkpoints and checks)."""
        out = []
        for c in self._layout.replicated:
            state = self.replicas.table_optimizer_state(c.name)
            out.append(LocalShard(table=c.name, rows=torch.arange(c.num_embeddings), columns=(0, c.embedding_dim),
                                  weight=self.replicas.table_weight(c.name), state=state))
        for s in self._layout.local[self._rank]:
            ids = s.global_ids()
            valid = ids < s.source.num_embeddings
            state = {k: v[valid] for k, v in self.engine.table_optimizer_state(s.local_table).items()}
            out.append(LocalShard(table=s.table, rows=ids[valid], columns=(s.column_offset, s.width),
                                  weight=self.engine.table_weight(s.local_table)[valid.to(self._device)], state=state))
        return out

    def step_count(self) -> torch.Tensor:
        """The optimizer's step count (every engine of every rank steps once per backward)."""
        self.wait_for_updates()
        engines = [e for e in self._engines() if e._steps]
        return next(iter(engines[0]._steps.values())) if engines else torch.zeros(1, dtype=torch.int64)

    def set_step_count(self, value: torch.Tensor) -> None:
        self.wait_for_updates()
        for engine in self._engines():
            for step in engine._steps.values():
                step.copy_(value)

    @torch.no_grad()
    def set_local_shards_of(self, table: str, shards: list[LocalShard]) -> None:
        """Writes back this rank's pieces of ``table`` (``local_shards()`` entries, same order)."""
        if any(c.name == table for c in self._layout.replicated):
            piece = shards[0]
            self.replicas.set_table_weight(table, piece.weight)
            for name, value in piece.state.items():
                self.replicas.set_table_optimizer_state(table, name, value)
            return
        for s, piece in zip([s for s in self._layout.local[self._rank] if s.table == table], shards):
            valid = s.global_ids() < s.source.num_embeddings

            def full(rows: torch.Tensor) -> torch.Tensor:  # unused rows (past the table's end) stay zero
                out = rows.new_zeros(s.num_rows, *rows.shape[1:])
                out[valid.to(out.device)] = rows
                return out

            self.engine.set_table_weight(s.local_table, full(piece.weight))
            for name, value in piece.state.items():
                self.engine.set_table_optimizer_state(s.local_table, name, full(value))

    def set_deferred_updates(self, enabled: bool = True) -> None:
        """See SparseCoreCollection.set_deferred_updates (the local engines')."""
        for engine in self._engines():
            engine.set_deferred_updates(enabled)

    def prepare(self, features: KeyedJaggedTensor) -> concurrent.futures.Future:
        """What a pipeline calls ahead of ``forward``; here nothing runs ahead (done at once)."""
        return completed(features)

    def prefetch(self, features: KeyedJaggedTensor, prepared: concurrent.futures.Future | None = None) -> None:
        """What a pipeline calls after a backward; here ``forward`` does all its work itself."""

    def close(self) -> None:
        """Waits for the work in flight and stops this module's own threads (before the process
        group goes: their collectives must not outlive it)."""
        self.wait_for_updates()


class ShardedSparseCoreEmbeddingBagCollection(ShardedSparseCoreCollection):
    """The sharded pooled collection (see the module docstring)."""

    def __init__(self, module: SparseCoreEmbeddingBagCollection, plan: ShardingPlan,
                 process_group: dist.ProcessGroup | None = None):
        super().__init__(module, plan, process_group)
        world = plan.world_size
        self._output_dist = OutputDist(self._layout.output_gathers(),
                                       [self._layout.local_width(r) for r in range(world)], process_group, self._rank,
                                       sum(len(c.feature_names) * c.embedding_dim for c in self._layout.replicated))
        self._ahead: tuple[concurrent.futures.ThreadPoolExecutor, InputDist] | None = None  # see prepare
        self._output_group: dist.ProcessGroup | None = None  # see set_deferred_updates
        self._prefetched: tuple[KeyedJaggedTensor, Pending] | None = None
        self._keys = [f for c in self._configs for f in c.feature_names]
        self._dims = [c.embedding_dim for c in self._configs for _ in c.feature_names]

    def embedding_bag_configs(self):
        return [c.config for c in self._configs]

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        return self.forward_async(features).result()

    def _lookups(self, features: KeyedJaggedTensor, local_batch: KeyedJaggedTensor) -> tuple:
        """The local engines' detached lookups (on the executor): the shards' for the global
        batch, the replicas' for ours."""
        shards = self.engine._detached_lookups(local_batch) if self.engine is not None else None
        replicated = None
        if self.replicas is not None:
            own = select(features, {f: f for c in self._layout.replicated for f in c.feature_names})
            replicated = self.replicas._detached_lookups(own)
        return shards, replicated

    def _attached(self, looked_up: tuple, batch_size: int) -> tuple[torch.Tensor, torch.Tensor | None, tuple | None]:
        """The lookups joined to the autograd graph, in the calling thread: (pooled, replicated,
        deferred). With the output exchange's backward deferred, the shards' rows stay off the
        graph: ``deferred`` (for OutputDist) runs their updates after that exchange."""
        shards, replicated = looked_up
        exchange_deferred = self._output_group is not None and torch.is_grad_enabled()
        deferred = None
        if shards is None:
            pooled = torch.zeros(batch_size, 0, device=self._device)
        elif exchange_deferred and self.engine._optimizer is not None:
            batch, looked = shards
            pooled = self.engine._assemble(batch, {name: rows for name, (rows, _) in looked.items()}).values()
            take = functools.partial(self.engine._apply_gradient, {name: coo for name, (_, coo) in looked.items()})
            deferred = (executor_for(self._device), take, self.engine._hyper.clone)
        else:
            pooled = self.engine._assemble(shards[0], self.engine._attach(*shards)).values()
        if exchange_deferred and deferred is None:
            # Nothing to update here, but the backward's exchange must run where the peers' runs.
            deferred = (executor_for(self._device), _no_update, _none)
        if replicated is not None:
            replicated = self.replicas._assemble(replicated[0], self.replicas._attach(*replicated)).values()
        return pooled, replicated, deferred

    def bytes_sent(self) -> dict[str, int]:
        """Bytes this rank has sent to other ranks so far: ids (input) and pooled rows with
        their gradients (output); the replicas' row-gradient exchange is not counted."""
        ahead = self._ahead[1].bytes_sent if self._ahead is not None else 0
        return {"input": self._input_dist.bytes_sent + ahead, "output": self._output_dist.sent.bytes_sent}

    def forward_async(self, features: KeyedJaggedTensor) -> Pending:
        """forward in three parts: the input distribution now, the local lookups on the
        SparseCore executor (TensorCore work issued meanwhile overlaps them), and the output
        distribution when ``result()`` is called. The collectives stay on the calling
        thread, so every rank issues them in the same order."""
        if self._is_weighted:
            refuse_trainable_weights(features, "a sharded collection")
        if self._prefetched is not None and self._prefetched[0] is features:
            pending, self._prefetched = self._prefetched[1], None
            return pending
        return self._start_lookups(features, completed(self._input_dist(features)))

    def _start_lookups(self, features: KeyedJaggedTensor, distributed: concurrent.futures.Future) -> Pending:
        def lookups():
            return self._lookups(features, distributed.result()[0])

        looked_up = run_on(self._device, "lookup", lookups)

        def finish(result) -> KeyedTensor:
            local_batch, batch_sizes = distributed.result()
            pooled, replicated, deferred = self._attached(result, local_batch.stride())
            values = self._output_dist(pooled, batch_sizes, self._rank, replicated, deferred)
            return KeyedTensor(keys=self._keys, length_per_key=self._dims, values=values)

        return Pending(looked_up, finish)

    def prepare(self, features: KeyedJaggedTensor) -> concurrent.futures.Future:
        """Starts the input distribution of a batch ahead of its forward, on a thread and a
        process group of its own, so that it overlaps the current batch's compute without
        interleaving with the collectives of the calling thread. The first call creates
        that group: every rank must make it at the same point (as a pipeline does)."""
        if self._ahead is None:
            input_dist = InputDist(self._layout, self._rank, self._peer_group(), self._is_weighted)
            self._ahead = (threads.worker("sparsecore-input-dist"), input_dist)
        thread, input_dist = self._ahead
        trace = executor_for(self._device).trace if self._device.type == "tpu" else None
        run = trace.wrap(input_dist, "input dist", "input dist") if trace is not None else input_dist
        return thread.submit(run, features)

    def prefetch(self, features: KeyedJaggedTensor, prepared: concurrent.futures.Future | None = None) -> None:
        """Queues the local lookups of ``features`` now (after the deferred updates queued so
        far); the next forward of the same object takes them. ``prepared``: from :meth:`prepare`."""
        if prepared is None:
            prepared = completed(self._input_dist(features))
        self._prefetched = (features, self._start_lookups(features, prepared))

    def close(self) -> None:
        super().close()
        if self._ahead is not None:
            self._ahead[0].shutdown(wait=True)
            self._ahead = None

    def set_deferred_updates(self, enabled: bool = True) -> None:
        """See SparseCoreCollection.set_deferred_updates (the local engines'). Sharded, the
        backward's output exchange is deferred too: it runs on the SparseCore executor, then
        the shards' updates, while the dense backward goes on; the exchanges then use a
        process group of their own (created by the first call, which every rank must make
        at the same point, as TrainPipeline does). Not where the shards' updates exchange
        rows themselves (column-wise row-wise Adagrad): those collectives stay in the
        backward's order."""
        super().set_deferred_updates(enabled)
        exchanging = self.engine is not None and bool(self.engine._row_exchanges)
        if not enabled or exchanging or dist.get_world_size(self._group) == 1 or self._device.type != "tpu":
            self._output_group, self._output_dist.group = None, self._group
            return
        if self._output_group is None:
            self._output_group = self._peer_group()
        self._output_dist.group = self._output_group


def shard(module: SparseCoreCollection, plan: ShardingPlan | None = None,
          process_group: dist.ProcessGroup | None = None) -> ShardedSparseCoreCollection:
    """``module`` sharded over the process group by ``plan`` (default: ``default_plan``): a
    ShardedSparseCoreEmbeddingBagCollection, or for a SparseCoreEmbeddingCollection a
    ShardedSparseCoreEmbeddingCollection (sparsecore.distributed.sequence)."""
    from sparsecore.distributed.sequence import ShardedSparseCoreEmbeddingCollection  # it builds on this module
    from sparsecore.modules import SparseCoreEmbeddingCollection

    kinds = {SparseCoreEmbeddingBagCollection: ShardedSparseCoreEmbeddingBagCollection,
             SparseCoreEmbeddingCollection: ShardedSparseCoreEmbeddingCollection}
    if type(module) not in kinds:
        raise TypeError(f"shard takes a SparseCoreEmbeddingBagCollection or SparseCoreEmbeddingCollection, "
                        f"got {type(module).__name__}")
    if plan is None:
        plan = default_plan(module._configs, dist.get_world_size(process_group))
    return kinds[type(module)](module, plan, process_group)


def _check_same_plan(plan: ShardingPlan, group: dist.ProcessGroup | None) -> None:
    """Raises PlanError on every rank unless every rank of the group passed the same plan
    (ranks sharding by different plans would exchange rows that do not match)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    digest = hashlib.sha256(plan.to_json().encode()).digest()[:8]
    mine = torch.tensor([int.from_bytes(digest, "little", signed=True)], dtype=torch.int64)
    gathered = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    hashes = [int(h) for h in gathered]
    if len(set(hashes)) == 1:
        return
    alike: dict[int, list[int]] = {}
    for rank, h in enumerate(hashes):
        alike.setdefault(h, []).append(rank)
    groups = " vs ".join(str(ranks) for ranks in alike.values())
    raise PlanError(f"the sharding plans differ between ranks: ranks {groups} passed different plans "
                    f"(every rank must shard by the same plan); this is rank {dist.get_rank(group)}")


def _no_update(grad: torch.Tensor, state: object) -> None:
    """A rank without trained shards: the deferred exchange has nothing to update after it."""


def _none() -> None:
    return None
