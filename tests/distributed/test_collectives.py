"""tpu_dist collectives on tpu tensors, each checked against the result computed locally from every rank's input."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.testing import assert_close

from tests.distributed.harness import assert_all_ok, run_ranks
from torch_tpu.distributed import group_transport, reduce_scatter_v


def data(rank: int, n: int = 6, dtype=torch.float32) -> torch.Tensor:
    """Rank ``rank``'s input: distinct on every rank, known to all."""
    return (torch.arange(n, dtype=torch.float64) * (rank + 1) + rank * 0.5 + 1).to(dtype)


def on_tpu(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.device("tpu", torch.tpu.current_device()))


def check(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.device.type == "tpu", actual.device
    assert_close(actual.cpu(), expected)


def all_reduce_ops(rank: int, world: int) -> str:
    inputs = [data(r) for r in range(world)]
    stacked = torch.stack(inputs)
    expected = {
        dist.ReduceOp.SUM: stacked.sum(0),
        dist.ReduceOp.AVG: stacked.mean(0),
        dist.ReduceOp.MAX: stacked.amax(0),
        dist.ReduceOp.MIN: stacked.amin(0),
        dist.ReduceOp.PRODUCT: stacked.prod(0),
    }
    for op, want in expected.items():
        x = on_tpu(data(rank))
        dist.all_reduce(x, op=op)
        check(x, want)
    for factor in (0.25, torch.tensor(3.0)):
        x = on_tpu(data(rank))
        dist.all_reduce(x, op=dist._make_nccl_premul_sum(factor))
        check(x, stacked.sum(0) * float(factor))
    # Integer tensors; a strided view goes through a contiguous copy over shared memory, and is
    # refused on gloo (which would treat it as dense).
    ints = on_tpu(torch.arange(4, dtype=torch.int64) + rank)
    dist.all_reduce(ints)
    check(ints, sum(torch.arange(4, dtype=torch.int64) + r for r in range(world)))
    base = on_tpu(torch.stack([data(rank), data(rank)], dim=1))
    if group_transport() == "shared_memory":
        dist.all_reduce(base[:, 1])
        check(base, torch.stack([data(rank), stacked.sum(0)], dim=1))  # the other column untouched
    else:
        try:
            dist.all_reduce(base[:, 1])
            raise AssertionError("a strided view was reduced")
        except RuntimeError as e:
            assert "contiguous" in str(e), e
        check(base, torch.stack([data(rank), data(rank)], dim=1))
    return "ok"


def movement(rank: int, world: int) -> str:
    x = on_tpu(data(rank))
    dist.broadcast(x, src=world - 1)
    check(x, data(world - 1))

    outs = [on_tpu(torch.empty(6)) for _ in range(world)]
    dist.all_gather(outs, on_tpu(data(rank)))
    for r, o in enumerate(outs):
        check(o, data(r))
    for gather_into in (dist.all_gather_single, dist.all_gather_into_tensor):  # the new name and the old
        flat = on_tpu(torch.empty(world * 6))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            gather_into(flat, on_tpu(data(rank)))
        check(flat, torch.cat([data(r) for r in range(world)]))

    rows = world * 2
    full = [data(r, rows) for r in range(world)]  # rank r's input; rank j gets rows [2j, 2j+2) summed
    out = on_tpu(torch.empty(2))
    dist.reduce_scatter_single(out, on_tpu(full[rank]))
    check(out, sum(f[2 * rank:2 * rank + 2] for f in full))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        dist.reduce_scatter_tensor(out, on_tpu(full[rank]), op=dist.ReduceOp.AVG)
    check(out, sum(f[2 * rank:2 * rank + 2] for f in full) / world)
    source = on_tpu(full[rank])
    dist.reduce_scatter_single(out, source, op=dist._make_nccl_premul_sum(0.5))
    check(out, sum(f[2 * rank:2 * rank + 2] for f in full) * 0.5)
    check(source, full[rank])  # a reduce-scatter's input is left as it was
    out = on_tpu(torch.empty(2))
    dist.reduce_scatter(out, [on_tpu(c) for c in full[rank].split(2)])
    check(out, sum(f[2 * rank:2 * rank + 2] for f in full))

    dst = 0
    x = on_tpu(data(rank))
    dist.reduce(x, dst=dst)
    if rank == dst:
        check(x, sum(data(r) for r in range(world)))
    gathered = [on_tpu(torch.empty(6)) for _ in range(world)] if rank == dst else None
    dist.gather(on_tpu(data(rank)), gathered, dst=dst)
    if rank == dst:
        for r, g in enumerate(gathered):
            check(g, data(r))
    piece = on_tpu(torch.empty(6))
    dist.scatter(piece, [on_tpu(data(10 + r)) for r in range(world)] if rank == dst else None, src=dst)
    check(piece, data(10 + rank))
    return "ok"


def all_to_all(rank: int, world: int) -> str:
    # Even: rank r sends chunk j of its input to rank j.
    chunk = 3
    inputs = [data(r, world * chunk) for r in range(world)]
    out = on_tpu(torch.empty(world * chunk))
    dist.all_to_all_single(out, on_tpu(inputs[rank]))
    check(out, torch.cat([inputs[r][rank * chunk:(rank + 1) * chunk] for r in range(world)]))

    # Uneven, with empty splits: rank r sends (r + j) % 3 rows to rank j (0 included).
    def split(src: int, dst: int) -> int:
        return (src + dst) % 3

    sends = [[split(r, j) for j in range(world)] for r in range(world)]
    uneven = [data(r, sum(sends[r])) for r in range(world)]
    recv = [sends[r][rank] for r in range(world)]
    out = on_tpu(torch.empty(sum(recv), 2))
    source = on_tpu(torch.stack([uneven[rank], -uneven[rank]], dim=1))
    dist.all_to_all_single(out, source, output_split_sizes=recv, input_split_sizes=sends[rank])
    pieces = []
    for r in range(world):
        start = sum(sends[r][:rank])
        rows = uneven[r][start:start + sends[r][rank]]
        pieces.append(torch.stack([rows, -rows], dim=1))
    check(out, torch.cat(pieces))

    # The list form takes equal chunks (as gloo's).
    outs = [on_tpu(torch.empty(chunk)) for _ in range(world)]
    dist.all_to_all(outs, [on_tpu(c) for c in inputs[rank].split(chunk)])
    for r in range(world):
        check(outs[r], inputs[r][rank * chunk:(rank + 1) * chunk])
    return "ok"


def point_to_point_and_async(rank: int, world: int) -> str:
    nxt, prev = (rank + 1) % world, (rank - 1) % world
    got = on_tpu(torch.empty(6))
    if rank % 2 == 0:
        dist.send(on_tpu(data(rank)), dst=nxt)
        dist.recv(got, src=prev)
    else:
        dist.recv(got, src=prev)
        dist.send(on_tpu(data(rank)), dst=nxt)
    check(got, data(prev))
    ops = [dist.P2POp(dist.isend, on_tpu(data(rank + 20)), nxt), dist.P2POp(dist.irecv, got, prev)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    check(got, data(prev + 20))

    works, tensors = [], []
    for i in range(3):
        t = on_tpu(data(rank) * (i + 1))
        works.append(dist.all_reduce(t, async_op=True))
        tensors.append(t)
    for i, (w, t) in enumerate(zip(works, tensors)):
        w.wait()
        assert w.is_completed()
        check(t, sum(data(r) for r in range(world)) * (i + 1))
    work = dist.all_reduce(on_tpu(data(rank)), async_op=True)
    work.get_future().wait()
    dist.barrier()
    return "ok"


def functional(rank: int, world: int) -> str:
    group = dist.group.WORLD
    summed = funcol.all_reduce(on_tpu(data(rank)), "sum", group)
    check(summed, sum(data(r) for r in range(world)))
    gathered = funcol.all_gather_tensor(on_tpu(data(rank)), 0, group)
    check(gathered, torch.cat([data(r) for r in range(world)]))
    full = [data(r, world * 2) for r in range(world)]
    scattered = funcol.reduce_scatter_tensor(on_tpu(full[rank]), "sum", 0, group)
    check(scattered, sum(f[2 * rank:2 * rank + 2] for f in full))
    exchanged = funcol.all_to_all_single(on_tpu(full[rank]), [2] * world, [2] * world, group)
    check(exchanged, torch.cat([full[r][2 * rank:2 * rank + 2] for r in range(world)]))
    return "ok"


def variable_reduce_scatter(rank: int, world: int) -> str:
    splits = [3, 0, 5, 1][:world] if world > 2 else [1, 4]
    rows = sum(splits)
    inputs = [torch.stack([data(r, rows), data(r + 7, rows)], dim=1) for r in range(world)]
    start = sum(splits[:rank])
    own = slice(start, start + splits[rank])
    out = on_tpu(torch.empty(splits[rank], 2))
    reduce_scatter_v(out, on_tpu(inputs[rank]), splits)
    check(out, sum(i[own] for i in inputs))
    work = reduce_scatter_v(out, on_tpu(inputs[rank]), splits, op=dist.ReduceOp.MAX, async_op=True)
    work.wait()
    check(out, torch.stack([i[own] for i in inputs]).amax(0))
    reduce_scatter_v(out, on_tpu(inputs[rank]), splits, op=dist.ReduceOp.AVG)
    check(out, sum(i[own] for i in inputs) / world)
    ints = [(i * 4).to(torch.int32) for i in inputs]
    int_out = on_tpu(torch.empty(splits[rank], 2, dtype=torch.int32))
    reduce_scatter_v(int_out, on_tpu(ints[rank]), splits, op=dist.ReduceOp.AVG)
    check(int_out, torch.div(sum(i[own].long() for i in ints), world, rounding_mode="trunc").int())
    for op, reduce in ((dist.ReduceOp.MIN, lambda t: t.amin(0)), (dist.ReduceOp.PRODUCT, lambda t: t.prod(0))):
        reduce_scatter_v(out, on_tpu(inputs[rank]), splits, op=op)
        check(out, reduce(torch.stack([i[own] for i in inputs])))
    cpu_out = torch.empty(splits[rank], 2)
    reduce_scatter_v(cpu_out, inputs[rank], splits)
    assert_close(cpu_out, sum(i[own] for i in inputs))
    errors = []
    for bad in ([1] * (world + 1), [rows + 1] + [0] * (world - 1)):
        try:
            reduce_scatter_v(out, on_tpu(inputs[rank]), bad)
        except ValueError as e:
            errors.append(str(e))
    assert len(errors) == 2 and "one per rank" in errors[0] and "sum to" in errors[1], errors
    return "ok"


def cpu_and_tpu(rank: int, world: int) -> str:
    cpu = data(rank)
    dist.all_reduce(cpu)
    assert_close(cpu, sum(data(r) for r in range(world)))
    assert dist.get_backend() == "tpu_dist"
    assert torch.tpu.current_device() == rank  # LOCAL_RANK picked the device
    x = on_tpu(data(rank))
    assert x.device == torch.device("tpu", rank)
    dist.all_reduce(x)
    check(x, sum(data(r) for r in range(world)))
    return "ok"


CASES = [all_reduce_ops, movement, all_to_all, point_to_point_and_async, functional, variable_reduce_scatter,
         cpu_and_tpu]


def run_all(rank: int, world: int) -> list[str]:
    return [case(rank, world) for case in CASES]


@pytest.mark.parametrize("world_size", [2, 3])
def test_collectives_match_local_computation(world_size):
    values = assert_all_ok(run_ranks(run_all, world_size))
    assert values == [["ok"] * len(CASES)] * world_size


def test_each_local_process_takes_its_own_device(monkeypatch):
    from torch_tpu.distributed import backend

    previous = torch.tpu.current_device()
    try:
        monkeypatch.setenv("LOCAL_RANK", "1")
        backend._bind_local_device()
        assert torch.tpu.current_device() == 1
        monkeypatch.setenv("LOCAL_RANK", str(torch.tpu.device_count()))
        with pytest.raises(RuntimeError, match=f"LOCAL_RANK={torch.tpu.device_count()} but this host has"):
            backend._bind_local_device()
    finally:
        torch.tpu.set_device(previous)
    assert "tpu_dist" in dist.Backend.backend_list  # registered by importing torch
