"""An all_to_all_single whose blocks, on one side, are columns of a 2-D tensor.

Sharded embeddings send each rank its rows of a (batch, width) tensor and get
back blocks that belong in interleaved columns of the module's output (and the
reverse in the backward). With ``all_to_all_single`` that takes a
concatenation of column slices before or after the exchange: one more pass
over every byte. Here the block exchanged with rank ``p`` is given as column
runs of a 2-D tensor, every row of ``columns[p]`` side by side (row-major), and
a group on shared memory copies it straight between that tensor and the
channel. Groups on gloo do the concatenation around ``all_to_all_single``.
The bytes exchanged are ``all_to_all_single``'s: a peer may call either.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from torch_tpu.distributed.shared_memory import channel_name, group_transport

ColumnRuns = Sequence[Sequence[tuple[int, int]]]
"""Per rank of the group, the (first column, width) runs forming its block, in block order."""


def all_to_all_columns(
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: Sequence[int] | None = None,
    input_split_sizes: Sequence[int] | None = None,
    output_columns: ColumnRuns | None = None,
    input_columns: ColumnRuns | None = None,
    group: dist.ProcessGroup | None = None,
) -> None:
    """``all_to_all_single(output, input, ...)`` where either side (not both) may give, instead of
    its split sizes, the column runs of each rank's block in that 2-D tensor."""
    if output_columns is not None and input_columns is not None:
        raise ValueError("all_to_all_columns: column runs on the output or on the input, not both")
    world = dist.get_world_size(group)
    for name, columns in (("output", output_columns), ("input", input_columns)):
        if columns is not None and len(columns) != world:
            raise ValueError(f"all_to_all_columns: {name}_columns needs one list of runs per rank ({world}), "
                             f"got {len(columns)}")
    if group_transport(group) == "shared_memory":
        torch.ops.torch_tpu._all_to_all_columns(
            output, input, list(output_split_sizes or ()), list(input_split_sizes or ()),
            _triples(output_columns), _triples(input_columns), channel_name(group))
        return
    if input_columns is not None:
        blocks = [gather_columns(input, runs) for runs in input_columns]
        dist.all_to_all_single(output, torch.cat([b.reshape(-1) for b in blocks]), output_split_sizes,
                               [b.numel() for b in blocks], group=group)
    elif output_columns is not None:
        widths = [sum(w for _, w in runs) for runs in output_columns]
        received = input.new_empty(output.shape[0] * sum(widths))
        dist.all_to_all_single(received, input, [output.shape[0] * w for w in widths], input_split_sizes,
                               group=group)
        for flat, runs, width in zip(received.split([output.shape[0] * w for w in widths]), output_columns, widths):
            scatter_columns(output, flat.view(output.shape[0], width), runs)
    else:
        dist.all_to_all_single(output, input, output_split_sizes, input_split_sizes, group=group)


def _triples(columns: ColumnRuns | None) -> list[int] | None:
    """The runs as the op takes them: (rank, column, width) triples; None: no runs on that side."""
    if columns is None:
        return None
    return [x for rank, runs in enumerate(columns) for column, width in runs for x in (rank, column, width)]


def gather_columns(t: torch.Tensor, runs: Sequence[tuple[int, int]]) -> torch.Tensor:
    """The runs' columns of ``t`` side by side."""
    return torch.cat([t[:, c:c + w] for c, w in runs], dim=1) if runs else t.new_empty(t.shape[0], 0)


def scatter_columns(t: torch.Tensor, block: torch.Tensor, runs: Sequence[tuple[int, int]],
                    accumulate: bool = False) -> None:
    """``t``'s runs' columns = (or, accumulating, += ) the block's, in order."""
    at = 0
    for c, w in runs:
        if accumulate:
            t[:, c:c + w] += block[:, at:at + w]
        else:
            t[:, c:c + w].copy_(block[:, at:at + w])
        at += w
