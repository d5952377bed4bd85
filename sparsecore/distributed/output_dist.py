"""Output distribution: the pooled rows each rank computed for the global batch go back to
the ranks whose samples they are, and become the module's columns.

One all_to_all of row blocks carries everything: table- and column-wise
shards' rows, and row-sharded tables' partial sums, which the receiver adds
up (a variable-size reduce-scatter, as ``torch_tpu.distributed.reduce_scatter_v``
builds it, folded into the same exchange). Its backward is the reverse
all_to_all, so the gradient reaches each shard's fused-optimizer backward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class _RowBlocksAllToAll(torch.autograd.Function):
    """Rows [offset_r, offset_r + send_rows[r]) of x go to rank r; from each rank r come
    ``recv_rows`` rows of its width ``recv_widths[r]``. Returns the received blocks side by side."""

    @staticmethod
    def forward(ctx, x, anchor, send_rows, recv_rows, recv_widths, group, counter):
        ctx.shape, ctx.send_rows, ctx.recv_rows, ctx.recv_widths, ctx.group, ctx.counter = (
            x.shape, send_rows, recv_rows, recv_widths, group, counter)
        width = x.shape[1]
        counter.add([r * width * x.element_size() for r in send_rows])
        received = _exchange(x.contiguous().view(-1), [r * width for r in send_rows],
                             [recv_rows * w for w in recv_widths], group)
        blocks = [b.view(recv_rows, w) for b, w in zip(received.split([recv_rows * w for w in recv_widths]),
                                                         recv_widths)]
        return torch.cat(blocks, dim=1) if blocks else x.new_zeros(recv_rows, 0)

    @staticmethod
    def backward(ctx, grad):
        per_rank = grad.split(ctx.recv_widths, dim=1)
        flat = torch.cat([g.contiguous().view(-1) for g in per_rank])
        width = ctx.shape[1]
        ctx.counter.add([ctx.recv_rows * w * flat.element_size() for w in ctx.recv_widths])
        back = _exchange(flat, [ctx.recv_rows * w for w in ctx.recv_widths], [r * width for r in ctx.send_rows],
                         ctx.group)
        return back.view(ctx.shape), None, None, None, None, None, None


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

    def __init__(self, gathers: list[torch.Tensor], widths: list[int], group: dist.ProcessGroup | None, rank: int):
        self.gathers, self.widths, self.group = gathers, widths, group
        self._anchor: dict[torch.device, torch.Tensor] = {}
        self.sent = ByteCounter(rank)
        """Bytes of pooled rows (forward) and their gradients (backward) sent to other ranks."""

    def __call__(self, pooled: torch.Tensor, batch_sizes: list[int], rank: int,
                 replicated: torch.Tensor | None = None) -> torch.Tensor:
        """``replicated``: the rank's own (local batch, width) rows of its replicated tables."""
        device = pooled.device
        args = (batch_sizes, batch_sizes[rank], self.widths, self.group, self.sent)
        if len(batch_sizes) == 1:
            blocks = pooled  # one rank: its rows are already home
        elif torch.is_grad_enabled():
            # Makes the exchange part of every rank's graph even where the local rows need
            # no gradient (a rank without shards), so every rank joins its backward.
            if device not in self._anchor:
                self._anchor[device] = torch.zeros(0, device=device, requires_grad=True)
            blocks = _RowBlocksAllToAll.apply(pooled, self._anchor[device], *args)
        else:
            blocks = _RowBlocksAllToAll.forward(_NoCtx(), pooled, None, *args)
        parts = [blocks] + ([replicated] if replicated is not None else [])
        padded = torch.cat([*parts, blocks.new_zeros(blocks.shape[0], 1)], dim=1)
        out = padded.index_select(1, self.gathers[0].to(device))
        for index in self.gathers[1:]:
            out = out + padded.index_select(1, index.to(device))
        return out


class _NoCtx:
    """Stands in for autograd's ctx when the exchange runs without a graph."""
