"""Sharded SparseCore embedding bags over tpu_dist against the unsharded module on the global batch.

Every rank feeds its own samples (uneven batch sizes, empty bags, a feature
empty on a whole rank); the reference is one unsharded module on the CPU fed
every rank's samples end to end. Outputs per step, then weights and optimizer
state after the steps, must agree.
"""

from __future__ import annotations

import pytest
import torch
from torchrec import EmbeddingBagConfig, PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from torch.testing import assert_close

import sparsecore
from sparsecore import optim
from sparsecore.distributed import ShardingPlan, TableSharding, shard
from sparsecore.distributed.output_dist import placement
from tests.distributed.harness import assert_all_ok, run_ranks

STEPS = 3


def tables() -> list[sparsecore.SparseCoreEmbeddingConfig]:
    def bag(name, rows, dim, features, pooling=PoolingType.SUM, **extra):
        return sparsecore.SparseCoreEmbeddingConfig(
            config=EmbeddingBagConfig(name=name, num_embeddings=rows, embedding_dim=dim, feature_names=features,
                                      pooling=pooling), **extra)

    return [
        bag("big", 50, 8, ["f_big"]),
        bag("shared", 9, 8, ["f_a", "f_b"], PoolingType.MEAN),
        bag("tiny", 3, 4, ["f_tiny"]),  # fewer rows than SparseCores of one rank
        bag("wide", 30, 16, ["f_wide"], combiner="sqrtn"),
    ]


def initial_weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {t.name: torch.randn(t.num_embeddings, t.embedding_dim, generator=g) for t in tables()}


