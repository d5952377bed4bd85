"""Output distribution: the pooled rows each rank computed for the global batch go back to
the ranks whose samples they are, and become the module's columns.

One all_to_all of row blocks carries everything: table- and column-wise
shards' rows, and row-sharded tables' partial sums, which the receiver adds
up (a variable-size reduce-scatter, as ``torch_tpu.distributed.reduce_scatter_v``
builds it, folded into the same exchange). Its backward is the reverse
all_to_all, so the gradient reaches each shard's fused-optimizer backward;
deferred, that exchange and the updates run on the SparseCore executor.
Columns with one source each are placed by one concatenation of column runs
(no gather, no zero column), whose backward fills the send buffer directly.
"""

from __future__ import annotations

import bisect

import torch
import torch.distributed as dist


Run = tuple[int, int, int]
"""(source block, its first column, width): consecutive output columns taken from one block."""


class _RowBlocksAllToAll(torch.autograd.Function):
    """Rows [offset_r, offset_r + send_rows[r]) of x go to rank r; from each rank r come
    ``recv_rows`` rows of its width ``recv_widths[r]``. Returns the received blocks (and
    ``extra``, a local block, after them) side by side, or, given ``runs``, their columns
    in the order the runs say: one concatenation, whose backward builds the send buffer
    of the reverse exchange in one pass."""

    @staticmethod
    def forward(ctx, x, anchor, extra, send_rows, recv_rows, recv_widths, runs, group, counter, deferred=None):
        ctx.shape, ctx.send_rows, ctx.recv_rows, ctx.recv_widths, ctx.group, ctx.counter = (
            x.shape, send_rows, recv_rows, recv_widths, group, counter)
        ctx.runs, ctx.extra_width, ctx.deferred = runs, None if extra is None else extra.shape[1], deferred
        width = x.shape[1]
        counter.add([r * width * x.element_size() for r in send_rows])
        received = _exchange(x.contiguous().view(-1), [r * width for r in send_rows],
                             [recv_rows * w for w in recv_widths], group)
        blocks = [b.view(recv_rows, w) for b, w in zip(received.split([recv_rows * w for w in recv_widths]),
                                                         recv_widths)]
        if extra is not None:
            blocks.append(extra)
        if runs is not None:
            return torch.cat([blocks[b][:, c:c + w] for b, c, w in runs], dim=1)
        return torch.cat(blocks, dim=1) if blocks else x.new_zeros(recv_rows, 0)

    @staticmethod
    def backward(ctx, grad):
        rows, widths = ctx.recv_rows, list(ctx.recv_widths)
        flat = grad.new_empty(rows * sum(widths))
        per_block = [flat_block.view(rows, w) for flat_block, w in zip(flat.split([rows * w for w in widths]), widths)]
        if ctx.extra_width is not None:
            widths.append(ctx.extra_width)
            per_block.append(grad.new_empty(rows, ctx.extra_width))
        if ctx.runs is None:
            for target, piece in zip(per_block, grad.split(widths, dim=1)):
                target.copy_(piece)
        else:
            pieces: list[list[tuple[int, torch.Tensor]]] = [[] for _ in widths]
            column = 0
            for b, c, w in ctx.runs:
                pieces[b].append((c, grad[:, column:column + w]))
                column += w
            for target, parts in zip(per_block, pieces):
                if parts:
                    torch.cat([p for _, p in sorted(parts, key=lambda cp: cp[0])], dim=1, out=target)
        width = ctx.shape[1]
        ctx.counter.add([rows * w * flat.element_size() for w in ctx.recv_widths])
        extra_grad = per_block[-1] if ctx.extra_width is not None else None
        send, recv = [rows * w for w in ctx.recv_widths], [r * width for r in ctx.send_rows]
        if ctx.deferred is not None:
            # The exchange and what needs its result run on the SparseCore executor, in order,
            # while this backward goes on: ``take(gradient of x, snapshot())`` runs there, with
            # what ``snapshot`` took now (e.g. the learning rate of this step).
            executor, take, snapshot = ctx.deferred
            shape, group, state = ctx.shape, ctx.group, snapshot()
            executor.defer("output dist backward",
                           lambda: take(_exchange(flat, send, recv, group).view(shape), state))
            return None, None, extra_grad, *(None,) * 7
        back = _exchange(flat, send, recv, ctx.group)
        return back.view(ctx.shape), None, extra_grad, *(None,) * 7


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


class ByteCounter:
    """Bytes a rank sent to the other ranks (its own block stays home)."""

    def __init__(self, rank: int) -> None:
        self.rank, self.bytes_sent = rank, 0

    def add(self, per_rank: list[int]) -> None:
        self.bytes_sent += sum(b for r, b in enumerate(per_rank) if r != self.rank)


def _exchange(flat: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    out = flat.new_empty(sum(recv))
    dist.all_to_all_single(out, flat, output_split_sizes=recv, input_split_sizes=send, group=group)
    return out


class OutputDist:
    """Turns each rank's (global batch, local width) rows into this rank's (local batch, module width)."""

    def __init__(self, gathers: list[torch.Tensor], widths: list[int], group: dist.ProcessGroup | None, rank: int,
                 replicated_width: int = 0):
        self.gathers, self.widths, self.group = gathers, widths, group
        self.replicated_width = replicated_width
        self._device_gathers: dict[torch.device, list[torch.Tensor | None]] = {}
        # Columns that have one source each (nothing row-sharded): placed by the exchange itself.
        self._runs = column_runs(gathers[0], [*widths, replicated_width]) if len(gathers) == 1 else None
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
        runs = self._runs
        args = (batch_sizes, batch_sizes[rank], self.widths, runs, self.group, self.sent)
        if torch.is_grad_enabled():
            args = (*args, deferred)
            # Makes the exchange part of every rank's graph even where the local rows need
            # no gradient (a rank without shards), so every rank joins its backward.
            if device not in self._anchor:
                self._anchor[device] = torch.zeros(0, device=device, requires_grad=True)
            joined = _RowBlocksAllToAll.apply(pooled, self._anchor[device], replicated, *args)
        else:
            joined = _RowBlocksAllToAll.forward(_NoCtx(), pooled, None, replicated, *args)
        return joined if runs is not None else self._gather(joined)

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
