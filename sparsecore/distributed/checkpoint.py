"""Distributed checkpoints (torch.distributed.checkpoint) of sharded embedding tables.

What is saved does not depend on the plan: per table, its weight and each
optimizer state as a DTensor of contiguous row blocks over the ranks
(``Shard(0)``), in logical row order, under the keys::

    embedding_bags.<table>.weight          (num_embeddings, dim)
    embedding_bags.<table>.<state>         (num_embeddings, dim) or (num_embeddings,), e.g. momentum
    embedding_bags.<table>.step            the optimizer's step count (replicated)

(``embeddings.`` for a sequence collection, as its state_dict).

DCP reshards contiguous blocks by itself, so a checkpoint loads into any world
size and any plan, and into an unsharded module as plain tensors
(``unsharded_state_dict``), from which ``to_torchrec()`` serves on the CPU.
Between the plan's layout (strided rows of row-wise shards, column slices,
replicas) and the blocks, rows move by all_to_all: every rank knows from the
layout which rows each rank holds, so only values travel, in an agreed order.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from sparsecore.collection import SparseCoreCollection
from sparsecore.distributed.sharded import LocalShard, ShardedSparseCoreCollection

def _key(module, table: str, name: str) -> str:
    return f"{module._weight_prefix}.{table}.{name}"


def _block(rank: int, world: int, rows: int) -> tuple[int, int]:
    """Rows [lo, hi) of rank's contiguous block, as DTensor's Shard(0) splits them."""
    size = -(-rows // world)
    return min(rank * size, rows), min((rank + 1) * size, rows)


class _Pieces:
    """Which rows and columns of a table each rank holds, as every rank computes it."""

    def __init__(self, module: ShardedSparseCoreCollection, table: str):
        layout = module._layout
        self.world = layout.world_size
        config = next(c for c in layout.configs if c.name == table)
        self.rows, self.dim = config.num_embeddings, config.embedding_dim
        self.replicated = config in layout.replicated
        self.by_rank: list[list[tuple[torch.Tensor, int, int]]] = [[] for _ in range(self.world)]
        for rank in range(self.world):
            if self.replicated:
                self.by_rank[rank].append((torch.arange(self.rows), 0, self.dim))
                continue
            for s in layout.local[rank]:
                if s.table == table:
                    ids = s.global_ids()
                    self.by_rank[rank].append((ids[ids < self.rows], s.column_offset, s.width))

    def in_block(self, ids: torch.Tensor, block_rank: int) -> torch.Tensor:
        lo, hi = _block(block_rank, self.world, self.rows)
        return (ids >= lo) & (ids < hi)

    def sends_to_block(self, holder: int, block_rank: int) -> bool:
        # A replica fills only its own rank's block: one copy of each row travels.
        return not self.replicated or holder == block_rank


def _all_to_all(sends: list[torch.Tensor], recv_counts: list[int], like: torch.Tensor, group) -> list[torch.Tensor]:
    out = like.new_empty(sum(recv_counts))
    dist.all_to_all_single(out, torch.cat([s.reshape(-1) for s in sends]) if sends else like.new_empty(0),
                           output_split_sizes=recv_counts, input_split_sizes=[s.numel() for s in sends],
                           group=group)
    return list(out.split(recv_counts))


def _width(value: torch.Tensor, piece_width: int) -> int:
    return 1 if value.dim() == 1 else piece_width


def _to_blocks(module, table: str, mine: list[LocalShard], names: list[str]) -> dict[str, torch.Tensor]:
    """This rank's contiguous block of each named tensor (weight, states) of the table."""
    p, rank, group = _Pieces(module, table), module._rank, module._group
    lo, hi = _block(rank, p.world, p.rows)
    out = {}
    for name in names:
        values = [piece.weight if name == "weight" else piece.state[name] for piece in mine]
        like = values[0] if values else _template(module, table, name)
        sends = []
        for dest in range(p.world):
            parts = []
            if p.sends_to_block(rank, dest):
                for (ids, _, _), v in zip(p.by_rank[rank], values):
                    parts.append(v[p.in_block(ids, dest).to(v.device)].reshape(-1))
            sends.append(torch.cat(parts) if parts else like.new_empty(0))
        counts = []
        for source in range(p.world):
            n = 0
            if p.sends_to_block(source, rank):
                n = sum(int(p.in_block(ids, rank).sum()) * _width(like, w) for ids, _, w in p.by_rank[source])
            counts.append(n)
        received = _all_to_all(sends, counts, like, group)
        block = like.new_zeros(hi - lo, *([p.dim] if like.dim() == 2 else []))
        for source in range(p.world):
            if not p.sends_to_block(source, rank):
                continue
            chunks = received[source]
            offset = 0
            for ids, col, width in p.by_rank[source]:
                picked = ids[p.in_block(ids, rank)] - lo
                n = picked.numel() * _width(like, width)
                values_here = chunks[offset:offset + n]
                offset += n
                if like.dim() == 1:
                    block[picked.to(block.device)] = values_here
                else:
                    block[picked.to(block.device), col:col + width] = values_here.view(-1, width)
        out[name] = block
    return out


