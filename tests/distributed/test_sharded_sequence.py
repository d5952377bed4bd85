"""A sharded SparseCoreEmbeddingCollection (sequence features) against the unsharded one on the global batch.

Every rank feeds its own samples (uneven batch sizes, empty bags, a feature
empty on a whole rank, bags longer than a table's max_seq_len); the reference
is one unsharded module on the CPU fed every rank's samples end to end, with
the same row gradients. Per step, every rank's rows equal the reference's rows
of its samples; after the steps, every shard's weights and optimizer state
equal the reference's rows and columns. A checkpoint of the sharded module
loads into the unsharded one.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.testing import assert_close
from torchrec import EmbeddingConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import sparsecore
from sparsecore import optim
from sparsecore.distributed import ShardingPlan, TableSharding, shard
from sparsecore.distributed.checkpoint import load_unsharded_state_dict, state_dict, unsharded_state_dict
from tests.distributed.harness import assert_all_ok, run_ranks
# Every way a feature's rows come back: row shards on both ranks, a table-wise table on the
# rank with no samples, a replica, column pieces on both ranks (the pooled tests' tables' names).
from tests.distributed.test_sharded_embeddings import assert_shards_match, empty_batch_plan

STEPS = 3


def tables() -> list[sparsecore.SparseCoreEmbeddingConfig]:
    def seq(name, rows, dim, features, **extra):
        return sparsecore.SparseCoreEmbeddingConfig(
            config=EmbeddingConfig(name=name, num_embeddings=rows, embedding_dim=dim, feature_names=features), **extra)

    return [
        seq("big", 50, 8, ["f_big"], max_seq_len=3),
        seq("shared", 9, 8, ["f_a", "f_b"]),
        seq("tiny", 3, 4, ["f_tiny"]),
        seq("wide", 30, 16, ["f_wide"]),
    ]


FEATURES = [f for t in tables() for f in t.feature_names]


def local_batch(rank: int, step: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Rank ``rank``'s samples at ``step``: 3 + rank of them, bags of 0-5 ids; f_tiny empty on rank 1."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    out = {}
    for t in tables():
        for f in t.feature_names:
            lengths = torch.randint(0, 6, (3 + rank,), generator=g)
            if f == "f_tiny" and rank == 1:
                lengths.zero_()
            out[f] = (lengths, torch.randint(0, t.num_embeddings, (int(lengths.sum()),), generator=g))
    return out


def kjt_of(batches) -> KeyedJaggedTensor:
    return KeyedJaggedTensor(keys=FEATURES, values=torch.cat([b[f][1] for f in FEATURES for b in batches]),
                             lengths=torch.cat([b[f][0] for f in FEATURES for b in batches]))


def row_grad(rank: int, step: int, feature: str, rows: int, dim: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7000 + 100 * step + 10 * rank + FEATURES.index(feature))
    return torch.randn(rows, dim, generator=g)


def make_module(optimizer, device) -> sparsecore.SparseCoreEmbeddingCollection:
    module = sparsecore.SparseCoreEmbeddingCollection(tables(), optimizer, device)
    g = torch.Generator().manual_seed(5)
    for t in tables():
        module.set_table_weight(t.name, torch.randn(t.num_embeddings, t.embedding_dim, generator=g))
    return module


def dims() -> dict[str, int]:
    return {f: t.embedding_dim for t in tables() for f in t.feature_names}


def train_sharded(rank: int, world: int, plan_json: str, optimizer, checkpoint: str | None) -> dict:
    module = shard(make_module(optimizer, "tpu"), ShardingPlan.from_json(plan_json))
    outputs = []
    for step in range(STEPS):
        out = module(kjt_of([local_batch(rank, step)]))
        assert list(out) == FEATURES
        outputs.append({f: [x.detach().cpu() for x in jt.to_dense()] for f, jt in out.items()})
        loss = sum((jt.values() * row_grad(rank, step, f, jt.values().shape[0], dims()[f]).to("tpu")).sum()
                   for f, jt in out.items())
        loss.backward()
    shards = [(s.table, s.rows, s.columns, s.weight.cpu(), {k: v.cpu() for k, v in s.state.items()})
              for s in module.local_shards()]
    if checkpoint:
        dcp.save(state_dict(module), checkpoint_id=checkpoint)
    return {"outputs": outputs, "shards": shards}


def reference(world: int, optimizer):
    module = make_module(optimizer, "cpu")
    outputs = []
    for step in range(STEPS):
        out = module(kjt_of([local_batch(r, step) for r in range(world)]))
        outputs.append({f: [x.detach() for x in jt.to_dense()] for f, jt in out.items()})
        loss = 0
        for f, jt in out.items():
            # Each rank's ids are a contiguous run of the global values: the same gradients, in rank order.
            counts = [int(local_batch(r, step)[f][0].clamp(max=3 if f == "f_big" else 99).sum()) for r in range(world)]
            grad = torch.cat([row_grad(r, step, f, n, dims()[f]) for r, n in enumerate(counts)])
            loss = loss + (jt.values() * grad).sum()
        loss.backward()
    return outputs, module


def plan_for(kind: str, world: int) -> ShardingPlan:
    every, last = tuple(range(world)), world - 1
    hosts = None
    if kind == "table_wise":
        spec = {"big": ("table_wise", (0,)), "shared": ("table_wise", (last,)), "tiny": ("table_wise", (1,)),
                "wide": ("table_wise", (0,))}
    elif kind == "row_wise":
        spec = {name: ("row_wise", every) for name in ("big", "shared", "tiny", "wide")}
    elif kind == "column_wise":
        spec = {"big": ("column_wise", (0, 1), (4, 4)), "shared": ("column_wise", (last, 0), (3, 5)),
                "tiny": ("table_wise", (last,)), "wide": ("column_wise", every, (4, 4, 8) if world == 3 else (10, 6))}
    elif kind == "table_row_wise":
        hosts = ((0,), (1,)) if world == 2 else ((0, 1), (2,))
        spec = {"big": ("table_row_wise", hosts[0]), "shared": ("table_row_wise", hosts[1]),
                "tiny": ("table_row_wise", hosts[0]), "wide": ("row_wise", every)}
    else:  # data_parallel, beside row-wise and table-wise tables
        spec = {"big": ("data_parallel", every), "shared": ("row_wise", every), "tiny": ("data_parallel", every),
                "wide": ("table_wise", (last,))}
    return ShardingPlan(world_size=world, hosts=hosts, tables={
        name: TableSharding(sharding_type=s[0], ranks=s[1], column_widths=s[2] if len(s) > 2 else None)
        for name, s in spec.items()})


OPTIMIZERS = {"table_wise": optim.RowWiseAdagrad(lr=0.1), "row_wise": optim.Adam(lr=0.05),
              "column_wise": optim.Adagrad(lr=0.1), "table_row_wise": optim.SGD(lr=0.1),
              "data_parallel": optim.Adam(lr=0.05)}


# Three ranks for every kind under `make test-all`; CI keeps row_wise's.
@pytest.mark.parametrize("kind, world", [(k, 2) for k in OPTIMIZERS] + [
    (k, 3) if k == "row_wise" else pytest.param(k, 3, marks=pytest.mark.slow) for k in OPTIMIZERS])
def test_sharded_sequence_training_equals_unsharded(kind, world, tmp_path):
    optimizer = OPTIMIZERS[kind]
    plan = plan_for(kind, world)
    plan.validate(tables())
    path = str(tmp_path / "ckpt") if world == 2 else None
    results = assert_all_ok(run_ranks(train_sharded, world, plan.to_json(), optimizer, path))
    expected, ref = reference(world, optimizer)
    starts = [sum(3 + r for r in range(rank)) for rank in range(world)]
    for rank, result in enumerate(results):
        for step, out in enumerate(result["outputs"]):
            for f in FEATURES:
                want = expected[step][f][starts[rank]:starts[rank] + 3 + rank]
                assert len(out[f]) == len(want)
                for got_rows, want_rows in zip(out[f], want):
                    assert_close(got_rows, want_rows, msg=lambda m: f"rank {rank} step {step} {f}: {m}")
    for result in results:
        assert_shards_match(result["shards"], ref)
    if path:  # the checkpoint loads into an unsharded module: the reference's tables and state
        fresh = make_module(optimizer, "cpu")
        loaded = unsharded_state_dict(fresh)
        assert all(k.startswith("embeddings.") for k in loaded)
        dcp.load(loaded, checkpoint_id=path)
        load_unsharded_state_dict(fresh, loaded)
        for t in tables():
            assert_close(fresh.table_weight(t.name), ref.table_weight(t.name))
            for name, value in ref.table_optimizer_state(t.name).items():
                assert_close(fresh.table_optimizer_state(t.name)[name], value)


def no_samples() -> KeyedJaggedTensor:
    """A batch of zero samples (stride 0) of every feature."""
    return KeyedJaggedTensor(keys=FEATURES, values=torch.zeros(0, dtype=torch.int64),
                             lengths=torch.zeros(0, dtype=torch.int64), stride=0)


def train_with_an_empty_rank(rank: int, world: int, plan_json: str, optimizer) -> dict:
    """Rank 0 has no samples at any step; rank 1 its usual ones."""
    module = shard(make_module(optimizer, "tpu"), ShardingPlan.from_json(plan_json))
    outputs = []
    for step in range(STEPS):
        out = module(no_samples() if rank == 0 else kjt_of([local_batch(rank, step)]))
        assert list(out) == FEATURES
        outputs.append({f: (jt.values().detach().cpu(), jt.lengths().cpu()) for f, jt in out.items()})
        loss = sum((jt.values() * row_grad(rank, step, f, jt.values().shape[0], dims()[f]).to("tpu")).sum()
                   for f, jt in out.items())
        loss.backward()
    shards = [(s.table, s.rows, s.columns, s.weight.cpu(), {k: v.cpu() for k, v in s.state.items()})
              for s in module.local_shards()]
    return {"outputs": outputs, "shards": shards}


def test_a_rank_with_no_samples_gets_empty_sequences_and_training_goes_on():
    optimizer = optim.Adam(lr=0.05)
    plan = empty_batch_plan()
    plan.validate(tables())
    results = assert_all_ok(run_ranks(train_with_an_empty_rank, 2, plan.to_json(), optimizer))
    ref = make_module(optimizer, "cpu")
    empty = ref(no_samples())  # the unsharded module's contract: no rows, no lengths, per feature
    for step in range(STEPS):
        for f in FEATURES:
            values, lengths = results[0]["outputs"][step][f]
            assert values.shape == empty[f].values().shape and values.dtype == empty[f].values().dtype, f
            assert torch.equal(lengths, empty[f].lengths()), f
        # The global batch is rank 1's samples: the reference's rows and gradients are its.
        out = ref(kjt_of([local_batch(1, step)]))
        for f, jt in out.items():
            values, lengths = results[1]["outputs"][step][f]
            assert_close(values, jt.values().detach(), msg=lambda m: f"step {step} {f}: {m}")
            assert torch.equal(lengths, jt.lengths()), f"step {step} {f}"
        sum((jt.values() * row_grad(1, step, f, jt.values().shape[0], dims()[f])).sum()
            for f, jt in out.items()).backward()
    for result in results:
        assert_shards_match(result["shards"], ref)
