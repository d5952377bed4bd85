"""Collectives inside ``torch.compile(backend="tpu", fullgraph=True)``: Dynamo turns
functional collectives (all_reduce, all_gather, reduce_scatter) into ``_c10d_functional`` ops, which the
tpu backend keeps in the graph and runs over tpu_dist as they are, with the dense
ops around them compiled; forward and backward equal the eager step on every rank."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from tests.distributed.harness import assert_all_ok, run_ranks


def step(layer: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    hidden = torch.relu(layer(x))
    summed = funcol.all_reduce(hidden, "sum", dist.group.WORLD)  # the ranks' activations, summed
    gathered = funcol.all_gather_tensor(summed * (dist.get_rank() + 1), 0, dist.group.WORLD)
    part = funcol.reduce_scatter_tensor(gathered.tanh() * 2, "sum", 0, dist.group.WORLD)  # this rank's rows
    return part.square().mean()


def compiled_equals_eager(rank: int, world: int) -> list:
    from tests.test_inductor import has_compiled_segment, record_splits

    device = torch.device("tpu", torch.tpu.current_device())
    torch.manual_seed(0)  # the same weights on every rank, inputs of its own
    layer = torch.nn.Linear(8, 16).to(device)
    x = (torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))).to(device)
    loss = step(layer, x)
    loss.backward()
    eager = [loss.detach().cpu()] + [p.grad.cpu() for p in layer.parameters()]
    layer.zero_grad()

    splits = record_splits()
    compiled = torch.compile(step, backend="tpu", fullgraph=True)
    loss = compiled(layer, x)
    loss.backward()
    got = [loss.detach().cpu()] + [p.grad.cpu() for p in layer.parameters()]
    for a, b in zip(got, eager):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert any(has_compiled_segment(s) for s in splits)  # dense segments compiled around the collectives
    return [t.tolist() for t in got[:1]]


def test_collectives_in_a_compiled_graph_run_over_tpu_dist():
    values = assert_all_ok(run_ranks(compiled_equals_eager, 2, timeout_s=240))
    assert values[0] != values[1]  # each rank's own loss: its own rows of the reduce-scatter
