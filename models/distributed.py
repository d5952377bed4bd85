"""DLRM training over several ranks: sharded embeddings, data-parallel dense arch.

Under ``torchrun`` (``WORLD_SIZE`` > 1) the trainer joins a ``tpu_dist`` group,
shards the embedding tables by a plan (``sparsecore.distributed``) and wraps
the model in DDP for the dense arch (the sharded tables are left out of DDP:
their fused optimizers update them in the backward). Each rank reads its own
slice of every global batch.

The loss of a step is the sum over the rank's samples divided by the global
batch size, and DDP sums (rather than averages) the dense gradients: both the
dense arch and every embedding row then get the gradient of the global batch's
mean loss, so N ranks train exactly as one process on the same global batch.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import sparsecore.distributed
import sparsecore.distributed.checkpoint
from sparsecore import SparseCoreEmbeddingBagCollection

logger = logging.getLogger(__name__)


def world_from_env() -> tuple[int, int]:
    """(rank, world size), joining the tpu_dist group torchrun's environment describes."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("tpu_dist")
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def load_plan(path: str | None, ebc: SparseCoreEmbeddingBagCollection, world: int) -> sparsecore.distributed.ShardingPlan:
    """The plan in ``path``, or the default plan for these tables."""
    if path is None:
        plan = sparsecore.distributed.default_plan(ebc._configs, world)
    else:
        plan = sparsecore.distributed.ShardingPlan.load(path)
    plan.validate(ebc._configs)
    return plan


def shard_embeddings(model: torch.nn.Module, plan: sparsecore.distributed.ShardingPlan) -> None:
    """Replaces the model's embedding collection with its sharded form (in place)."""
    arch = model.sparse_arch
    arch.embedding_bag_collection = sparsecore.distributed.shard(arch.embedding_bag_collection, plan)


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside a DDP wrapper (FSDP2 and single-process models are not wrapped)."""
    return model.module if isinstance(model, DistributedDataParallel) else model


def _sum_gradients(group, bucket):  # unannotated: DDP checks annotations against the classes, not strings
    """DDP communication hook: the sum over ranks (DDP's default divides by the world size)."""
    work = dist.all_reduce(bucket.buffer(), group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def data_parallel(model: torch.nn.Module) -> DistributedDataParallel:
    """DDP over the dense parameters, summing gradients; the sharded tables stay out of it."""
    sharded = [name for name, _ in model.named_parameters() if name.startswith("sparse_arch.")]
    sharded += [name for name, _ in model.named_buffers() if name.startswith("sparse_arch.")]
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, sharded)
    # No buffer broadcast each forward: the model's buffers are constant index tables.
    ddp = DistributedDataParallel(model, broadcast_buffers=False)
    ddp.register_comm_hook(None, _sum_gradients)
    return ddp


def fully_sharded(model: torch.nn.Module) -> torch.nn.Module:
    """FSDP2 (``fully_shard``) over the dense arch's parts, summing gradients as ``data_parallel``
    does; the sharded tables stay out of it. Build the dense optimizer after this (the
    parameters become DTensors)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    device = next(model.dense_arch.parameters()).device
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for name in ("dense_arch", "inter_arch", "over_arch"):
        part = getattr(model, name)
        if any(p.requires_grad for p in part.parameters()):
            fully_shard(part, mesh=mesh)
            part.set_gradient_divide_factor(1.0)  # a sum: the loss is already over the global batch
    return model


def global_sum(value: torch.Tensor) -> torch.Tensor:
    """The sum of a scalar over the ranks (itself on one process)."""
    if not dist.is_initialized():
        return value
    total = value.detach().clone()
    dist.all_reduce(total)
    return total


def gather(tensor: torch.Tensor) -> torch.Tensor:
    """Every rank's rows of a host tensor, rank order (the tensor itself on one process)."""
    if not dist.is_initialized():
        return tensor
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, torch.tensor([tensor.shape[0]]))
    parts = [tensor.new_empty(int(s), *tensor.shape[1:]) for s in sizes]
    dist.all_gather(parts, tensor)
    return torch.cat(parts)


DENSE_PARTS = ("dense_arch", "inter_arch", "over_arch")


def checkpoint_state(model: torch.nn.Module, dense_optimizer: torch.optim.Optimizer) -> dict:
    """What a sharded run checkpoints (torch.distributed.checkpoint): the embedding tables and
    their optimizer state as plan-independent row blocks (sparsecore.distributed.checkpoint),
    the dense arch (replicated under DDP, DTensors under FSDP2) and its optimizer's state."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    unwrapped = unwrap(model)
    ebc = unwrapped.sparse_arch.embedding_bag_collection
    dense = {f"{part}.{key}": value for part in DENSE_PARTS
             for key, value in getattr(unwrapped, part).state_dict().items()}
    return {"embeddings": sparsecore.distributed.checkpoint.state_dict(ebc), "dense": dense,
            "dense_optimizer": get_optimizer_state_dict(model, dense_optimizer)}


def load_checkpoint_state(model: torch.nn.Module, dense_optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Takes a ``checkpoint_state`` that torch.distributed.checkpoint filled."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    unwrapped = unwrap(model)
    sparsecore.distributed.checkpoint.load_state_dict(unwrapped.sparse_arch.embedding_bag_collection,
                                                      state["embeddings"])
    for part in DENSE_PARTS:
        prefix = f"{part}."
        getattr(unwrapped, part).load_state_dict(
            {k[len(prefix):]: v for k, v in state["dense"].items() if k.startswith(prefix)})
    set_optimizer_state_dict(model, dense_optimizer, state["dense_optimizer"])
