"""Run by test_torchrun under torchrun: env:// rendezvous, one tpu device per local rank."""

import os

import torch
import torch.distributed as dist

dist.init_process_group("tpu_dist")  # MASTER_ADDR/PORT, RANK, WORLD_SIZE from torchrun
rank, world = dist.get_rank(), dist.get_world_size()
assert torch.tpu.current_device() == int(os.environ["LOCAL_RANK"])
x = torch.full((3,), float(rank + 1), device="tpu")
dist.all_reduce(x)
assert x.device == torch.device("tpu", rank)
assert x.cpu().tolist() == [world * (world + 1) / 2] * 3, x
print(f"rank {rank} of {world}: tpu:{torch.tpu.current_device()} ok", flush=True)
dist.destroy_process_group()
