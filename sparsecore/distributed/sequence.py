"""A SparseCore embedding collection of sequence (unpooled) features, sharded over a process group.

As for the pooled collection (sharded.py), each rank's engine — here a
``SparseCoreEmbeddingCollection`` over its shards — looks up the global
batch's ids routed to it (input_dist.py; ``max_seq_len`` truncates bags on the
sending side, before any id is routed). What goes back is a row per id: one
all_to_all returns to every rank the rows of its own ids, per (shard, feature)
in the order it sent them, and the rank puts them back in its ids' order —
table-wise features as they come, column pieces side by side, row-sharded
features by placing each shard's rows at the positions of the ids it owns
(which the rank knows from its own ids: nothing else travels). The backward is
the reverse all_to_all into each shard's fused-optimizer backward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

from sparsecore.distributed.input_dist import jagged_dict, select
from sparsecore.distributed.layout import Route
from sparsecore.distributed.output_dist import ByteCounter
from sparsecore.distributed.plan import ShardingPlan
from sparsecore.distributed.sharded import ShardedSparseCoreCollection
from sparsecore.modules import SparseCoreEmbeddingCollection
from sparsecore.preprocess import _truncate


class _AllToAll(torch.autograd.Function):
    """A differentiable variable-size all_to_all of a flat tensor (its backward: the reverse)."""

    @staticmethod
    def forward(ctx, flat, anchor, send_sizes, recv_sizes, group, counter):
        ctx.send_sizes, ctx.recv_sizes, ctx.group, ctx.counter = send_sizes, recv_sizes, group, counter
        return _exchange(flat, send_sizes, recv_sizes, group, counter)

    @staticmethod
    def backward(ctx, grad):
        return _exchange(grad.contiguous(), ctx.recv_sizes, ctx.send_sizes, ctx.group, ctx.counter), *(None,) * 5


def _exchange(flat: torch.Tensor, send: list[int], recv: list[int], group, counter: ByteCounter) -> torch.Tensor:
    counter.add([n * flat.element_size() for n in send])
    out = flat.new_empty(sum(recv))
    dist.all_to_all_single(out, flat, output_split_sizes=recv, input_split_sizes=send, group=group)
    return out


def _kjt_of(own: dict[str, tuple[torch.Tensor, torch.Tensor]], stride: int) -> KeyedJaggedTensor:
    """The KJT of per-feature (ids, lengths), with the batch's stride given, not inferred
    (``from_jt_dict`` infers it from the lengths, which a batch of no samples has none of)."""
    empty = [torch.zeros(0, dtype=torch.int64)]  # a batch of no features: an error about them, not cat's
    return KeyedJaggedTensor(keys=list(own), values=torch.cat([v for v, _ in own.values()] or empty),
                             lengths=torch.cat([l for _, l in own.values()] or empty), stride=stride)


class ShardedSparseCoreEmbeddingCollection(ShardedSparseCoreCollection):
    """``forward(local KJT) -> dict[str, JaggedTensor]``, the unsharded module's contract for
    the rank's own samples (see the module docstring)."""

    def __init__(self, module: SparseCoreEmbeddingCollection, plan: ShardingPlan,
                 process_group: dist.ProcessGroup | None = None):
        super().__init__(module, plan, process_group)
        self._max_seq_len = {f: c.max_seq_len for c in self._configs for f in c.feature_names
                             if c.max_seq_len is not None}
        self._routes = self._input_dist.routes
        self._widths = {(s.rank, f): s.width for shards in self._layout.shards.values() for s in shards
                        for f in s.local_features}
        # (rank, local feature) -> (module feature, its route there)
        self._route_of = {(r.rank, r.local_feature): (f, r) for f, routes in self._routes.items() for r in routes}
        self._anchor = torch.zeros(0, device=self._device, requires_grad=True)
        self._sent = ByteCounter(self._rank)

    def embedding_configs(self):
        return [c.config for c in self._configs]

    def bytes_sent(self) -> dict[str, int]:
        """Bytes this rank has sent to other ranks so far: ids (input), rows and their gradients (output)."""
        return {"input": self._input_dist.bytes_sent, "output": self._sent.bytes_sent}

    def forward(self, features: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
        """A rank may have no samples (stride 0): it gets a JaggedTensor of no rows per
        feature, as the unsharded module does, and still takes part in the exchanges."""
        own = self._own_ids(features)
        truncated = _kjt_of(own, features.stride())
        local_batch, batch_sizes = self._input_dist(truncated)
        received = self._exchange_rows(local_batch, batch_sizes, own)
        out: dict[str, JaggedTensor] = {}
        if self.replicas is not None:
            out.update(self.replicas(select(truncated, {f: f for c in self._layout.replicated
                                                        for f in c.feature_names})))
        for feature, routes in self._routes.items():
            values, lengths = own[feature]
            out[feature] = JaggedTensor(values=self._reassemble(routes, received, values),
                                        lengths=lengths.to(self._device))
        return {f: out[f] for c in self._configs for f in c.feature_names}

    def _own_ids(self, features: KeyedJaggedTensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Per feature, this rank's (ids, lengths) on the host, bags cut to their table's
        max_seq_len here, before any id is routed. ``jagged_dict``: TorchRec's ``to_dict``
        fails on a batch of no samples."""
        own = {}
        for feature, jagged in jagged_dict(features).items():
            values, lengths = jagged.values().cpu().long(), jagged.lengths().cpu().long()
            if feature in self._max_seq_len:
                values, lengths = _truncate(values, lengths, self._max_seq_len[feature])
            own[feature] = (values, lengths)
        return own

    def _exchange_rows(self, local_batch: KeyedJaggedTensor, batch_sizes: list[int],
                       own: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> dict[tuple[int, str], torch.Tensor]:
        """Every rank's rows of this rank's ids, per (shard rank, local feature): (ids, width)."""
        world = len(batch_sizes)
        sends: list[list[torch.Tensor]] = [[] for _ in range(world)]
        if self.engine is not None:
            looked_up = self.engine(local_batch)
            for feature in self._layout.local_features(self._rank):
                rows = looked_up[feature].values()
                per_source = local_batch[feature].lengths().cpu().split(batch_sizes)
                for source, block in enumerate(rows.split([int(n.sum()) for n in per_source])):
                    sends[source].append(block.reshape(-1))
        flat = [torch.cat(parts) if parts else torch.zeros(0, device=self._device) for parts in sends]
        expected: list[tuple[int, str, int]] = []  # (shard rank, local feature, ids of mine it got)
        for rank in range(world):
            for local_feature in self._layout.local_features(rank):
                expected.append((rank, local_feature, self._ids_routed(rank, local_feature, own)))
        recv = [0] * world
        for rank, local_feature, count in expected:
            recv[rank] += count * self._widths[(rank, local_feature)]
        exchanged = _AllToAll.apply(torch.cat(flat), self._anchor, [f.numel() for f in flat], recv, self._group,
                                    self._sent)
        sizes = [count * self._widths[(rank, lf)] for rank, lf, count in expected]
        return {(rank, lf): piece.view(count, self._widths[(rank, lf)])
                for (rank, lf, count), piece in zip(expected, exchanged.split(sizes))}

    def _ids_routed(self, rank: int, local_feature: str, own: dict) -> int:
        """How many of this rank's ids went to ``local_feature`` on ``rank``."""
        feature, route = self._route_of[(rank, local_feature)]
        values = own[feature][0]
        if route.rows is None:
            return values.numel()
        return int((route.rows.shard_of(values) == route.shard).sum())

    def _reassemble(self, routes: list[Route], received: dict, values: torch.Tensor) -> torch.Tensor:
        """A feature's rows in its ids' order, from the pieces its routes brought back."""
        pieces = [received[(r.rank, r.local_feature)] for r in routes]
        if routes[0].rows is None:  # whole rows, or column pieces in column order
            return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1)
        owner = routes[0].rows.shard_of(values)
        order = torch.cat([torch.nonzero(owner == r.shard).flatten() for r in routes])
        return torch.cat(pieces).index_select(0, torch.argsort(order).to(self._device))