def _from_blocks(module, table: str, mine: list[LocalShard], blocks: dict[str, torch.Tensor]) -> None:
    """Writes the table's rows from every rank's blocks into this rank's pieces (in place)."""
    p, rank, group = _Pieces(module, table), module._rank, module._group
    lo, _ = _block(rank, p.world, p.rows)
    for name, block in blocks.items():
        sends = []
        for dest in range(p.world):
            parts = []
            for ids, col, width in p.by_rank[dest]:
                picked = (ids[p.in_block(ids, rank)] - lo).to(block.device)
                rows = block[picked] if block.dim() == 1 else block[picked, col:col + width]
                parts.append(rows.reshape(-1))
            sends.append(torch.cat(parts) if parts else block.new_empty(0))
        counts = [sum(int(p.in_block(ids, source).sum()) * _width(block, w) for ids, _, w in p.by_rank[rank])
                  for source in range(p.world)]
        received = _all_to_all(sends, counts, block, group)
        for i, (ids, _, width) in enumerate(p.by_rank[rank]):
            target = mine[i].weight if name == "weight" else mine[i].state[name]
            for source in range(p.world):
                mask = p.in_block(ids, source)
                n = int(mask.sum()) * _width(block, width)
                chunk, received[source] = received[source][:n], received[source][n:]
                target[mask.to(target.device)] = chunk.view(-1, *target.shape[1:]).to(target)


def _template(module, table: str, name: str) -> torch.Tensor:
    """An empty tensor of the right dtype, rank and device, for a rank holding none of the table."""
    config = next(c for c in module._layout.configs if c.name == table)
    if name == "weight":
        return torch.empty(0, config.embedding_dim, dtype=config.dtype, device=module._device)
    shape, _ = module._optimizer.state(1, config.embedding_dim)[name]
    return torch.empty(0, *shape[1:], dtype=torch.float32, device=module._device)


def _state_names(module) -> list[str]:
    spec = module._optimizer
    return ["weight"] + ([] if spec is None else list(spec.state(1, 1)))


def _mine(module) -> dict[str, list[LocalShard]]:
    """This rank's pieces per table (one copy of every local shard, not one per table)."""
    out: dict[str, list[LocalShard]] = {c.name: [] for c in module._layout.configs}
    for piece in module.local_shards():
        out[piece.table].append(piece)
    return out


def state_dict(module: ShardedSparseCoreCollection) -> dict[str, torch.Tensor]:
    """The module's tables and optimizer state as DTensors of row blocks (see the module docstring);
    pass it to ``dcp.save``, or fill it with ``dcp.load`` and hand it to ``load_state_dict``."""
    mesh = DeviceMesh.from_group(module._group or dist.group.WORLD, module._device.type)
    out: dict[str, torch.Tensor] = {}
    pieces = _mine(module)
    step = None
    if module._optimizer is not None:
        # A rank holding none of a table has no step count of its own (0): DCP keeps one copy of
        # this replicated value, from any rank, so every rank saves the group's (the maximum).
        step = module.step_count().detach().cpu().to(torch.int64).clone()
        dist.all_reduce(step, op=dist.ReduceOp.MAX, group=module._group)
    for c in module._layout.configs:
        blocks = _to_blocks(module, c.name, pieces[c.name], _state_names(module))
        for name, block in blocks.items():
            shape = (c.num_embeddings, *block.shape[1:])
            stride = (block.shape[1], 1) if block.dim() == 2 else (1,)
            out[_key(module, c.name, name)] = DTensor.from_local(block, mesh, [Shard(0)], run_check=False, shape=shape,
                                                         stride=stride)
        if module._optimizer is not None:
            out[_key(module, c.name, "step")] = step.clone()
    return out


def load_state_dict(module: ShardedSparseCoreCollection, state: dict[str, torch.Tensor]) -> None:
    """Takes the state ``dcp.load`` filled (from ``state_dict(module)``) into the module's shards."""
    pieces = _mine(module)
    for c in module._layout.configs:
        mine = pieces[c.name]
        blocks = {}
        for name in _state_names(module):
            value = state[_key(module, c.name, name)]
            blocks[name] = value.to_local() if isinstance(value, DTensor) else value
        _from_blocks(module, c.name, mine, blocks)
        module.set_local_shards_of(c.name, mine)
        if module._optimizer is not None:
            module.set_step_count(state[_key(module, c.name, "step")])


def unsharded_state_dict(module: SparseCoreCollection) -> dict[str, torch.Tensor]:
    """The same keys for an unsharded module, as plain (logical-order) tensors: ``dcp.load``
    fills them from a sharded checkpoint of any world size."""
    out = {}
    for c in module._configs:
        out[_key(module, c.name, "weight")] = module.table_weight(c.name)
        for name, value in module.table_optimizer_state(c.name).items():
            out[_key(module, c.name, name)] = value
        if module._optimizer is not None:
            out[_key(module, c.name, "step")] = module._steps[module._stack_of(c.name).name].clone()
    return out


def load_unsharded_state_dict(module: SparseCoreCollection, state: dict[str, torch.Tensor]) -> None:
    for c in module._configs:
        module.set_table_weight(c.name, state[_key(module, c.name, "weight")])
        for name in module.table_optimizer_state(c.name):
            module.set_table_optimizer_state(c.name, name, state[_key(module, c.name, name)])
        if module._optimizer is not None:
            module._steps[module._stack_of(c.name).name].copy_(state[_key(module, c.name, "step")])
