"""DDP, FSDP2 and DTensor on tpu parameters over tpu_dist, against single-process training on the CPU."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.nn.parallel import DistributedDataParallel
from torch.testing import assert_close

from tests.distributed.harness import assert_all_ok, run_ranks

BATCH = 12  # divisible by 2 and 3: every rank's shard is the same size, so mean-of-means is the full mean
STEPS = 3


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 4, generator=g)) for _ in range(STEPS)]


def reference(optimizer_cls, loss_scale: float = 1.0, **kwargs) -> dict[str, torch.Tensor]:
    """The same training on the full batch, one CPU process, no distribution at all."""
    model = make_model()
    opt = optimizer_cls(model.parameters(), **kwargs)
    for x, y in batches():
        opt.zero_grad()
        (loss_scale * nn.functional.mse_loss(model(x), y)).backward()
        opt.step()
    return {k: v.detach() for k, v in model.state_dict().items()}


def local_batch(x: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    tpu = torch.device("tpu", torch.tpu.current_device())
    return x.chunk(world)[rank].to(tpu)


def train_ddp(rank: int, world: int) -> dict[str, torch.Tensor]:
    model = DistributedDataParallel(make_model().to("tpu"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in batches():
        opt.zero_grad()
        nn.functional.mse_loss(model(local_batch(x, rank, world)), local_batch(y, rank, world)).backward()
        opt.step()
    assert all(p.device.type == "tpu" for p in model.parameters())
    return {k: v.detach().cpu() for k, v in model.module.state_dict().items()}


def train_fsdp2(rank: int, world: int, divide_factor: float | None = None) -> dict[str, torch.Tensor]:
    mesh = init_device_mesh("tpu", (world,))
    model = make_model().to("tpu")
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if divide_factor is None:
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
    else:  # a factor other than the world size: FSDP2 reduce-scatters with PREMUL_SUM(1 / factor)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(divide_factor)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for x, y in batches():
        opt.zero_grad()
        nn.functional.mse_loss(model(local_batch(x, rank, world)), local_batch(y, rank, world)).backward()
        opt.step()
    state = {}
    for k, v in model.state_dict().items():
        assert v.device.type == "tpu" and v.placements == (Shard(0),), (k, v.device, v.placements)
        state[k] = v.full_tensor().cpu()
    return state


def dtensor_redistribute(rank: int, world: int) -> str:
    mesh = init_device_mesh("tpu", (world,))
    g = torch.Generator().manual_seed(2)
    full, weight = torch.randn(6, 9, generator=g), torch.randn(9, 5, generator=g)
    rows = distribute_tensor(full.to("tpu"), mesh, [Shard(0)])
    assert rows.to_local().device.type == "tpu"
    assert_close(rows.to_local().cpu(), full.tensor_split(world)[rank])
    replicated = rows.redistribute(mesh, [Replicate()])
    assert_close(replicated.to_local().cpu(), full)
    columns = replicated.redistribute(mesh, [Shard(1)])
    assert_close(columns.to_local().cpu(), full.tensor_split(world, dim=1)[rank])
    assert_close(columns.full_tensor().cpu(), full)
    # A sharded matmul: row-sharded input times replicated weight, then column-sharded
    # input times row-sharded weight (a partial sum reduced by all_reduce).
    w = distribute_tensor(weight.to("tpu"), mesh, [Replicate()])
    assert_close((rows @ w).full_tensor().cpu(), full @ weight)
    w_rows = distribute_tensor(weight.to("tpu"), mesh, [Shard(0)])
    product = columns @ w_rows
    assert_close(product.redistribute(mesh, [Replicate()]).to_local().cpu(), full @ weight)
    return "ok"


@pytest.mark.parametrize("world_size", [2, 3])
def test_ddp_equals_single_process_training(world_size):
    expected = reference(torch.optim.SGD, lr=0.1)
    for state in assert_all_ok(run_ranks(train_ddp, world_size)):
        for k, v in expected.items():
            assert_close(state[k], v, msg=k)


@pytest.mark.parametrize("world_size", [2, 3])
def test_fsdp2_equals_unsharded_training(world_size):
    expected = reference(torch.optim.Adam, lr=0.01)
    for state in assert_all_ok(run_ranks(train_fsdp2, world_size)):
        for k, v in expected.items():
            assert_close(state[k], v, msg=k)


@pytest.mark.parametrize("world_size", [2, 3])
def test_fsdp2_with_a_gradient_divide_factor_reduces_with_premul_sum(world_size):
    # Gradients summed over ranks times 1 / (world / 2): twice the full batch's mean gradient.
    expected = reference(torch.optim.SGD, loss_scale=2.0, lr=0.05)
    for state in assert_all_ok(run_ranks(train_fsdp2, world_size, world_size / 2)):
        for k, v in expected.items():
            assert_close(state[k], v, msg=k)


@pytest.mark.parametrize("world_size", [2, 3])
def test_dtensor_shard_replicate_redistribute(world_size):
    assert assert_all_ok(run_ranks(dtensor_redistribute, world_size)) == ["ok"] * world_size
