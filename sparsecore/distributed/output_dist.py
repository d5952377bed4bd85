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
source, the output needs no other pass; row-sharded columns are then summed
by a gather per source.
"""

from __future__ import annotations

import bisect

import torch
import torch.distributed as dist
from torch_tpu.distributed.all_to_all_columns import all_to_all_columns, gather_columns, scatter_columns


Run = tuple[int, int, int]
"""(source block, its first column, width): consecutive output columns taken from one block."""


class _RowBlocksAllToAll(torch.autograd.Function):
    """Rows [offset_r, offset_r + send_rows[r]) of x go to rank r; from each rank r come
    ``recv_rows`` rows, which land in the output's columns ``columns[r]`` ((first column,
    width) runs, in the order of the block's columns); ``extra``, a local block, lands in
    ``columns[-1]`` when given. The backward sends each rank the gradient of its columns,
    read straight from the gradient (torch_tpu.distributed.all_to_all_columns)."""

    @staticmethod
    def forward(ctx, x, anchor, extra, send_rows, recv_rows, columns, group, counter, deferred=None):
        world = len(send_rows)
        ctx.shape, ctx.send_rows, ctx.recv_rows, ctx.columns, ctx.group, ctx.counter = (
            x.shape, send_rows, recv_rows, columns, group, counter)
        ctx.has_extra, ctx.deferred = extra is not None, deferred
        counter.add([r * x.shape[1] * x.element_size() for r in send_rows])
        out = x.new_empty(recv_rows, sum(w for runs in columns for _, w in runs))
        all_to_all_columns(out, x.contiguous(), input_split_sizes=send_rows, output_columns=columns[:world],
                           group=group)
        if extra is not None:
            scatter_columns(out, extra, columns[world])
        return out

    @staticmethod
    def backward(ctx, grad):
        grad, world = grad.contiguous(), len(ctx.send_rows)
        ctx.counter.add([ctx.recv_rows * sum(w for _, w in runs) * grad.element_size() for runs in ctx.columns[:world]])
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


def column_runs(gather: torch.Tensor, widths: list[int]) -> list[Run] | None:
    """A gather over blocks of ``widths`` side by side, as runs of consecutive columns of one
    block; None unless it takes every column exactly once (then no zero column or sum is needed)."""
    total = sum(widths)
    if gather.numel() != total or not torch.equal(gather.sort().values, torch.arange(total)):
        return None
    starts = [sum(widths[:i]) for i in range(len(widths))]
    runs: list[list[int]] = []
    for g in gather.tolist():
        block = bisect.bisect_right(starts, g) - 1  # the last block starting at or before g: never an empty one
        column = g - starts[block]
        if runs and runs[-1][0] == block and runs[-1][1] + runs[-1][2] == column:
            runs[-1][2] += 1
        else:
            runs.append([block, column, 1])
    return [(b, c, w) for b, c, w in runs]


def block_columns(runs: list[Run] | None, widths: list[int]) -> list[list[tuple[int, int]]]:
    """Per block, the (output column, width) runs its columns land in, in the block's order:
    as ``runs`` place them, or (None) the blocks side by side."""
    if runs is None:
        starts = [sum(widths[:i]) for i in range(len(widths))]
        return [[(start, width)] for start, width in zip(starts, widths)]
    placed: list[list[tuple[int, int, int]]] = [[] for _ in widths]
    column = 0
    for block, first, width in runs:
        placed[block].append((first, column, width))
        column += width
    return [[(at, width) for _, at, width in sorted(block)] for block in placed]


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
        # Columns that have one source each (nothing row-sharded): placed by the exchange itself.
        blocks = [*widths, replicated_width]
        self._runs = column_runs(gathers[0], blocks) if len(gathers) == 1 else None
        self._columns = block_columns(self._runs, blocks)
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
        args = (batch_sizes, batch_sizes[rank], self._columns, self.group, self.sent)
        if torch.is_grad_enabled():
            args = (*args, deferred)
            # Makes the exchange part of every rank's graph even where the local rows need
            # no gradient (a rank without shards), so every rank joins its backward.
            if device not in self._anchor:
                self._anchor[device] = torch.zeros(0, device=device, requires_grad=True)
            joined = _RowBlocksAllToAll.apply(pooled, self._anchor[device], replicated, *args)
        else:
            joined = _RowBlocksAllToAll.forward(_NoCtx(), pooled, None, replicated, *args)
        return joined if self._runs is not None else self._gather(joined)

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
