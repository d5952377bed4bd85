"""A reduce-scatter whose chunks differ in size from rank to rank.

Gloo has none (so TorchRec cannot shard tables row-wise on CPU). Built from
``all_to_all_single``: rank ``j`` receives chunk ``j`` of every rank's input,
``world_size`` blocks of ``input_split_sizes[j]`` rows, and reduces them
locally. The bytes on the wire are a ring reduce-scatter's: each rank sends
all of its input but its own chunk.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

def _average(blocks: torch.Tensor) -> torch.Tensor:
    """The mean of the blocks; integers divide with truncation, as tpu_dist's all_reduce AVG does."""
    total = blocks.sum(dim=0)
    exact = total.is_floating_point() or total.is_complex()
    return total.div_(blocks.size(0), rounding_mode=None if exact else "trunc")


_REDUCTIONS = {
    ReduceOp.SUM: lambda blocks: blocks.sum(dim=0),
    ReduceOp.AVG: _average,
    ReduceOp.PRODUCT: lambda blocks: blocks.prod(dim=0),
    ReduceOp.MIN: lambda blocks: blocks.amin(dim=0),
    ReduceOp.MAX: lambda blocks: blocks.amax(dim=0),
}


class _ReduceAfterWork(dist.Work):
    """The all-to-all's work; waiting on it also reduces the received blocks into the output."""

    def __init__(self, exchange: dist.Work, finish) -> None:
        super().__init__()
        self._exchange, self._finish, self._done = exchange, finish, False

    def wait(self, timeout=None) -> bool:
        if not self._done:
            if timeout is None:
                self._exchange.wait()
            else:
                self._exchange.wait(timeout)
            self._finish()
            self._done = True
        return True

    def is_completed(self) -> bool:
        return self._done


def _check(output: torch.Tensor, input: torch.Tensor, splits: list[int], world: int, rank: int) -> None:
    if len(splits) != world:
        raise ValueError(f"reduce_scatter_v: input_split_sizes has {len(splits)} entries, expected one per rank "
                         f"({world})")
    if any(s < 0 for s in splits) or sum(splits) != input.size(0):
        raise ValueError(f"reduce_scatter_v: input_split_sizes {splits} must be >= 0 and sum to the input's "
                         f"first dimension ({input.size(0)})")
    expected = (splits[rank], *input.shape[1:])
    if tuple(output.shape) != expected:
        raise ValueError(f"reduce_scatter_v: output on rank {rank} has shape {tuple(output.shape)}, expected "
                         f"{expected} (input_split_sizes[{rank}] rows of the input's trailing shape)")
    if output.dtype != input.dtype or output.device != input.device:
        raise ValueError(f"reduce_scatter_v: output ({output.dtype}, {output.device}) and input "
                         f"({input.dtype}, {input.device}) must share dtype and device")


def reduce_scatter_v(
    output: torch.Tensor,
    input: torch.Tensor,
    input_split_sizes: Sequence[int],
    op: ReduceOp.RedOpType = ReduceOp.SUM,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> dist.Work | None:
    """Reduces ``input`` over the group and leaves rank ``r`` its rows ``[offset_r, offset_r + split_r)``.

    Args:
        output: ``(input_split_sizes[rank], *input.shape[1:])``, written with the reduction.
        input: ``(sum(input_split_sizes), ...)``, the same shape on every rank.
        input_split_sizes: rows of the input that go to each rank, in rank order.
        op: ``SUM``, ``AVG``, ``PRODUCT``, ``MIN`` or ``MAX``.
        group: the process group (default: the world).
        async_op: return a work handle instead of waiting.

    Returns:
        A work handle whose ``wait()`` completes the reduction if ``async_op``, else ``None``.
    """
    reduce = _REDUCTIONS.get(op)
    if reduce is None:
        raise ValueError(f"reduce_scatter_v: op {op} is not supported; use one of "
                         f"{', '.join(str(o) for o in _REDUCTIONS)}")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    splits = [int(s) for s in input_split_sizes]
    _check(output, input, splits, world, rank)
    received = input.new_empty((world * splits[rank], *input.shape[1:]))
    exchange = dist.all_to_all_single(received, input.contiguous(), output_split_sizes=[splits[rank]] * world,
                                      input_split_sizes=splits, group=group, async_op=True)

    def finish() -> None:
        output.copy_(reduce(received.view(world, splits[rank], *input.shape[1:])))

    work = _ReduceAfterWork(exchange, finish)
    if async_op:
        return work
    work.wait()
    return None
