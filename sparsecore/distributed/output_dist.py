"""Output distribution: the pooled rows each rank computed for the global batch go back to
the ranks whose samples they are, and become the module's columns.

One all_to_all of row blocks carries everything: table- and column-wise
shards' rows, and row-sharded tables' partial sums, which the receiver adds
up (a variable-size reduce-scatter, as ``torch_tpu.distributed.reduce_scatter_v``
builds it, folded into the same exchange). Its backward is the reverse
all_to_all, so the gradient reaches each shard's fused-optimizer backward;
deferred, that exchange and the updates run on the SparseCore executor.
The exchange writes each received block straight into the output columns it
belongs in, and its backward reads each rank's gradient straight from them
(``torch_tpu.distributed.all_to_all_columns``): when every column has one
source, the output needs no other pass; with row-sharded tables the blocks
land side by side and are added into their columns. (One rank: the output
is the local blocks, gathered.)
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch_tpu.distributed.all_to_all_columns import all_to_all_columns, gather_columns, scatter_columns


Runs = list[tuple[int, int]]
"""(first output column, width) runs, in the order of a block's columns."""


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where the blocks of the exchange (each rank's, then the replicated tables' own), of
    ``block_widths`` columns, land in the module's ``width`` output columns: ``columns[b]``,
    block b's runs. With row-sharded tables a column has a source per shard (``summed``):
    the blocks add up."""

    columns: list[Runs]
    block_widths: list[int]
    width: int
    summed: bool


class _RowBlocksAllToAll(torch.autograd.Function):
    """Rows [offset_r, offset_r + send_rows[r]) of x go to rank r; from each rank r come
    ``recv_rows`` rows, which land in (or, summed, add to) the output's columns
    ``placement.columns[r]``; ``extra``, a local block, in the last block's. The backward
    sends each rank the gradient of its columns, read straight from the gradient
    (torch_tpu.distributed.all_to_all_columns)."""

    @staticmethod
    def forward(ctx, x, anchor, extra, send_rows, recv_rows, placement, group, counter, deferred=None):
        world, columns = len(send_rows), placement.columns
        ctx.shape, ctx.send_rows, ctx.recv_rows, ctx.columns, ctx.group, ctx.counter = (
            x.shape, send_rows, recv_rows, columns, group, counter)
        ctx.block_widths, ctx.has_extra, ctx.deferred = placement.block_widths, extra is not None, deferred
        counter.add([r * x.shape[1] * x.element_size() for r in send_rows])
        x = x.contiguous()
        if not placement.summed:  # one source a column: the exchange puts every block in place
            out = x.new_empty(recv_rows, placement.width)
            all_to_all_columns(out, x, input_split_sizes=send_rows, output_columns=columns[:world], group=group)
            if extra is not None:
                scatter_columns(out, extra, columns[world])
            return out
        widths = placement.block_widths[:world]
        joined = x.new_empty(recv_rows, sum(widths))  # the blocks side by side
        starts = [sum(widths[:i]) for i in range(world)]
        all_to_all_columns(joined, x, input_split_sizes=send_rows,
                           output_columns=[[(at, w)] for at, w in zip(starts, widths)], group=group)
        out = x.new_zeros(recv_rows, placement.width)
        blocks = [*joined.split(widths, dim=1), *([] if extra is None else [extra])]
        for block, runs in zip(blocks, columns):
            scatter_columns(out, block, runs, accumulate=True)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad, world = grad.contiguous(), len(ctx.send_rows)
        ctx.counter.add([ctx.recv_rows * w * grad.element_size() for w in ctx.block_widths[:world]])
        extra_grad = gather_columns(grad, ctx.columns[world]) if ctx.has_extra else None
        shape, send_rows, columns, group = ctx.shape, ctx.send_rows, ctx.columns[:world], ctx.group

        def exchange() -> torch.Tensor:
            back = grad.new_empty(shape)
            all_to_all_columns(back, grad, output_split_sizes=send_rows, input_columns=columns, group=group)
            return back

        if ctx.deferred is not None:
            # The exchange and what needs its result run on the SparseCore executor, in order,
            # while this backward goes on: ``take(gradient of x, snapshot())`` runs there, with
            # what ``snapshot`` took now (e.g. the learning rate of this step).
            executor, take, snapshot = ctx.deferred
            state = snapshot()
            executor.defer("output dist backward", lambda: take(exchange(), state))
            return None, None, extra_grad, *(None,) * 6
        return exchange(), None, extra_grad, *(None,) * 6


def placement(gathers: list[torch.Tensor], widths: list[int]) -> Placement:
    """The placement of blocks of ``widths`` side by side that the gathers describe (the
    module's output is the sum of the gathers; an index past the blocks is a zero column).
    Every block column serves exactly one output column."""
    total = sum(widths)
    target = [-1] * total  # per block column, its output column
    for gather in gathers:
        for out_column, column in enumerate(gather.tolist()):
            if column < total:
                if target[column] != -1:
                    raise ValueError(f"block column {column} feeds output columns {target[column]} and {out_column}")
                target[column] = out_column
    if -1 in target:
        raise ValueError(f"block column {target.index(-1)} feeds no output column")
    columns: list[Runs] = []
    start = 0
    for width in widths:
        runs: list[list[int]] = []
        for out_column in target[start:start + width]:
            if runs and runs[-1][0] + runs[-1][1] == out_column:
                runs[-1][1] += 1
            else:
                runs.append([out_column, 1])
        columns.append([(c, w) for c, w in runs])
        start += width
    return Placement(columns, list(widths), gathers[0].numel(), summed=len(gathers) > 1)


class ByteCounter:
    """Bytes a rank sent to the other ranks (its own block stays home)."""

    def __init__(self, rank: int) -> None:
        self.rank, self.bytes_sent = rank, 0

    def add(self, per_rank: list[int]) -> None:
        self.bytes_sent += sum(b for r, b in enumerate(per_rank) if r != self.rank)


class OutputDist:
    """Turns each rank's (global batch, local width) rows into this rank's (local batch, module width)."""

    def __init__(self, gathers: list[torch.Tensor], widths: list[int], group: dist.ProcessGroup | None, rank: int,
                 replicated_width: int = 0):
        self.gathers, self.widths, self.group = gathers, widths, group
        self.replicated_width = replicated_width
        self._device_gathers: dict[torch.device, list[torch.Tensor | None]] = {}
        self._placement = placement(gathers, [*widths, replicated_width])
        self._anchor: dict[torch.device, torch.Tensor] = {}
        self.sent = ByteCounter(rank)
        """Bytes of pooled rows (forward) and their gradients (backward) sent to other ranks."""

    def __call__(self, pooled: torch.Tensor, batch_sizes: list[int], rank: int,
                 replicated: torch.Tensor | None = None, deferred: tuple | None = None) -> torch.Tensor:
        """``replicated``: the rank's own (local batch, width) rows of its replicated tables.
        ``deferred``: (executor, take, snapshot): the backward's exchange runs on the
        executor, then ``take(gradient of pooled, snapshot())`` (``snapshot`` called in the
        backward), instead of the gradient reaching ``pooled`` through autograd."""
        device = pooled.device
        if len(batch_sizes) == 1:  # one rank: its rows are already home
            joined = pooled if replicated is None else torch.cat([pooled, replicated], dim=1)
            return self._gather(joined)
        args = (batch_sizes, batch_sizes[rank], self._placement, self.group, self.sent)
        if torch.is_grad_enabled():
            args = (*args, deferred)
            # Makes the exchange part of every rank's graph even where the local rows need
            # no gradient (a rank without shards), so every rank joins its backward.
            if device not in self._anchor:
                self._anchor[device] = torch.zeros(0, device=device, requires_grad=True)
            return _RowBlocksAllToAll.apply(pooled, self._anchor[device], replicated, *args)
        return _RowBlocksAllToAll.forward(_NoCtx(), pooled, None, replicated, *args)

    def _gather(self, joined: torch.Tensor) -> torch.Tensor:
        """The module's columns from the blocks side by side, summing row-sharded sources."""
        first, *more = self._gathers_on(joined.device)
        # Every column has a first source, so the first gather needs no zero column; it is
        # skipped when the blocks already are in the module's column order.
        out = joined if first is None else joined.index_select(1, first)
        if more:  # row-sharded columns: a source per shard, the zero column where a column has fewer
            padded = torch.cat([joined, joined.new_zeros(joined.shape[0], 1)], dim=1)
            for index in more:
                out = out + padded.index_select(1, index)
        return out

    def _gathers_on(self, device: torch.device) -> list[torch.Tensor | None]:
        if device not in self._device_gathers:
            first = self.gathers[0]
            joined_width = sum(self.widths) + self.replicated_width
            identity = first.numel() == joined_width and torch.equal(first, torch.arange(joined_width))
            self._device_gathers[device] = [None if identity else first.to(device),
                                            *(g.to(device) for g in self.gathers[1:])]
        return self._device_gathers[device]


class _NoCtx:
    """Stands in for autograd's ctx when the exchange runs without a graph."""
