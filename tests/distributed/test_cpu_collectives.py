"""Collectives on cpu tensors of a tpu_dist group that shared memory does not carry
(torch_tpu.distributed.cpu_collectives): the tpu kernel they go through must leave
them as a plain gloo group has them, down to the version counters autograd checks."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests.distributed.harness import assert_all_ok, run_ranks


def versions_after_collectives(rank: int, world: int, group: dist.ProcessGroup | None) -> dict[str, int]:
    """The version counter of a tensor each collective writes (gloo copies some of its outputs in)."""
    out = {}
    gathered = [torch.zeros(3) for _ in range(world)]
    dist.all_gather(gathered, torch.ones(3), group=group)
    out["all_gather"] = gathered[0]._version
    gathered = [torch.zeros(3) for _ in range(world)]
    dist.all_gather(gathered, torch.ones(3), group=group, async_op=True).wait()
    out["all_gather async"] = gathered[0]._version
    to_root = [torch.zeros(3) for _ in range(world)] if rank == 0 else None
    dist.gather(torch.ones(3), to_root, dst=0, group=group)
    out["gather"] = to_root[0]._version if to_root else -1
    scattered = torch.zeros(3)
    dist.scatter(scattered, [torch.ones(3)] * world if rank == 0 else None, src=0, group=group)
    out["scatter"] = scattered._version
    exchanged = [torch.zeros(3) for _ in range(world)]
    dist.all_to_all(exchanged, [torch.ones(3)] * world, group=group)
    out["all_to_all"] = exchanged[0]._version
    coalesced = [torch.zeros(3)]
    dist.all_reduce_coalesced(coalesced, group=group)
    out["all_reduce_coalesced"] = coalesced[0]._version
    return out


def overwritten_saved_tensor(rank: int, world: int, group: dist.ProcessGroup | None) -> str:
    """What backward says of a tensor saved for it that an all_gather then overwrote."""
    a = torch.ones(4, requires_grad=True)
    b = torch.ones(4)
    c = a * b  # saves b
    dist.all_gather([b] + [torch.zeros(4) for _ in range(world - 1)], torch.full((4,), rank + 5.0), group=group)
    try:
        c.sum().backward()
    except RuntimeError as error:
        return "refused" if "modified by an inplace operation" in str(error) else str(error)
    return f"computed {a.grad.tolist()}"  # from the overwritten b: wrong


def against_gloo(rank: int, world: int) -> dict:
    gloo = dist.new_group(backend="gloo")
    return {"versions": (versions_after_collectives(rank, world, None),
                         versions_after_collectives(rank, world, gloo)),
            "backward": (overwritten_saved_tensor(rank, world, None), overwritten_saved_tensor(rank, world, gloo))}


def test_collectives_on_cpu_tensors_bump_versions_as_gloo_does():
    # The tpu kernel ran with ADInplaceOrView excluded: gloo's copies into the outputs bumped
    # no version, and backward used a saved tensor a collective had overwritten.
    for rank, r in enumerate(assert_all_ok(run_ranks(against_gloo, 2, timeout_s=120.0))):
        ours, gloo = r["versions"]
        assert ours == gloo, f"rank {rank}: tpu_dist {ours}, gloo {gloo}"
        assert r["backward"] == ("refused", "refused"), (rank, r["backward"])


def premul_sum_on_tensors_requiring_grad(rank: int, world: int) -> dict:
    # The scaling PREMUL_SUM does in place must not be refused on tensors autograd tracks.
    leaf = torch.full((3,), rank + 1.0, requires_grad=True)
    dist.reduce(leaf, dst=0, op=dist._make_nccl_premul_sum(0.5))
    base = torch.full((2, 3), rank + 1.0, requires_grad=True)
    view = base[1]
    dist.reduce(view, dst=0, op=dist._make_nccl_premul_sum(0.5))
    out = torch.zeros(3)
    inputs = [torch.full((3,), rank + 1.0, requires_grad=True) for _ in range(world)]
    dist.reduce_scatter(out, inputs, op=dist._make_nccl_premul_sum(0.5))
    with torch.inference_mode():
        inference = torch.full((3,), rank + 1.0)
    dist.reduce(inference, dst=0, op=dist._make_nccl_premul_sum(0.5))  # outside inference mode
    return {"leaf": leaf.detach(), "view": view.detach(), "reduce_scatter": out,
            "inputs": [t.detach() for t in inputs], "inference": inference.clone()}


def test_premul_sum_on_cpu_tensors_requiring_grad_and_inference_tensors():
    # Its scaling writes the caller's tensors in place: neither autograd's leaf check nor the
    # inference tensor check may refuse it (gloo's SUM writes them as well).
    results = assert_all_ok(run_ranks(premul_sum_on_tensors_requiring_grad, 2, timeout_s=120.0))
    total = 0.5 * (1.0 + 2.0)
    assert torch.equal(results[0]["leaf"], torch.full((3,), total))
    assert torch.equal(results[0]["view"], torch.full((3,), total))
    assert torch.equal(results[0]["inference"], torch.full((3,), total))
    for rank, r in enumerate(results):
        assert torch.equal(r["reduce_scatter"], torch.full((3,), total)), (rank, r["reduce_scatter"])
        assert all(torch.equal(t, torch.full((3,), rank + 1.0)) for t in r["inputs"]), (rank, r["inputs"])
