"""Distributed checkpoint (DCP) of tpu parameters: saved by 2 ranks, loaded by 1 and by 3."""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.testing import assert_close

from tests.distributed.harness import assert_all_ok, run_ranks
from tests.distributed.test_parallel import make_model


def expected_state() -> dict[str, torch.Tensor]:
    """What the checkpoint holds: the model's initial weights, each shifted by its index (not an init any run repeats)."""
    return {k: v.detach() + i for i, (k, v) in enumerate(make_model().state_dict().items())}


def sharded_model(world: int) -> nn.Module:
    model = make_model().to("tpu")
    mesh = init_device_mesh("tpu", (world,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def save_sharded(rank: int, world: int, path: str) -> None:
    model = sharded_model(world)
    with torch.no_grad():
        for i, p in enumerate(model.state_dict().values()):
            p.add_(i)
    dcp.save({"model": model.state_dict()}, checkpoint_id=path)


def load_into(model: nn.Module, path: str) -> nn.Module:
    """Zeroes the model's parameters (so nothing is left from its init), then loads the checkpoint."""
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state["model"])
    assert all(p.device.type == "tpu" for p in model.parameters())
    return model


def load_whole(rank: int, world: int, path: str) -> dict[str, torch.Tensor]:
    return {k: v.cpu() for k, v in load_into(make_model().to("tpu"), path).state_dict().items()}


def load_sharded(rank: int, world: int, path: str) -> dict[str, torch.Tensor]:
    return {k: v.full_tensor().cpu() for k, v in load_into(sharded_model(world), path).state_dict().items()}


def test_dcp_saved_by_two_ranks_loads_on_one_and_on_three(tmp_path):
    path = str(tmp_path / "checkpoint")
    assert_all_ok(run_ranks(save_sharded, 2, path))
    expected = expected_state()
    for world, loader in ((1, load_whole), (3, load_sharded)):
        for state in assert_all_ok(run_ranks(loader, world, path)):
            assert state.keys() == expected.keys()
            for k, v in expected.items():
                assert_close(state[k], v, msg=f"{k} loaded on {world} rank(s)")
