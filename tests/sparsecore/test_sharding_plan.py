"""sparsecore.distributed's plan (validation, JSON, the default plan) and shard layout, on one process."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from torchrec import EmbeddingBagConfig

from sparsecore.config import as_sparsecore_config
from sparsecore.distributed import PlanError, ShardingPlan, TableSharding, default_plan
from sparsecore.distributed.layout import RowBuckets, ShardLayout


def configs():
    return [EmbeddingBagConfig(name="a", num_embeddings=100, embedding_dim=8, feature_names=["fa"]),
            EmbeddingBagConfig(name="b", num_embeddings=10, embedding_dim=16, feature_names=["fb1", "fb2"])]


def plan(**tables) -> ShardingPlan:
    return ShardingPlan(world_size=2, tables={k: TableSharding(**v) for k, v in tables.items()})


def test_json_round_trip_and_atomic_save(tmp_path):
    p = ShardingPlan(world_size=2, hosts=((0,), (1,)), tables={
        "a": TableSharding(sharding_type="column_wise", ranks=(0, 1), column_widths=(3, 5)),
        "b": TableSharding(sharding_type="table_row_wise", ranks=(1,), compute={"max_ids_per_partition": 64})})
    p.validate(configs())
    assert ShardingPlan.from_json(p.to_json()) == p
    path = tmp_path / "plan.json"
    p.save(path)
    assert ShardingPlan.load(path) == p
    assert json.loads(path.read_text())["version"] == 1
    assert [f.name for f in tmp_path.iterdir()] == ["plan.json"]  # no temp file left


@pytest.mark.parametrize("tables, message", [
    (dict(a=dict(sharding_type="table_wise", ranks=(0,)), b=dict(sharding_type="table_wise", ranks=(0,)),
          c=dict(sharding_type="table_wise", ranks=(0,))), "unknown table"),
    (dict(a=dict(sharding_type="table_wise", ranks=(0,))), r"no sharding for table\(s\) \['b'\]"),
    (dict(a=dict(sharding_type="table_wise", ranks=(2,)), b=dict(sharding_type="row_wise", ranks=(0, 1))),
     "rank 2 is out of range; expected 0 <= rank < 2"),
    (dict(a=dict(sharding_type="column_wise", ranks=(0, 1), column_widths=(4, 5)),
          b=dict(sharding_type="row_wise", ranks=(0, 1))), r"must be positive and sum to the table's dim 8"),
    (dict(a=dict(sharding_type="column_wise", ranks=(0, 1)), b=dict(sharding_type="row_wise", ranks=(0, 1))),
     "one column width per rank"),
    (dict(a=dict(sharding_type="sideways", ranks=(0,)), b=dict(sharding_type="row_wise", ranks=(0, 1))),
     "sharding_type 'sideways' is unknown"),
    (dict(a=dict(sharding_type="table_wise", ranks=(0, 1)), b=dict(sharding_type="row_wise", ranks=(0, 1))),
     "table_wise takes exactly one rank"),
    (dict(a=dict(sharding_type="row_wise", ranks=(1, 1)), b=dict(sharding_type="row_wise", ranks=(0, 1))),
     "repeat a rank"),
    (dict(a=dict(sharding_type="table_wise", ranks=(0,), compute={"speed": 3}),
          b=dict(sharding_type="row_wise", ranks=(0, 1))), "compute option 'speed' is unknown"),
    (dict(a=dict(sharding_type="table_wise", ranks=(0,)), b=dict(sharding_type="table_row_wise", ranks=(0,))),
     "must be one host's ranks"),
])
def test_validation_names_what_is_wrong(tables, message):
    with pytest.raises(PlanError, match=message):
        plan(**tables).validate(configs())


def test_bad_json_and_versions_are_refused():
    with pytest.raises(PlanError, match="not valid JSON"):
        ShardingPlan.from_json("{")
    with pytest.raises(PlanError, match="version 7 is not supported"):
        ShardingPlan.from_json('{"version": 7, "world_size": 1, "tables": {}}')
    with pytest.raises(PlanError, match="unknown field"):
        ShardingPlan.from_json('{"version": 1, "world_size": 1, "tables": {"a": {"sharding_type": "table_wise", '
                               '"ranks": [0], "colour": 1}}}')


def test_default_plan_row_shards_the_big_table_and_balances_the_rest():
    tables = configs() + [EmbeddingBagConfig(name="c", num_embeddings=20, embedding_dim=8, feature_names=["fc"])]
    p = default_plan(tables, 2)
    p.validate(tables)
    assert p.tables["a"] == TableSharding(sharding_type="row_wise", ranks=(0, 1))  # 800 of 1120 elements
    assert {p.tables["b"].ranks, p.tables["c"].ranks} == {(0,), (1,)}
    assert default_plan(tables, 1).tables["a"].sharding_type == "table_wise"


def test_row_buckets_follow_global_mod_sharding_by_hand():
    buckets = RowBuckets(shards=2, sparsecores=2)  # 4 SparseCores in all
    ids = torch.arange(10)
    assert buckets.shard_of(ids).tolist() == [0, 0, 1, 1, 0, 0, 1, 1, 0, 0]
    assert buckets.local_ids(ids).tolist() == [0, 1, 0, 1, 2, 3, 2, 3, 4, 5]
    for shard in (0, 1):
        owned = ids[buckets.shard_of(ids) == shard]
        assert buckets.global_ids(buckets.local_ids(owned), shard).tolist() == owned.tolist()
    assert [buckets.local_rows(10, s) for s in (0, 1)] == [6, 4]
    assert [buckets.local_rows(1, s) for s in (0, 1)] == [1, 0]  # a table smaller than the shards


def test_layout_routes_and_assembles_columns():
    p = plan(a=dict(sharding_type="column_wise", ranks=(1, 0), column_widths=(3, 5)),
             b=dict(sharding_type="row_wise", ranks=(0, 1)))
    layout = ShardLayout([as_sparsecore_config(c) for c in configs()], p)
    assert layout.local_features(0) == ["fa@col1", "fb1", "fb2"]
    assert layout.local_features(1) == ["fa@col0", "fb1", "fb2"]
    assert [layout.local_width(r) for r in (0, 1)] == [5 + 32, 3 + 32]
    first, second = layout.output_gathers()
    # fa: columns 0..2 from rank 1's slice (after rank 0's 37 columns), 3..7 from rank 0's.
    assert first[:8].tolist() == [37, 38, 39, 0, 1, 2, 3, 4]
    assert second[:8].tolist() == [72] * 8  # the zero column: one source each
    # fb1 column 0: rank 0's partial sum plus rank 1's.
    assert (first[8].item(), second[8].item()) == (5, 40)


def test_save_leaves_no_temp_file_when_it_fails(tmp_path):
    p = plan(a=dict(sharding_type="table_wise", ranks=(0,)), b=dict(sharding_type="table_wise", ranks=(1,)))
    (tmp_path / "dir").mkdir()
    with pytest.raises(IsADirectoryError):
        p.save(tmp_path / "dir")
    with pytest.raises(FileNotFoundError):
        p.save(tmp_path / "nodir" / "plan.json")
    assert [f.name for f in tmp_path.iterdir()] == ["dir"] and list((tmp_path / "dir").iterdir()) == []
    p.save(tmp_path / "plan.json")  # a good copy survives a failed rewrite
    with pytest.raises(TypeError):
        dataclasses.replace(p, chip=object()).save(tmp_path / "plan.json")
    assert ShardingPlan.load(tmp_path / "plan.json") == p
    assert sorted(f.name for f in tmp_path.iterdir()) == ["dir", "plan.json"]


def good_plan(**changes) -> dict:
    data = {"version": 1, "world_size": 2, "tables": {"a": {"sharding_type": "table_wise", "ranks": [0]},
                                                      "b": {"sharding_type": "table_wise", "ranks": [1]}}}
    data.update(changes)
    return data


def with_table_a(**a) -> dict:
    return good_plan(tables={"a": a, "b": {"sharding_type": "table_wise", "ranks": [1]}})


@pytest.mark.parametrize("data, message", [
    (good_plan(tables=[{"sharding_type": "table_wise", "ranks": [0]}]), r"tables list; expected an object"),
    (good_plan(tables={"a": "table_wise"}), r"table 'a': 'table_wise'; expected an object"),
    (with_table_a(sharding_type="table_wise", ranks=0), r"table 'a': ranks 0; expected a list of integers"),
    (with_table_a(sharding_type="table_wise", ranks=None), r"table 'a': ranks None; expected a list of integers"),
    (with_table_a(sharding_type="table_wise", ranks=[True]), r"ranks \[True\]; expected a list of integers"),
    (with_table_a(sharding_type="table_wise", ranks=[1.0]), r"ranks \[1.0\]; expected a list of integers"),
    (with_table_a(sharding_type=["table_wise"], ranks=[0]), r"sharding_type \['table_wise'\]; expected one of"),
    (with_table_a(sharding_type="column_wise", ranks=[0, 1], column_widths="32"), r"column_widths '32'; expected"),
    (with_table_a(sharding_type="table_wise", ranks=[0], compute=[1]), r"compute \[1\]; expected an object"),
    (good_plan(hosts=[0, 1]), r"hosts\[0\] 0; expected a list of integers"),
    (good_plan(hosts=3), r"hosts 3; expected a list of each host's ranks"),
    (good_plan(version=True), r"version True is not supported; expected 1"),
    (good_plan(version=1.0), r"version 1.0 is not supported; expected 1"),
    (good_plan(world_size="2"), r"world_size='2'; expected a positive integer"),
    (good_plan(world_size=True), r"world_size=True; expected a positive integer"),
    (good_plan(chip=5), r"chip=5; expected a chip name"),
])
def test_hand_written_plans_of_the_wrong_types_are_named(data, message):
    with pytest.raises(PlanError, match=message):
        ShardingPlan.from_json(json.dumps(data))
