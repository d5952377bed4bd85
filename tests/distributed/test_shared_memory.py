"""tpu_dist's same-host transport: collectives through shared memory, over many rounds, and its errors.

Tensors here are larger than the slot (TORCH_TPU_DIST_SLOT_BYTES=4096), so every
collective runs over several rounds and both buffer sets; results are checked
against a local computation from every rank's input, and against gloo.
"""

from __future__ import annotations

import glob
import os

import pytest
import torch
import torch.distributed as dist
from torch.testing import assert_close

from tests.distributed.harness import assert_all_ok, run_ranks
from torch_tpu.distributed import all_to_all_columns, group_transport
from torch_tpu.distributed.shared_memory import requested_transport, slot_bytes

SMALL_SLOT = {"TORCH_TPU_DIST_SLOT_BYTES": "4096"}


def rank_input(rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """Distinct on every rank, known to all; small integers so every dtype holds them exactly."""
    gen = torch.Generator().manual_seed(1000 + rank)
    return torch.randint(-8, 9, (n,), generator=gen).to(dtype)


def tpu(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.device("tpu", torch.tpu.current_device()))


def check(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.device.type == "tpu", actual.device
    assert_close(actual.cpu(), expected, rtol=0, atol=0)


def many_rounds(rank: int, world: int) -> str:
    assert group_transport() == "shared_memory"
    n = 5000  # 20 KB of float32: 5 rounds of a 4 KiB slot
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        inputs = torch.stack([rank_input(r, n, dtype) for r in range(world)])
        for op, want in ((dist.ReduceOp.SUM, inputs.sum(0, dtype=dtype)), (dist.ReduceOp.MAX, inputs.amax(0)),
                         (dist.ReduceOp.MIN, inputs.amin(0))):
            x = tpu(inputs[rank])
            dist.all_reduce(x, op=op)
            check(x, want)
    ints = torch.stack([rank_input(r, n, torch.int32) for r in range(world)])
    for op, fold in ((dist.ReduceOp.BAND, torch.bitwise_and), (dist.ReduceOp.BOR, torch.bitwise_or),
                     (dist.ReduceOp.BXOR, torch.bitwise_xor)):
        x = tpu(ints[rank])
        dist.all_reduce(x, op=op)
        want = ints[0]
        for r in range(1, world):
            want = fold(want, ints[r])
        check(x, want)

    floats = torch.stack([rank_input(r, n, torch.float64) for r in range(world)])
    x = tpu(floats[rank])
    dist.all_reduce(x, op=dist.ReduceOp.AVG)
    check(x, floats.sum(0) / world)
    x = tpu(ints[rank].long())
    dist.all_reduce(x, op=dist.ReduceOp.AVG)  # integers divide with truncation
    check(x, torch.div(ints.long().sum(0), world, rounding_mode="trunc"))
    x = tpu(floats[rank] / 8 + 1)
    dist.all_reduce(x, op=dist.ReduceOp.PRODUCT)
    check(x, (floats / 8 + 1).prod(0))

    x = tpu(rank_input(rank, n, torch.float32))
    dist.broadcast(x, src=world - 1)
    check(x, rank_input(world - 1, n, torch.float32))

    gathered = tpu(torch.empty(world * n))
    dist.all_gather_into_tensor(gathered, tpu(rank_input(rank, n, torch.float32)))
    check(gathered, torch.cat([rank_input(r, n, torch.float32) for r in range(world)]))
    # In place, as FSDP2 gathers: the input is this rank's block of the output.
    gathered = tpu(torch.zeros(world * n))
    gathered[rank * n:(rank + 1) * n] = tpu(rank_input(rank, n, torch.float32))
    dist.all_gather_into_tensor(gathered, gathered[rank * n:(rank + 1) * n])
    check(gathered, torch.cat([rank_input(r, n, torch.float32) for r in range(world)]))

    full = torch.stack([rank_input(r, world * n, torch.float32) for r in range(world)])
    out = tpu(torch.empty(n))
    dist.reduce_scatter_tensor(out, tpu(full[rank]))
    check(out, full.sum(0)[rank * n:(rank + 1) * n])

    # Uneven all_to_all of 2-column rows: rank s sends (s + d) * 700 % 2500 rows to rank d,
    # from none to more than a round's share of the slot.
    def rows(s: int, d: int) -> int:
        return (s + d) * 700 % 2500

    sends = [[rows(s, d) for d in range(world)] for s in range(world)]
    sources = [rank_input(s, 2 * sum(sends[s]), torch.float32).reshape(-1, 2) for s in range(world)]
    recv = [sends[s][rank] for s in range(world)]
    out = tpu(torch.empty(sum(recv), 2))
    dist.all_to_all_single(out, tpu(sources[rank]), output_split_sizes=recv, input_split_sizes=sends[rank])
    check(out, torch.cat([sources[s][sum(sends[s][:rank]):sum(sends[s][:rank + 1])] for s in range(world)]))
    return "ok"


@pytest.mark.parametrize("world_size", [2, 3])
def test_collectives_over_many_rounds_match_local_computation(world_size):
    before = set(glob.glob("/dev/shm/torch_tpu_dist_*"))
    assert assert_all_ok(run_ranks(many_rounds, world_size, env=SMALL_SLOT)) == ["ok"] * world_size
    assert set(glob.glob("/dev/shm/torch_tpu_dist_*")) == before  # no segment name outlives its group


def gloo_alone_group() -> dist.ProcessGroup:
    """A tpu_dist group whose ranks use gloo alone (the transport is read when a group is made)."""
    os.environ["TORCH_TPU_DIST_TRANSPORT"] = "gloo"
    try:
        return dist.new_group(backend="tpu_dist")
    finally:
        del os.environ["TORCH_TPU_DIST_TRANSPORT"]


def bits_of_a_step(rank: int, world: int, group: dist.ProcessGroup | None, on=tpu) -> list[torch.Tensor]:
    """What a DDP / FSDP2 / sharded-embedding step's collectives return, on this rank
    (its tensors put on their device by ``on``)."""
    n = 3000
    x = on(rank_input(rank, n, torch.float32) / 3)
    dist.all_reduce(x, group=group)
    gathered = on(torch.empty(world * n))
    dist.all_gather_into_tensor(gathered, on(rank_input(rank, n, torch.float32)), group=group)
    out = on(torch.empty(n))
    dist.reduce_scatter_tensor(out, on(rank_input(rank, world * n, torch.float32) / 7), group=group)
    moved = on(torch.empty(world * 50))
    dist.all_to_all_single(moved, on(rank_input(rank, world * 50, torch.float32)), group=group)
    root = on(rank_input(rank, n, torch.float32))
    dist.broadcast(root, src=1, group=group)
    scaled = on(rank_input(rank, n, torch.float32))  # FSDP2's gradient divide factor
    dist.all_reduce(scaled, op=dist._make_nccl_premul_sum(0.5), group=group)
    return [t.cpu() for t in (x, gathered, out, moved, root, scaled)]


def both_transports(rank: int, world: int) -> tuple[list[str], list[torch.Tensor], list[torch.Tensor]]:
    alone = gloo_alone_group()
    transports = [group_transport(), group_transport(alone)]
    return transports, bits_of_a_step(rank, world, None), bits_of_a_step(rank, world, alone)


def test_shared_memory_and_gloo_agree():
    results = assert_all_ok(run_ranks(both_transports, 2, env=SMALL_SLOT))
    for transports, shared, alone in results:
        assert transports == ["shared_memory", "gloo"]
        for a, b in zip(shared, alone):
            assert_close(a, b)  # sums in another order: equal to rounding
    # Every rank reduces in rank order, so the ranks hold the same bits.
    assert torch.equal(results[0][1][0], results[1][1][0])


def cpu_on_rank_0(rank: int, world: int) -> tuple[list[torch.Tensor], ...]:
    """The step's collectives with every tensor on tpu, then with rank 0's on cpu - as they are
    and under inference mode (its tensors skip the autograd keys); and an all_reduce on a plain
    gloo group of the same processes."""
    on_tpu = bits_of_a_step(rank, world, None)
    on = tpu if rank else (lambda t: t)
    mixed = bits_of_a_step(rank, world, None, on=on)
    with torch.inference_mode():
        mixed_inference = bits_of_a_step(rank, world, None, on=on)
    x = torch.full((3,), float(rank + 1))
    dist.all_reduce(x, group=dist.new_group(backend="gloo"))
    return on_tpu, mixed, mixed_inference, x


def test_a_rank_may_pass_cpu_tensors_where_another_passes_tpu_tensors():
    # Gloo takes both devices, so this is a valid call; the ranks must pick one transport.
    results = assert_all_ok(run_ranks(cpu_on_rank_0, 2, env=SMALL_SLOT, group_timeout_s=20, timeout_s=90))
    half_sum = sum(rank_input(r, 3000, torch.float32) * 0.5 for r in range(2))
    for on_tpu, mixed, mixed_inference, gloo_sum in results:
        for a, b, c in zip(on_tpu, mixed, mixed_inference):
            assert torch.equal(a, b)  # the same transport, the same order of sums: the same bits
            assert torch.equal(a, c)
        assert_close(mixed[-1], half_sum, rtol=0, atol=0)  # PREMUL_SUM(0.5), lowered alike on both devices
        assert_close(gloo_sum, torch.full((3,), 3.0), rtol=0, atol=0)


def call_that_disagrees(rank: int, case: str, group: dist.ProcessGroup) -> None:
    if case == "collective":
        x = tpu(torch.ones(4))
        dist.all_reduce(x, group=group) if rank == 0 else dist.broadcast(x, src=0, group=group)
    elif case == "collective on cpu and tpu":  # rank 0's on cpu tensors: told at once too, not at a timeout
        x = torch.ones(4) if rank == 0 else tpu(torch.ones(4))
        dist.all_reduce(x, group=group) if rank == 0 else dist.broadcast(x, src=0, group=group)
    elif case == "output":  # rank 1's output is too short: it raises, and so must rank 0 (no wait for a timeout)
        dist.all_gather_into_tensor(tpu(torch.empty(8 if rank == 0 else 7)), tpu(torch.ones(4)), group=group)
    elif case == "dtype":
        dist.all_reduce(tpu(torch.ones(4, dtype=torch.float32 if rank == 0 else torch.float64)), group=group)
    else:  # all_to_all splits: rank 0 expects 3 rows from rank 1, which sends 2
        out = tpu(torch.empty(5 if rank == 0 else 4))
        dist.all_to_all_single(out, tpu(torch.ones(4)), output_split_sizes=[2, 3] if rank == 0 else [2, 2],
                               input_split_sizes=[2, 2], group=group)


def calls_disagree(rank: int, world: int) -> dict[str, str]:
    """Each case on a group of its own: the error, then what the next collective on that group says."""
    reports = {}
    for case in DISAGREEMENTS:
        group = dist.new_group(backend="tpu_dist")
        try:
            call_that_disagrees(rank, case, group)
            reports[case] = "completed"
            continue
        except RuntimeError as e:
            first = str(e)
        try:  # the group refuses further work: its ranks are out of step
            dist.all_reduce(tpu(torch.ones(4)), group=group)
            reports[case] = first + "\nTHEN completed"
        except RuntimeError as e:
            reports[case] = first + "\nTHEN " + str(e)
    return reports


DISAGREEMENTS = {
    "output": ["a rank's arguments are wrong, so no rank can complete the collective (rank 1: tpu_dist "
               "all_gather_into_tensor: the output must hold world size (2) times the input's elements"],
    "collective": ["rank 0: all_reduce SUM of Float[4]", "rank 1: broadcast from rank 0 of Float[4]"],
    "collective on cpu and tpu": ["rank 0: all_reduce SUM of Float[4]", "rank 1: broadcast from rank 0 of Float[4]"],
    "dtype": ["rank 0: all_reduce SUM of Float[4]", "rank 1: all_reduce SUM of Double[4]"],
    "splits": ["rank 0: all_to_all_single of Float[4] sending [8, 8] bytes, receiving [8, 12] bytes",
               "rank 1: all_to_all_single of Float[4] sending [8, 8] bytes, receiving [8, 8] bytes"],
}


def test_calls_that_disagree_fail_every_rank_with_each_ranks_call():
    for reports in assert_all_ok(run_ranks(calls_disagree, 2, group_timeout_s=20, timeout_s=90)):
        for case, names in DISAGREEMENTS.items():
            first, then = reports[case].split("\nTHEN ")
            assert case == "output" or "the ranks' calls disagree" in first, first
            for name in names:
                assert name in first, first
            assert "failed earlier and its ranks are out of step" in then, then


def test_transport_settings_are_checked(monkeypatch):
    monkeypatch.setenv("TORCH_TPU_DIST_TRANSPORT", "infiniband")
    with pytest.raises(ValueError, match="TORCH_TPU_DIST_TRANSPORT='infiniband': expected one of auto, gloo"):
        requested_transport()
    monkeypatch.setenv("TORCH_TPU_DIST_SLOT_BYTES", "12k")
    with pytest.raises(ValueError, match="TORCH_TPU_DIST_SLOT_BYTES='12k': expected a whole number of bytes"):
        slot_bytes()
    monkeypatch.setenv("TORCH_TPU_DIST_SLOT_BYTES", "8192")
    assert slot_bytes() == 8192


def shuffled_runs(widths: list[int], seed: int) -> list[list[tuple[int, int]]]:
    """Every block's columns in runs of at most 2, the runs dealt out over the output's columns
    in a shuffled order: per block, its (output column, width) runs in the block's order."""
    pieces = [(b, c, min(2, w - c)) for b, w in enumerate(widths) for c in range(0, w, 2)]
    order = torch.randperm(len(pieces), generator=torch.Generator().manual_seed(seed)).tolist()
    placed: list[list[tuple[int, int, int]]] = [[] for _ in widths]
    column = 0
    for i in order:
        b, c, w = pieces[i]
        placed[b].append((c, column, w))
        column += w
    return [[(at, w) for _, at, w in sorted(block)] for block in placed]


def column_exchanges(rank: int, world: int) -> list[str]:
    """all_to_all_columns on the shared-memory group and on a gloo-alone one, both ways, against
    the blocks cut and placed by hand from every rank's input."""
    batches = [170, 130, 150][:world]  # rows each rank owns: a float32 block spans rounds, mid-row
    widths = [5, 3, 4][:world]   # columns each rank's block has
    starts = [sum(batches[:r]) for r in range(world)]
    runs = shuffled_runs(widths, seed=world)
    alone = gloo_alone_group()
    checked = []
    for dtype in (torch.float32, torch.bfloat16):
        rows_of = [rank_input(r, sum(batches) * widths[r], dtype).view(sum(batches), widths[r]) for r in range(world)]
        mine = slice(starts[rank], starts[rank] + batches[rank])
        joined = torch.empty(batches[rank], sum(widths), dtype=dtype)  # by hand: each block's runs
        for r in range(world):
            at = 0
            for column, width in runs[r]:
                joined[:, column:column + width] = rows_of[r][mine, at:at + width]
                at += width
        grads = [rank_input(10 + r, batches[r] * sum(widths), dtype).view(batches[r], sum(widths))
                 for r in range(world)]
        back = torch.cat([torch.cat([grads[s][:, c:c + w] for c, w in runs[rank]], dim=1) for s in range(world)])
        for transport, group in (("shared_memory", None), ("gloo", alone)):
            assert group_transport(group) == transport
            out = tpu(torch.full((batches[rank], sum(widths)), -1.0, dtype=dtype))
            all_to_all_columns(out, tpu(rows_of[rank]), input_split_sizes=batches, output_columns=runs, group=group)
            check(out, joined)
            out = tpu(torch.empty(sum(batches), widths[rank], dtype=dtype))
            all_to_all_columns(out, tpu(grads[rank]), output_split_sizes=batches, input_columns=runs, group=group)
            check(out, back)
            # No rank sends a column (data-parallel tables fill the output locally): nothing moves.
            out = tpu(torch.full((batches[rank], 3), -1.0, dtype=dtype))
            all_to_all_columns(out, tpu(torch.empty(sum(batches), 0, dtype=dtype)), input_split_sizes=batches,
                               output_columns=[[] for _ in range(world)], group=group)
            check(out, torch.full((batches[rank], 3), -1.0, dtype=dtype))
            checked.append(f"{transport} {dtype}")
    try:  # rank 1 names a column past its output's end: every rank is told, with rank 1's reason
        wrong = [list(r) for r in runs]
        if rank == 1:
            wrong[0] = [(sum(widths) - 1, 3)]
        all_to_all_columns(tpu(torch.empty(batches[rank], sum(widths))), tpu(rows_of[rank].float()),
                           input_split_sizes=batches, output_columns=wrong)
    except RuntimeError as e:
        checked.append(str(e))
    return checked


@pytest.mark.parametrize("world_size", [2, 3])
def test_all_to_all_columns_places_blocks_in_their_columns(world_size):
    columns = 8 if world_size == 2 else 12
    for checked in assert_all_ok(run_ranks(column_exchanges, world_size, env=SMALL_SLOT)):
        assert checked[:4] == [f"{t} {d}" for d in (torch.float32, torch.bfloat16) for t in ("shared_memory", "gloo")]
        assert (f"rank 1: tpu_dist all_to_all_columns: output column run [{columns - 1}, {columns + 2}) lies "
                f"outside its {columns} columns") in checked[4], checked[4:]


def issue_order_and_futures(rank: int, world: int) -> dict:
    # A list all_gather goes to gloo (async); the all_reduce after it rides the channel on the
    # calling thread. It must wait: gloo's order is issue order.
    big = torch.ones(1 << 16, device="tpu")
    works = [dist.all_gather([torch.zeros_like(big) for _ in range(world)], big, async_op=True) for _ in range(4)]
    x = torch.full((4,), float(rank + 1), device="tpu")
    gathered = [torch.zeros(4, device="tpu") for _ in range(world)]
    works.append(dist.all_gather(gathered, x, async_op=True))
    dist.all_reduce(x)
    for w in works:
        w.wait()
    y = torch.ones(3, device="tpu")
    work = dist.all_reduce(y, async_op=True)
    value = work.get_future().wait()[0]
    followed = work.get_future().then(lambda f: f.value()[0] + torch.ones(3, device="tpu")).wait()
    # Integer averages are summed wide: the sums overflow their type, the averages do not.
    averages = {}
    for dtype, values in ((torch.uint8, [200, 100]), (torch.int8, [100, -100]), (torch.int32, [2**30, 2**30 - 2])):
        z = torch.tensor([values[rank], 7 * rank], dtype=dtype, device="tpu")
        dist.all_reduce(z, op=dist.ReduceOp.AVG)
        averages[str(dtype)] = z.cpu()
    return {"gathered": [g.cpu() for g in gathered], "x": x.cpu(), "future_is_callers": value is y,
            "followed": followed.cpu(), "averages": averages}


def test_carried_collectives_keep_issue_order_hand_back_the_callers_tensors_and_average_integers():
    world = 2
    for rank, r in enumerate(assert_all_ok(run_ranks(issue_order_and_futures, world))):
        assert_close(torch.stack(r["gathered"]), torch.tensor([[1.0] * 4, [2.0] * 4]), rtol=0, atol=0)  # pre all_reduce
        assert_close(r["x"], torch.full((4,), 3.0))
        assert r["future_is_callers"], f"rank {rank}: the future holds a host view, not the caller's tensor"
        assert_close(r["followed"], torch.full((3,), 3.0))
        assert_close(r["averages"]["torch.uint8"], torch.tensor([150, 3], dtype=torch.uint8))  # 7 // 2
        assert_close(r["averages"]["torch.int8"], torch.tensor([0, 3], dtype=torch.int8))
        assert_close(r["averages"]["torch.int32"], torch.tensor([2**30 - 1, 3], dtype=torch.int32))


def cpu_issue_order(rank: int, world: int) -> dict:
    # As issue_order_and_futures, with the async gloo collectives on cpu tensors: the later
    # collectives over the channel, on cpu and on tpu tensors, must wait for them too.
    big = torch.ones(1 << 16)
    works = [dist.all_gather([torch.zeros_like(big) for _ in range(world)], big, async_op=True) for _ in range(4)]
    x = torch.full((4,), float(rank + 1))
    gathered = [torch.zeros(4) for _ in range(world)]
    works.append(dist.all_gather(gathered, x, async_op=True))
    dist.all_reduce(x)
    for w in works:
        w.wait()
    works = [dist.all_gather([torch.zeros_like(big) for _ in range(world)], big, async_op=True) for _ in range(4)]
    dist.all_reduce(torch.ones(3, device="tpu"))
    completed = [w.is_completed() for w in works]
    for w in works:
        w.wait()
    works = [dist.all_gather([torch.zeros_like(big) for _ in range(world)], big, async_op=True) for _ in range(4)]
    all_to_all_columns(torch.zeros(2, world, device="tpu"), torch.ones(2 * world, 1, device="tpu"),
                       input_split_sizes=[2] * world, output_columns=[[(r, 1)] for r in range(world)])
    by_columns = [w.is_completed() for w in works]
    for w in works:
        w.wait()
    return {"gathered": [g.clone() for g in gathered], "completed_by_the_tpu_all_reduce": completed,
            "completed_by_all_to_all_columns": by_columns}


def test_async_gloo_collectives_on_cpu_tensors_keep_issue_order():
    for rank, r in enumerate(assert_all_ok(run_ranks(cpu_issue_order, 2))):
        assert_close(torch.stack(r["gathered"]), torch.tensor([[1.0] * 4, [2.0] * 4]), rtol=0, atol=0,
                     msg=lambda m: f"rank {rank}: the all_gather saw the later all_reduce: {m}")
        assert all(r["completed_by_the_tpu_all_reduce"]), (rank, r["completed_by_the_tpu_all_reduce"])
        assert all(r["completed_by_all_to_all_columns"]), (rank, r["completed_by_all_to_all_columns"])


def strided_on_some_ranks(rank: int, world: int, device: str) -> dict:
    # Odd ranks pass column-major (transposed) views of the same shapes; every carried collective
    # must still meet on one transport and write into the caller's views.
    def laid_out(t: torch.Tensor) -> torch.Tensor:
        t = t.to(device)
        return t.t().contiguous().t() if rank % 2 else t

    def value(r: int) -> torch.Tensor:
        return torch.arange(6.0).reshape(2, 3) + 10 * r

    out = {}
    x = laid_out(value(rank))
    dist.all_reduce(x)
    out["all_reduce"] = x.cpu()
    x = laid_out(value(rank))
    dist.broadcast(x, src=world - 1)
    out["broadcast"] = x.cpu()
    gathered = laid_out(torch.zeros(2 * world, 3))
    dist.all_gather_into_tensor(gathered, laid_out(value(rank)))
    out["all_gather"] = gathered.cpu()
    scattered = laid_out(torch.zeros(2, 3))
    dist.reduce_scatter_tensor(scattered, laid_out(torch.cat([value(rank)] * world)))
    out["reduce_scatter"] = scattered.cpu()
    exchanged = laid_out(torch.zeros(2 * world, 3))
    dist.all_to_all_single(exchanged, laid_out(torch.cat([value(rank)] * world)))
    out["all_to_all"] = exchanged.cpu()
    return out


@pytest.mark.parametrize("device", ["cpu", "tpu"])
def test_strided_tensors_on_some_ranks_take_the_same_transport(device):
    world = 2
    values = [torch.arange(6.0).reshape(2, 3) + 10 * r for r in range(world)]
    total = sum(values)
    want = {"all_reduce": total, "broadcast": values[-1], "all_gather": torch.cat(values),
            "reduce_scatter": total, "all_to_all": torch.cat(values)}
    for rank, got in enumerate(assert_all_ok(run_ranks(strided_on_some_ranks, world, device, timeout_s=60))):
        for name, expected in want.items():
            assert_close(got[name], expected, rtol=0, atol=0, msg=lambda m: f"rank {rank} {name}: {m}")


def premul_sum_on_cpu(rank: int, world: int) -> torch.Tensor:
    x = torch.full((3,), float(rank + 1))
    dist.all_reduce(x, op=dist._make_nccl_premul_sum(0.5))
    return x


@pytest.mark.parametrize("transport", ["auto", "gloo"])
def test_premul_sum_on_cpu_tensors_works_on_either_transport(transport):
    # Gloo has no PREMUL_SUM: tpu_dist lowers it whichever transport carries the call.
    results = assert_all_ok(run_ranks(premul_sum_on_cpu, 2, env={"TORCH_TPU_DIST_TRANSPORT": transport}))
    for x in results:
        assert_close(x, torch.full((3,), 1.5), rtol=0, atol=0)


def premul_sum_reduce_scatter_list_on_cpu(rank: int, world: int) -> dict:
    inputs = [torch.arange(3.0) + 10 * rank + 100 * chunk for chunk in range(world)]
    given = [t.clone() for t in inputs]
    out = torch.zeros(3)
    dist.reduce_scatter(out, inputs, op=dist._make_nccl_premul_sum(0.25))
    return {"out": out, "inputs_unchanged": all(torch.equal(a, b) for a, b in zip(inputs, given))}


@pytest.mark.parametrize("transport", ["auto", "gloo"])
def test_premul_sum_list_reduce_scatter_on_cpu_tensors(transport):
    # The list form is never carried by shared memory: gloo refused PREMUL_SUM on cpu tensors.
    world = 2
    results = assert_all_ok(run_ranks(premul_sum_reduce_scatter_list_on_cpu, world,
                                      env={"TORCH_TPU_DIST_TRANSPORT": transport}))
    for rank, r in enumerate(results):
        by_hand = 0.25 * sum(torch.arange(3.0) + 10 * peer + 100 * rank for peer in range(world))
        assert_close(r["out"], by_hand, rtol=0, atol=0)
        assert r["inputs_unchanged"], f"rank {rank}: the caller's inputs were scaled"


def uncarried_on_cpu(rank: int, world: int, group: dist.ProcessGroup | None) -> dict:
    x = torch.arange(4.0) + 10 * rank
    out = {}
    gathered = [torch.zeros(4) for _ in range(world)]
    dist.all_gather(gathered, x, group=group)
    out["all_gather"] = torch.stack(gathered)
    to_root = [torch.zeros(4) for _ in range(world)] if rank == 0 else None
    dist.gather(x, to_root, dst=0, group=group)
    out["gather"] = torch.stack(to_root) if to_root else None
    scattered = torch.zeros(4)
    dist.scatter(scattered, [torch.full((4,), float(r)) for r in range(world)] if rank == 0 else None, src=0,
                 group=group)
    out["scatter"] = scattered
    exchanged = [torch.zeros(2) for _ in range(world)]
    dist.all_to_all(exchanged, [torch.full((2,), float(10 * rank + p)) for p in range(world)], group=group)
    out["all_to_all"] = torch.stack(exchanged)
    objects = [None] * world
    dist.all_gather_object(objects, {"rank": rank}, group=group)
    out["all_gather_object"] = objects
    return out


def uncarried_against_gloo(rank: int, world: int) -> list[str]:
    ours = uncarried_on_cpu(rank, world, None)
    gloo = uncarried_on_cpu(rank, world, dist.new_group(backend="gloo"))
    return [name for name, value in ours.items()
            if not (torch.equal(value, gloo[name]) if torch.is_tensor(value) else value == gloo[name])]


def test_uncarried_collectives_on_cpu_tensors_give_gloo_s_results():
    # They go through the tpu kernel (for PREMUL_SUM and issue order): nothing else may change.
    assert assert_all_ok(run_ranks(uncarried_against_gloo, 2)) == [[], []]
