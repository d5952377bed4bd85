"""benchmarks.torchrec_planner: TorchRec's EmbeddingShardingPlanner on our table specs, its plan in our format."""

import logging

import pytest
from torchrec import EmbeddingBagConfig
from torchrec.distributed.planner.types import PlannerError, PlannerErrorType

from benchmarks.torchrec_planner import plan_with_torchrec
from sparsecore.distributed import ShardingPlan
from sparsecore.planner import TableSpec, parse_topology

GiB = 1 << 30

TABLES = [
    TableSpec(name="t_small", num_embeddings=100, embedding_dim=32, pooling_factor=1.0),
    TableSpec(name="t_medium", num_embeddings=50_000, embedding_dim=64, pooling_factor=4.0, zipf_alpha=1.05),
    TableSpec(name="t_large", num_embeddings=400_000, embedding_dim=128, pooling_factor=2.0),
    TableSpec(name="t_wide", num_embeddings=20_000, embedding_dim=512, pooling_factor=1.0, optimizer="adam"),
    TableSpec(name="t_half", num_embeddings=10_000, embedding_dim=64, optimizer="sgd", data_type="fp16"),
]


def configs(tables):
    return [EmbeddingBagConfig(name=t.name, num_embeddings=t.num_embeddings, embedding_dim=t.embedding_dim,
                               feature_names=[t.name]) for t in tables]


@pytest.fixture(scope="module")
def planned():
    return plan_with_torchrec(TABLES, parse_topology("v5p:2", hbm_bytes=GiB), batch_size=1024)


def test_every_table_once_on_ranks_in_range(planned):
    plan, seconds = planned
    assert seconds > 0
    assert list(plan.tables) == [t.name for t in TABLES]
    assert plan.world_size == 2
    for name, sharding in plan.tables.items():
        assert sharding.ranks and all(0 <= r < 2 for r in sharding.ranks), (name, sharding)
        # On CPU TorchRec offers no row-wise sharding (see the module docstring).
        assert sharding.sharding_type in ("table_wise", "column_wise", "data_parallel"), (name, sharding)


def test_round_trips_and_validates(planned):
    plan, _ = planned
    again = ShardingPlan.from_dict(plan.to_dict())
    assert again == plan
    again.validate(configs(TABLES))


def test_quiet_while_planning_and_logging_restored_after(caplog):
    torchrec_logger = logging.getLogger("torchrec")
    before = (torchrec_logger.disabled, torchrec_logger.level, list(logging.root.filters))
    # A tiny table goes data_parallel, for which TorchRec warns on the root logger.
    tiny = TableSpec(name="t_tiny", num_embeddings=10, embedding_dim=8)
    with caplog.at_level(logging.DEBUG):
        plan, _ = plan_with_torchrec([tiny], parse_topology("v5p:2", hbm_bytes=GiB), batch_size=64)
    assert plan.tables["t_tiny"].sharding_type == "data_parallel" and plan.tables["t_tiny"].ranks == (0, 1)
    # (TorchRec's method-call telemetry loggers write to a NullHandler without propagating:
    # nobody but caplog sees them, and one may be created during the call.)
    assert [r.getMessage() for r in caplog.records
            if "torchrec" in r.pathname and not r.name.startswith("MethodLogger")] == []
    assert (torchrec_logger.disabled, torchrec_logger.level, list(logging.root.filters)) == before


def test_a_table_too_big_for_hbm_makes_torchrec_raise():
    huge = TableSpec(name="t_huge", num_embeddings=10_000_000, embedding_dim=128)  # ~5 GB of fp32 weights
    with pytest.raises(PlannerError) as raised:
        plan_with_torchrec([TABLES[0], huge], parse_topology("v5p:2", hbm_bytes=GiB), batch_size=1024)
    assert raised.value.error_type == PlannerErrorType.INSUFFICIENT_STORAGE
