"""The planner's HBM prediction against a real 2-process sharded run: within 10% of
``torch.tpu.max_memory_allocated()`` on every rank, for its own plan and hand-made ones
(column-wise under row-wise Adagrad and data-parallel tables hold their exchanged row
gradients for a moment: the model counts those too)."""

import pytest
import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import sparsecore
from sparsecore.distributed import ShardingPlan, TableSharding, shard
from sparsecore.planner import TableSpec, evaluate, parse_topology, plan_tables
from tests.distributed.harness import assert_all_ok, run_ranks

WORLD, BATCH = 2, 512
TABLES = [TableSpec(name=f"t{i}", num_embeddings=rows, embedding_dim=64, pooling_factor=float(pooling))
          for i, (rows, pooling) in enumerate([(240_000, 1), (160_000, 4), (100_000, 2), (36_000, 8),
                                               (12_000, 1), (500, 3)])]
TOPOLOGY = parse_topology(f"v5p:{WORLD}")


def plans() -> dict[str, ShardingPlan]:
    def every(kind, **extra):
        return ShardingPlan(world_size=WORLD, tables={
            t.name: TableSharding(sharding_type=kind, ranks=(0, 1), **extra) for t in TABLES})

    mixed = ShardingPlan(world_size=WORLD, tables={
        "t0": TableSharding(sharding_type="row_wise", ranks=(0, 1)),
        "t1": TableSharding(sharding_type="column_wise", ranks=(0, 1), column_widths=(32, 32)),
        "t2": TableSharding(sharding_type="table_wise", ranks=(1,)),
        "t3": TableSharding(sharding_type="table_wise", ranks=(0,)),
        "t4": TableSharding(sharding_type="table_wise", ranks=(0,)),
        "t5": TableSharding(sharding_type="data_parallel", ranks=(0, 1))})
    return {"planner": plan_tables(TABLES, TOPOLOGY, BATCH).plan, "row_wise": every("row_wise"), "mixed": mixed,
            "column_wise": every("column_wise", column_widths=(32, 32)), "data_parallel": every("data_parallel")}


def peak_of_training(rank: int, world: int, plan_json: str) -> int:
    """Bytes this rank's tpu held at most over building the sharded module and two steps
    (building: tables are initialized a slice at a time, so that transient is at most 1 MiB)."""
    torch.set_num_threads(1)
    limit = BATCH * 8 * len(TABLES)
    configs = [sparsecore.SparseCoreEmbeddingConfig(
        config=EmbeddingBagConfig(name=t.name, num_embeddings=t.num_embeddings, embedding_dim=t.embedding_dim,
                                  feature_names=[t.name]),
        max_ids_per_partition=limit, max_unique_ids_per_partition=limit) for t in TABLES]
    torch.tpu.reset_peak_memory_stats()
    base = torch.tpu.memory_allocated()
    module = sparsecore.SparseCoreEmbeddingBagCollection(configs, sparsecore.optim.RowWiseAdagrad(lr=0.01),
                                                         device="meta")
    sharded = shard(module, ShardingPlan.from_json(plan_json))
    g = torch.Generator().manual_seed(rank)
    local = BATCH // world
    for _ in range(2):
        lengths = torch.cat([torch.full((local,), int(t.pooling_factor)) for t in TABLES])
        values = torch.cat([torch.randint(0, t.num_embeddings, (local * int(t.pooling_factor),), generator=g)
                            for t in TABLES])
        kjt = KeyedJaggedTensor(keys=[t.name for t in TABLES], values=values, lengths=lengths)
        sharded(kjt).values().sum().backward()
    torch.tpu.synchronize()
    return torch.tpu.max_memory_allocated() - base


@pytest.mark.parametrize("name", ["planner", "row_wise", "mixed", "column_wise", "data_parallel"])
def test_predicted_memory_within_10_percent_of_the_measured_peak(name):
    plan = plans()[name]
    predicted = evaluate(plan, TABLES, TOPOLOGY, BATCH).device_bytes
    measured = assert_all_ok(run_ranks(peak_of_training, WORLD, plan.to_json(), timeout_s=180))
    for rank in range(WORLD):
        assert abs(predicted[rank] / measured[rank] - 1) <= 0.10, (name, rank, int(predicted[rank]), measured[rank])
