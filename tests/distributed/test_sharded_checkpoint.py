"""Distributed checkpoints of sharded embeddings: saved by 2 ranks, loaded by 1 and 3 ranks under other
plans, and into an unsharded module and TorchRec; optimizer state travels (training continues exactly)."""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
from torchrec import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from torch.testing import assert_close

from sparsecore import optim
from sparsecore.distributed import ShardingPlan, TableSharding, shard
from sparsecore.distributed.checkpoint import (
    load_state_dict,
    load_unsharded_state_dict,
    state_dict,
    unsharded_state_dict,
)
from tests.distributed.harness import assert_all_ok, run_ranks
from tests.distributed.test_sharded_embeddings import (
    assert_shards_match,
    kjt_of,
    local_batch,
    make_module,
    output_grad,
    tables,
)

OPTIMIZER = optim.RowWiseAdagrad(lr=0.1)  # a per-row state beside the weights


def save_plan() -> ShardingPlan:
    return ShardingPlan(world_size=2, tables={
        "big": TableSharding(sharding_type="row_wise", ranks=(0, 1)),
        "shared": TableSharding(sharding_type="column_wise", ranks=(1, 0), column_widths=(3, 5)),
        "tiny": TableSharding(sharding_type="data_parallel", ranks=(0, 1)),
        "wide": TableSharding(sharding_type="table_wise", ranks=(1,)),
    })


def load_plan(world: int) -> ShardingPlan:
    every = tuple(range(world))
    return ShardingPlan(world_size=world, tables={
        "big": TableSharding(sharding_type="column_wise", ranks=every, column_widths=(2, 2, 4)[:world] if world == 3
                             else (8,)),
        "shared": TableSharding(sharding_type="row_wise", ranks=every),
        "tiny": TableSharding(sharding_type="table_wise", ranks=(world - 1,)),
        "wide": TableSharding(sharding_type="data_parallel", ranks=every),
    })


def step(module, rank: int, index: int) -> None:
    out = module(kjt_of([local_batch(rank, index)]))
    out.values().backward(output_grad(rank, index, out.values().shape[1]).to("tpu"))


def shards_of(module) -> list:
    return [(s.table, s.rows, s.columns, s.weight.cpu(), {k: v.cpu() for k, v in s.state.items()})
            for s in module.local_shards()]


def train_and_save(rank: int, world: int, path: str) -> None:
    module = shard(make_module(OPTIMIZER, "tpu"), save_plan())
    for i in range(2):
        step(module, rank, i)
    dcp.save(state_dict(module), checkpoint_id=path)


def load_and_continue(rank: int, world: int, path: str) -> dict:
    module = shard(make_module(OPTIMIZER, "tpu"), load_plan(world))  # fresh weights, then the checkpoint
    state = state_dict(module)
    dcp.load(state, checkpoint_id=path)
    load_state_dict(module, state)
    loaded = shards_of(module)
    step(module, rank, 2)  # the third step, now over `world` ranks
    return {"loaded": loaded, "trained": shards_of(module)}


def reference(steps: list[list[int]]):
    """The unsharded module on the CPU, one global batch per step from the given ranks."""
    module = make_module(OPTIMIZER, "cpu")
    for index, ranks in enumerate(steps):
        out = module(kjt_of([local_batch(r, index) for r in ranks]))
        width = out.values().shape[1]
        out.values().backward(torch.cat([output_grad(r, index, width) for r in ranks]))
    return module


def test_checkpoint_saved_by_two_ranks_loads_on_one_and_three_and_training_continues(tmp_path):
    path = str(tmp_path / "ckpt")
    assert_all_ok(run_ranks(train_and_save, 2, path))
    after_two = reference([[0, 1], [0, 1]])
    for world in (1, 3):
        results = assert_all_ok(run_ranks(load_and_continue, world, path))
        after_three = reference([[0, 1], [0, 1], list(range(world))])
        for result in results:
            assert_shards_match(result["loaded"], after_two)
            assert_shards_match(result["trained"], after_three)


def test_checkpoint_loads_into_an_unsharded_module_and_torchrec(tmp_path):
    path = str(tmp_path / "ckpt")
    assert_all_ok(run_ranks(train_and_save, 2, path))
    module = make_module(OPTIMIZER, "cpu")
    state = unsharded_state_dict(module)
    dcp.load(state, checkpoint_id=path, no_dist=True)
    load_unsharded_state_dict(module, state)
    ref = reference([[0, 1], [0, 1]])
    for t in tables():
        assert_close(module.table_weight(t.name), ref.table_weight(t.name))
        for name, value in ref.table_optimizer_state(t.name).items():
            assert_close(module.table_optimizer_state(t.name)[name], value)
    # CPU serving through TorchRec: rows in logical order (the row-wise shards de-interleaved).
    # TorchRec has no sqrtn pooling: the tables without it.
    servable = [c for c in tables() if c.combiner != "sqrtn"]
    served = EmbeddingBagCollection(tables=[c.config for c in servable])
    weights = module.state_dict()
    served.load_state_dict({k: v for k, v in weights.items() if k.split(".")[1] in {c.name for c in servable}})
    batch = kjt_of([local_batch(0, 5)])
    expected = ref(batch)
    features = [f for c in servable for f in c.feature_names]
    got = served(KeyedJaggedTensor.from_jt_dict({f: batch.to_dict()[f] for f in features}))
    for f in features:
        assert_close(got[f], expected[f].detach(), msg=lambda m: f"{f}: {m}")


ADAM = optim.Adam(lr=0.05)  # its bias correction depends on the step count


def all_on(holder: int, world: int) -> ShardingPlan:
    return ShardingPlan(world_size=world, tables={
        t.name: TableSharding(sharding_type="table_wise", ranks=(holder,)) for t in tables()})


def adam_train_and_save(rank: int, world: int, path: str, plan_json: str) -> dict:
    module = shard(make_module(ADAM, "tpu"), ShardingPlan.from_json(plan_json))
    for i in range(2):
        step(module, rank, i)
    state = state_dict(module)
    dcp.save(state, checkpoint_id=path)
    return {k: int(v) for k, v in state.items() if k.endswith(".step")}


def test_the_step_count_is_saved_by_ranks_holding_no_shard(tmp_path):
    """Every table on one rank: the others hold none of them, yet any rank's copy of the
    (replicated) step count may be the one DCP keeps; resumed Adam must equal the uninterrupted run."""
    for world, holder in ((2, 0), (3, 2)):
        path = str(tmp_path / f"ckpt{world}")
        saved = assert_all_ok(run_ranks(adam_train_and_save, world, path, all_on(holder, world).to_json()))
        for rank, steps in enumerate(saved):
            assert steps and set(steps.values()) == {2}, (rank, steps)
        module = make_module(ADAM, "cpu")
        state = unsharded_state_dict(module)
        dcp.load(state, checkpoint_id=path, no_dist=True)
        assert {int(v) for k, v in state.items() if k.endswith(".step")} == {2}
        load_unsharded_state_dict(module, state)
        ranks = list(range(world))
        ref = make_module(ADAM, "cpu")
        for index in range(3):
            for m in ((ref, module) if index == 2 else (ref,)):
                out = m(kjt_of([local_batch(r, index) for r in ranks]))
                width = out.values().shape[1]
                out.values().backward(torch.cat([output_grad(r, index, width) for r in ranks]))
        for t in tables():
            assert_close(module.table_weight(t.name), ref.table_weight(t.name), msg=lambda m: f"{t.name}: {m}")