def local_batch(rank: int, step: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Rank ``rank``'s samples at ``step``: 3 + rank of them; f_tiny is empty on rank 1."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    batch = 3 + rank
    out = {}
    for t in tables():
        for f in t.feature_names:
            lengths = torch.randint(0, 4, (batch,), generator=g)
            if f == "f_tiny" and rank == 1:
                lengths.zero_()
            out[f] = (lengths, torch.randint(0, t.num_embeddings, (int(lengths.sum()),), generator=g))
    return out


def kjt_of(batches: list[dict[str, tuple[torch.Tensor, torch.Tensor]]]) -> KeyedJaggedTensor:
    """The samples of the given batches end to end, as one KJT."""
    keys = [f for t in tables() for f in t.feature_names]
    return KeyedJaggedTensor(keys=keys, values=torch.cat([b[f][1] for f in keys for b in batches]),
                             lengths=torch.cat([b[f][0] for f in keys for b in batches]))


def output_grad(rank: int, step: int, width: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7000 + 100 * step + rank)
    return torch.randn(3 + rank, width, generator=g)


def make_module(optimizer, device) -> sparsecore.SparseCoreEmbeddingBagCollection:
    module = sparsecore.SparseCoreEmbeddingBagCollection(tables(), optimizer, device)
    for name, w in initial_weights().items():
        module.set_table_weight(name, w)
    return module


def train_sharded(rank: int, world: int, plan_json: str, optimizer) -> dict:
    module = shard(make_module(optimizer, "tpu"), ShardingPlan.from_json(plan_json))
    outputs = []
    for step in range(STEPS):
        out = module(kjt_of([local_batch(rank, step)]))
        assert out.keys() == [f for t in tables() for f in t.feature_names]
        assert out.values().device.type == "tpu"
        outputs.append(out.values().detach().cpu())
        out.values().backward(output_grad(rank, step, out.values().shape[1]).to("tpu"))
    shards = [(s.table, s.rows, s.columns, s.weight.cpu(), {k: v.cpu() for k, v in s.state.items()})
              for s in module.local_shards()]
    return {"outputs": outputs, "shards": shards}


def assert_shards_match(shards: list, ref) -> None:
    """Every shard's weights and optimizer state equal the reference module's rows and columns."""
    for table, rows, (first, width), weight, state in shards:
        columns = slice(first, first + width)
        assert_close(weight, ref.table_weight(table)[rows][:, columns], msg=lambda m: f"{table}: {m}")
        for name, value in ref.table_optimizer_state(table).items():
            want = value[rows] if value.dim() == 1 else value[rows][:, columns]
            assert_close(state[name], want, msg=lambda m: f"{table} {name}: {m}")


def reference(world: int, optimizer) -> tuple[list[torch.Tensor], sparsecore.SparseCoreEmbeddingBagCollection]:
    module = make_module(optimizer, "cpu")
    outputs = []
    for step in range(STEPS):
        out = module(kjt_of([local_batch(r, step) for r in range(world)]))
        outputs.append(out.values().detach())
        width = out.values().shape[1]
        out.values().backward(torch.cat([output_grad(r, step, width) for r in range(world)]))
    return outputs, module


def plan_for(kind: str, world: int) -> ShardingPlan:
    last = world - 1
    every = tuple(range(world))
    if kind == "table_wise":
        shardings = {"big": ("table_wise", (0,)), "shared": ("table_wise", (last,)),
                     "tiny": ("table_wise", (1 % world,)), "wide": ("table_wise", (0,))}
    elif kind == "row_wise":
        shardings = {name: ("row_wise", every) for name in ("big", "shared", "tiny", "wide")}
    elif kind == "column_wise":
        shardings = {"big": ("column_wise", every[:2], (4, 4)), "shared": ("column_wise", (last, 0), (3, 5)),
                     "tiny": ("table_wise", (last,)),
                     "wide": ("column_wise", every, (4, 4, 8) if world == 3 else (10, 6))}
    elif kind == "table_row_wise":
        hosts = ((0,), (1,)) if world == 2 else ((0, 1), (2,))
        shardings = {"big": ("table_row_wise", hosts[0]), "shared": ("table_row_wise", hosts[1]),
                     "tiny": ("table_row_wise", hosts[0]), "wide": ("row_wise", every)}
        return ShardingPlan(world_size=world, hosts=hosts, tables={
            name: TableSharding(sharding_type=s[0], ranks=s[1]) for name, s in shardings.items()})
    elif kind == "data_parallel":
        shardings = {"big": ("data_parallel", every), "shared": ("row_wise", every),
                     "tiny": ("data_parallel", every), "wide": ("table_wise", (last,))}
    else:  # the default plan
        return sparsecore.distributed.default_plan(tables(), world)
    return ShardingPlan(world_size=world, tables={
        name: TableSharding(sharding_type=s[0], ranks=s[1], column_widths=s[2] if len(s) > 2 else None)
        for name, s in shardings.items()})


OPTIMIZERS = {
    "table_wise": optim.RowWiseAdagrad(lr=0.1),
    "row_wise": optim.Adam(lr=0.05),
    "column_wise": optim.RowWiseAdagrad(lr=0.1),  # its row statistic spans the column shards
    "column_wise_adagrad": optim.Adagrad(lr=0.1),
    "table_row_wise": optim.RowWiseAdagrad(lr=0.1),
    "data_parallel": optim.Adam(lr=0.05),
    "default": optim.SGD(lr=0.1),
}


# Three ranks (uneven splits) for every kind under `make test-all`; CI keeps two of them.
CASES = [(kind, 2) for kind in OPTIMIZERS] + [
    (kind, 3) if kind in ("default", "row_wise") else pytest.param(kind, 3, marks=pytest.mark.slow)
    for kind in OPTIMIZERS] + [("table_wise", 1), ("data_parallel", 1)]


@pytest.mark.parametrize("kind, world", CASES)
def test_sharded_training_equals_unsharded(kind, world):
    optimizer = OPTIMIZERS[kind]
    plan = plan_for(kind.removesuffix("_adagrad"), world)
    plan.validate(tables())
    results = assert_all_ok(run_ranks(train_sharded, world, plan.to_json(), optimizer))
    expected_outputs, ref = reference(world, optimizer)
    starts = [sum(3 + r for r in range(rank)) for rank in range(world)]
    for rank, result in enumerate(results):
        for step, out in enumerate(result["outputs"]):
            assert_close(out, expected_outputs[step][starts[rank]:starts[rank] + 3 + rank],
                         msg=lambda m: f"rank {rank} step {step}: {m}")
    covered = {t.name: torch.zeros(t.num_embeddings, t.embedding_dim, dtype=torch.int64) for t in tables()}
    for result in results:
        assert_shards_match(result["shards"], ref)
        for table, rows, (first, width), *_ in result["shards"]:
            covered[table][rows, first:first + width] += 1
    for table, count in covered.items():
        copies = world if plan.tables[table].sharding_type == "data_parallel" else 1
        assert bool((count == copies).all()), f"{table}: every element held by exactly {copies} shard(s)"


BIG_ROWS, BIG_DIM = 200_000, 32
BIG_BYTES = BIG_ROWS * BIG_DIM * 4


def big_tables() -> list[EmbeddingBagConfig]:
    return [EmbeddingBagConfig(name=f"big{i}", num_embeddings=BIG_ROWS, embedding_dim=BIG_DIM,
                               feature_names=[f"f{i}"], init_fn=torch.nn.init.ones_) for i in range(2)]


def memory_of_shards(rank: int, world: int, kind: str) -> dict:
    module = sparsecore.SparseCoreEmbeddingBagCollection(big_tables(), optim.SGD(lr=0.1), device="meta")
    torch.tpu.reset_peak_memory_stats()
    before = torch.tpu.memory_allocated()
    ranks = {"table_wise": lambda i: (i,), "row_wise": lambda i: (0, 1)}[kind]
    plan = ShardingPlan(world_size=world, tables={
        f"big{i}": TableSharding(sharding_type=kind, ranks=ranks(i)) for i in range(2)})
    sharded = shard(module, plan)
    held, peak = torch.tpu.memory_allocated() - before, torch.tpu.max_memory_allocated() - before
    weights = [s.weight for s in sharded.local_shards()]
    return {"held": held, "peak": peak, "rows": sum(w.shape[0] for w in weights),
            "ones": all(bool((w == 1).all()) for w in weights)}  # init_fn ran on the local shards


@pytest.mark.parametrize("kind", ["table_wise", "row_wise"])
def test_a_meta_module_materializes_only_the_local_shards(kind):
    for result in assert_all_ok(run_ranks(memory_of_shards, 2, kind)):
        assert result["rows"] == BIG_ROWS  # one table, or half of each
        assert result["ones"]
        # What stays is this rank's shards (half the model); the peak adds one table-shard-sized
        # buffer that init_fn fills before its rows go to their SparseCores, and the row index.
        assert BIG_BYTES <= result["held"] < 1.1 * BIG_BYTES, result
        assert result["peak"] < 2.5 * BIG_BYTES, result


def column_shards_sharing_a_rank(rank: int, world: int) -> str:
    plan = ShardingPlan(world_size=world, tables={
        t.name: TableSharding(sharding_type="column_wise", ranks=(0, 0), column_widths=(t.embedding_dim // 2,) * 2)
        for t in tables()})
    try:
        shard(make_module(optim.RowWiseAdagrad(lr=0.1), "tpu"), plan)
    except NotImplementedError as e:
        return str(e)
    return "sharded"


def test_row_wise_adagrad_on_column_shards_sharing_a_rank_is_refused_clearly():
    for message in assert_all_ok(run_ranks(column_shards_sharing_a_rank, 2)):
        assert "row-wise Adagrad with two column shards on one rank" in message, message


def a_rank_dies_mid_training(rank: int, world: int) -> str:
    import os
    import time

    module = shard(make_module(optim.SGD(lr=0.1), "tpu"), plan_for("row_wise", world))
    module(kjt_of([local_batch(rank, 0)])).values().sum().backward()
    if rank == 1:
        os._exit(3)
    started = time.monotonic()
    try:
        module(kjt_of([local_batch(rank, 1)]))
    except RuntimeError as e:
        return f"{time.monotonic() - started:.1f}s {e}"
    return "completed"


def test_a_rank_failure_surfaces_as_an_error_not_a_hang():
    results = run_ranks(a_rank_dies_mid_training, 2, group_timeout_s=5.0, timeout_s=60)
    assert results[1].exitcode == 3
    assert results[0].ok, results[0].error
    seconds, message = results[0].value.split("s ", 1)
    # gloo's words for a dead peer, or the shared-memory channel's (which checks the process).
    assert float(seconds) < 10 and any(w in message for w in ("closed", "reset", "exited")), results[0].value


def lr_after(step: int) -> float:
    return 0.05 * 0.5 ** (step + 1)


def train_deferred(rank: int, world: int, plan_json: str, optimizer) -> dict:
    """As TrainPipeline runs it: updates (and the backward's output exchange) deferred onto the
    executor; the learning rate changes after every backward while that work is held back."""
    import threading

    from sparsecore.executor import executor_for

    module = shard(make_module(optimizer, "tpu"), ShardingPlan.from_json(plan_json))
    module.set_deferred_updates(True)
    executor = executor_for(module._device)
    outputs = []
    for step in range(STEPS):
        out = module(kjt_of([local_batch(rank, step)]))
        outputs.append(out.values().detach().cpu())
        gate = threading.Event()
        executor.submit(gate.wait, 10)
        out.values().backward(output_grad(rank, step, out.values().shape[1]).to("tpu"))
        for group in module.fused_optimizer.param_groups:  # shards' and replicas' alike
            group["lr"] = lr_after(step)
        gate.set()
    shards = [(s.table, s.rows, s.columns, s.weight.cpu(), {k: v.cpu() for k, v in s.state.items()})
              for s in module.local_shards()]  # reading waits for the deferred work
    return {"outputs": outputs, "shards": shards}


@pytest.mark.parametrize("kind", ["table_wise", "row_wise", "data_parallel"])
def test_deferred_updates_and_exchanges_train_as_unsharded(kind):
    optimizer = optim.Adam(lr=0.05)
    plan = plan_for(kind, 2)
    results = assert_all_ok(run_ranks(train_deferred, 2, plan.to_json(), optimizer))
    ref = make_module(optimizer, "cpu")
    expected = []
    for step in range(STEPS):
        out = ref(kjt_of([local_batch(r, step) for r in range(2)]))
        expected.append(out.values().detach())
        out.values().backward(torch.cat([output_grad(r, step, out.values().shape[1]) for r in range(2)]))
        ref.fused_optimizer.param_groups[0]["lr"] = lr_after(step)
    for rank, result in enumerate(results):
        start = 3 * rank
        for step, out in enumerate(result["outputs"]):
            assert_close(out, expected[step][start:start + 3 + rank], msg=lambda m: f"rank {rank} step {step}: {m}")
        assert_shards_match(result["shards"], ref)


def test_output_placement_adds_row_shards_into_their_columns():
    # Blocks of 2 and 3 columns: a row-sharded feature A (2 columns) has a partial sum in
    # both, a table-wise feature B (1 column) only in the second; index 5 is the zero column.
    first, second = torch.tensor([0, 1, 4]), torch.tensor([2, 3, 5])
    p = placement([first, second], [2, 3])
    assert (p.columns, p.width, p.summed) == ([[(0, 2)], [(0, 3)]], 3, True)
    # One source a column, in another order than the blocks': placed, not summed.
    p = placement([torch.tensor([3, 4, 0, 1, 2])], [2, 3])
    assert (p.columns, p.summed) == ([[(2, 2)], [(4, 1), (0, 2)]], False)
    with pytest.raises(ValueError, match="block column 0 feeds output columns 0 and 1"):
        placement([torch.tensor([0, 0, 4]), second], [2, 3])
    with pytest.raises(ValueError, match="block column 1 feeds no output column"):
        placement([torch.tensor([0, 2, 4])], [2, 3])


def with_weights(kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
    """The batch with a weight per id, a function of the id: a rank's slice of the global batch
    carries the same weights as the global batch."""
    return KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values(), lengths=kjt.lengths(),
                             weights=1.0 + (kjt.values() % 5).float() * 0.25)


def weighted_outputs_sharded(rank: int, world: int, plan_json: str, is_weighted: bool) -> list[torch.Tensor]:
    module = sparsecore.SparseCoreEmbeddingBagCollection(tables(), optim.SGD(lr=0.1), "tpu", is_weighted=is_weighted)
    for name, w in initial_weights().items():
        module.set_table_weight(name, w)
    module = shard(module, ShardingPlan.from_json(plan_json))
    return [module(with_weights(kjt_of([local_batch(rank, step)]))).values().detach().cpu() for step in range(2)]


@pytest.mark.parametrize("is_weighted", [False, True])
def test_a_sharded_collection_takes_the_batch_s_weights_only_when_weighted(is_weighted):
    # Row-wise and data-parallel tables: the routed gains and the replicas' local batches.
    world, plan = 2, plan_for("data_parallel", 2)
    results = assert_all_ok(run_ranks(weighted_outputs_sharded, world, plan.to_json(), is_weighted))
    module = sparsecore.SparseCoreEmbeddingBagCollection(tables(), device="cpu", is_weighted=is_weighted)
    for name, w in initial_weights().items():
        module.set_table_weight(name, w)
    for step in range(2):
        expected = module(with_weights(kjt_of([local_batch(r, step) for r in range(world)]))).values()
        unweighted = module(kjt_of([local_batch(r, step) for r in range(world)])).values()
        assert torch.equal(expected, unweighted) is not is_weighted  # the weights matter to this batch
        for rank, outputs in enumerate(results):
            start = sum(3 + r for r in range(rank))
            assert_close(outputs[step], expected[start:start + 3 + rank], msg=lambda m: f"rank {rank} step {step}: {m}")


def trainable_weights_refused(rank: int, world: int, plan_json: str) -> str:
    module = sparsecore.SparseCoreEmbeddingBagCollection(tables(), optim.SGD(lr=0.1), "tpu", is_weighted=True)
    module = shard(module, ShardingPlan.from_json(plan_json))
    kjt = with_weights(kjt_of([local_batch(rank, 0)]))
    weights = kjt.weights().clone().requires_grad_()
    try:
        module(KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values(), lengths=kjt.lengths(), weights=weights))
    except sparsecore.errors.InputError as error:
        return str(error)
    return "no error"


def test_a_sharded_collection_refuses_weights_that_require_grad():
    # It would route them as constants: refused rather than silently left untrained.
    results = assert_all_ok(run_ranks(trainable_weights_refused, 2, plan_for("row_wise", 2).to_json()))
    for message in results:
        assert "require grad" in message and "sharded collection" in message


def no_samples() -> KeyedJaggedTensor:
    """A batch of zero samples (stride 0) of every feature."""
    keys = [f for t in tables() for f in t.feature_names]
    return KeyedJaggedTensor(keys=keys, values=torch.zeros(0, dtype=torch.int64),
                             lengths=torch.zeros(0, dtype=torch.int64), stride=0)


def empty_batch_plan() -> ShardingPlan:
    return ShardingPlan(world_size=2, tables={
        "big": TableSharding(sharding_type="row_wise", ranks=(0, 1)),
        "shared": TableSharding(sharding_type="table_wise", ranks=(0,)),
        "tiny": TableSharding(sharding_type="data_parallel", ranks=(0, 1)),
        "wide": TableSharding(sharding_type="column_wise", ranks=(1, 0), column_widths=(8, 8)),
    })


def train_with_an_empty_rank(rank: int, world: int, plan_json: str, optimizer) -> dict:
    """Rank 0 has no samples at any step; rank 1 its usual ones."""
    module = shard(make_module(optimizer, "tpu"), ShardingPlan.from_json(plan_json))
    outputs = []
    for step in range(STEPS):
        out = module(no_samples() if rank == 0 else kjt_of([local_batch(rank, step)]))
        outputs.append(out.values().detach().cpu())
        grad = torch.zeros(0, out.values().shape[1]) if rank == 0 else output_grad(rank, step, out.values().shape[1])
        out.values().backward(grad.to("tpu"))
    shards = [(s.table, s.rows, s.columns, s.weight.cpu(), {k: v.cpu() for k, v in s.state.items()})
              for s in module.local_shards()]
    return {"outputs": outputs, "shards": shards}


def test_a_rank_with_no_samples_gets_an_empty_output_and_training_goes_on():
    optimizer = optim.Adam(lr=0.05)
    results = assert_all_ok(run_ranks(train_with_an_empty_rank, 2, empty_batch_plan().to_json(), optimizer))
    ref = make_module(optimizer, "cpu")
    width = sum(len(t.feature_names) * t.embedding_dim for t in tables())
    assert tuple(ref(no_samples()).values().shape) == (0, width)  # the unsharded module's contract
    for step in range(STEPS):
        out = ref(kjt_of([local_batch(1, step)]))
        assert tuple(results[0]["outputs"][step].shape) == (0, width)
        assert_close(results[1]["outputs"][step], out.values().detach(), msg=lambda m: f"step {step}: {m}")
        out.values().backward(output_grad(1, step, width))
    for result in results:
        assert_shards_match(result["shards"], ref)


def shard_by_own_plan(rank: int, world: int, plan_jsons: list[str]) -> str:
    try:
        shard(make_module(optim.SGD(lr=0.1), "tpu"), ShardingPlan.from_json(plan_jsons[rank]))
    except Exception as e:  # noqa: BLE001 - the test checks which
        return f"{type(e).__name__}: {e}"
    return "sharded"


@pytest.mark.parametrize("difference", ["sparsecores_per_chip", "column_wise ranks swapped"])
def test_ranks_sharding_by_different_plans_are_refused_on_every_rank(difference):
    def plan(rank: int) -> ShardingPlan:
        if difference == "sparsecores_per_chip":
            return ShardingPlan(world_size=2, sparsecores_per_chip=4 if rank == 0 else 2,
                                tables=plan_for("row_wise", 2).tables)
        ranks = (0, 1) if rank == 0 else (1, 0)
        return ShardingPlan(world_size=2, tables={
            **plan_for("table_wise", 2).tables,
            "big": TableSharding(sharding_type="column_wise", ranks=ranks, column_widths=(4, 4))})

    messages = assert_all_ok(run_ranks(shard_by_own_plan, 2, [plan(r).to_json() for r in range(2)],
                                       group_timeout_s=20.0))
    for message in messages:
        assert message.startswith("PlanError") and "plans differ between ranks" in message, message
        assert "[0] vs [1]" in message, message
    # The same plan on every rank still shards.
    same = plan(0).to_json()
    assert assert_all_ok(run_ranks(shard_by_own_plan, 2, [same, same])) == ["sharded", "sharded"]


def replicas_of_a_meta_module(rank: int, world: int) -> dict:
    torch.manual_seed(rank)  # a different seed on every rank: the replicas must still agree
    configs = [EmbeddingBagConfig(name="rw", num_embeddings=50, embedding_dim=4, feature_names=["f0"]),
               EmbeddingBagConfig(name="dp", num_embeddings=6, embedding_dim=4, feature_names=["f1"])]
    module = sparsecore.SparseCoreEmbeddingBagCollection(configs, optim.Adagrad(lr=0.1), device="meta")
    plan = ShardingPlan(world_size=world, tables={"rw": TableSharding(sharding_type="row_wise", ranks=(0, 1)),
                                                  "dp": TableSharding(sharding_type="data_parallel", ranks=(0, 1))})
    sharded = shard(module, plan)
    initial = next(s for s in sharded.local_shards() if s.table == "dp")
    batch = KeyedJaggedTensor(keys=["f0", "f1"], values=torch.tensor([1, 7, 2 + rank, 3, 5 - rank]),
                              lengths=torch.tensor([1, 2, 1, 1]))
    sharded(batch).values().sum().backward()
    trained = next(s for s in sharded.local_shards() if s.table == "dp")
    return {"initial": (initial.weight.cpu(), {k: v.cpu() for k, v in initial.state.items()}),
            "trained": (trained.weight.cpu(), {k: v.cpu() for k, v in trained.state.items()})}


def test_data_parallel_replicas_of_a_meta_module_agree_across_ranks():
    first, second = assert_all_ok(run_ranks(replicas_of_a_meta_module, 2))
    for when in ("initial", "trained"):
        assert_close(first[when][0], second[when][0], rtol=0, atol=0, msg=lambda m: f"{when} weight: {m}")
        for name, value in first[when][1].items():
            assert_close(value, second[when][1][name], rtol=0, atol=0, msg=lambda m: f"{when} {name}: {m}")


def all_on_rank_0() -> ShardingPlan:
    """Every table whole on rank 0: rank 1 holds no shard and no replica."""
    return ShardingPlan(world_size=2, tables={
        t.name: TableSharding(sharding_type="table_wise", ranks=(0,)) for t in tables()})


def shard_tuples(module) -> list[tuple]:
    """The module's local shards as (table, rows, columns, weight, state) on the CPU."""
    return [(s.table, s.rows, s.columns, s.weight.cpu(), {k: v.cpu() for k, v in s.state.items()})
            for s in module.local_shards()]


def train_with_a_scheduler(rank: int, world: int, plan_json: str, optimizer) -> dict:
    """What TorchRec-style training code does on every rank with ``fused_optimizer``: an LR
    scheduler over it, step and zero_grad after each backward, and a state_dict round trip
    into a fresh module."""
    plan = ShardingPlan.from_json(plan_json)
    module = shard(make_module(optimizer, "tpu"), plan)
    fused = module.fused_optimizer
    scheduler = torch.optim.lr_scheduler.StepLR(fused, step_size=1, gamma=0.5)
    outputs, lrs = [], []
    for step in range(STEPS):
        out = module(kjt_of([local_batch(rank, step)]))
        outputs.append(out.values().detach().cpu())
        out.values().backward(output_grad(rank, step, out.values().shape[1]).to("tpu"))
        fused.step()
        fused.zero_grad()
        scheduler.step()
        lrs.append([group["lr"] for group in fused.param_groups])
    restored = shard(make_module(optimizer, "tpu"), plan)
    restored.fused_optimizer.load_state_dict(fused.state_dict())
    return {"outputs": outputs, "lrs": lrs, "shards": shard_tuples(module), "restored": shard_tuples(restored),
            "steps": (int(module.step_count()), int(restored.step_count()))}


def test_a_rank_holding_no_table_gets_an_empty_fused_optimizer_that_schedulers_and_checkpoints_drive():
    optimizer = optim.Adam(lr=0.05)
    results = assert_all_ok(run_ranks(train_with_a_scheduler, 2, all_on_rank_0().to_json(), optimizer))
    ref = make_module(optimizer, "cpu")
    scheduler = torch.optim.lr_scheduler.StepLR(ref.fused_optimizer, step_size=1, gamma=0.5)
    for step in range(STEPS):
        out = ref(kjt_of([local_batch(r, step) for r in range(2)]))
        for rank, result in enumerate(results):
            start = 3 * rank
            assert_close(result["outputs"][step], out.values().detach()[start:start + 3 + rank],
                         msg=lambda m: f"rank {rank} step {step}: {m}")
        out.values().backward(torch.cat([output_grad(r, step, out.values().shape[1]) for r in range(2)]))
        ref.fused_optimizer.step()
        scheduler.step()
        # Rank 0's learning rate follows the unsharded module's; rank 1 has nothing to schedule.
        assert results[0]["lrs"][step] == [group["lr"] for group in ref.fused_optimizer.param_groups]
        assert results[1]["lrs"][step] == []
    assert_shards_match(results[0]["shards"], ref)
    assert results[1]["shards"] == [] and results[1]["restored"] == []
    # The optimizer state (and step count) went through state_dict into the fresh module.
    assert results[0]["steps"] == (STEPS, STEPS)
    for trained, restored in zip(results[0]["shards"], results[0]["restored"], strict=True):
        assert (trained[0], trained[2]) == (restored[0], restored[2]) and torch.equal(trained[1], restored[1])
        assert_close(restored[4], trained[4], msg=lambda m: f"{trained[0]} restored state: {m}")


def train_after_a_move(rank: int, world: int, plan_json: str, optimizer) -> dict:
    """fused_optimizer taken before ``to("cpu")`` (so cached), then used after it: for state_dict
    after training, and for load_state_dict into a second module moved alike."""
    plan = ShardingPlan.from_json(plan_json)
    module = shard(make_module(optimizer, "tpu"), plan)
    assert module.fused_optimizer is not None  # made (and kept) before the move
    module.to("cpu")
    for step in range(STEPS):
        out = module(kjt_of([local_batch(rank, step)]))
        out.values().backward(output_grad(rank, step, out.values().shape[1]).to(out.values().device))
    saved = module.fused_optimizer.state_dict()
    restored = shard(make_module(optimizer, "tpu"), plan)
    assert restored.fused_optimizer is not None
    restored.to("cpu")
    restored.fused_optimizer.load_state_dict(saved)
    return {"saved": saved["state"], "restored": shard_tuples(restored)}


def test_fused_optimizer_follows_the_module_to_another_device():
    optimizer = optim.Adagrad(lr=0.1)
    results = assert_all_ok(run_ranks(train_after_a_move, 2, all_on_rank_0().to_json(), optimizer))
    _, ref = reference(2, optimizer)
    saved = results[0]["saved"]
    for t in tables():
        assert_close(saved[f"embedding_bags.{t.name}.weight"][f"{t.name}.sum"],
                     ref.table_optimizer_state(t.name)["sum"],
                     msg=lambda m: f"{t.name}: the saved state is not the trained one: {m}")
    for table, _, _, _, state in results[0]["restored"]:
        assert_close(state["sum"], ref.table_optimizer_state(table)["sum"],
                     msg=lambda m: f"{table}: the loaded state did not reach the module: {m}")
    assert results[1]["saved"] == {} and results[1]["restored"] == []
