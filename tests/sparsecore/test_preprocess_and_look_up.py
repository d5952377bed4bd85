"""The lookup done while a KJT is preprocessed (preprocess_and_look_up, what forward(KJT) uses
for stacks of short bags) gives the bits of the lookup of the finished buffers (what
forward(PreprocessedBatch) uses)."""

import dataclasses
import sys

import pytest
import torch
from torchrec import EmbeddingBagConfig
from torchrec.modules.embedding_configs import DataType, PoolingType

from sparsecore import optim
from sparsecore.config import SparseCoreEmbeddingConfig
from sparsecore.kernels import lookup
from sparsecore.modules import SparseCoreEmbeddingBagCollection
from sparsecore.preprocess import preprocess_and_look_up
from sparsecore.stacking import plan_stacks
from tests.sparsecore.test_modules import random_kjt


def tables(dim, data_type=DataType.FP32):
    """Three features over two tables of one stack: sum (shared by two features), mean and sqrtn."""
    roomy = dict(max_ids_per_partition=10**5, max_unique_ids_per_partition=10**5)
    return [
        SparseCoreEmbeddingConfig(config=EmbeddingBagConfig(name="a", num_embeddings=300, embedding_dim=dim,
                                                            feature_names=["f0", "f1"], data_type=data_type), **roomy),
        SparseCoreEmbeddingConfig(config=EmbeddingBagConfig(name="b", num_embeddings=7, embedding_dim=dim,
                                                            feature_names=["f2"], pooling=PoolingType.MEAN,
                                                            data_type=data_type), **roomy),
        SparseCoreEmbeddingConfig(config=EmbeddingBagConfig(name="c", num_embeddings=50, embedding_dim=dim,
                                                            feature_names=["f3"], data_type=data_type),
                                  combiner="sqrtn", **roomy),
    ]


def buffers_lookup(weight, stack_batch):
    b = stack_batch
    return lookup(weight, b.row_pointers, b.embedding_ids, b.sample_ids, b.gains, b.num_bags, b.batch_size)


# dims 64 and 128: rows summed in vector registers; 24: the any-width path.
@pytest.mark.parametrize("dim", [24, 64, 128])
@pytest.mark.parametrize("data_type", [DataType.FP32, DataType.FP16, DataType.BF16])
@pytest.mark.parametrize("num_sparsecores", [1, 3, 4])
def test_rows_equal_the_buffers_lookup_bit_for_bit(dim, data_type, num_sparsecores, monkeypatch):
    # Long bags too (their stacks are looked up apart by default): up to 40 ids, many repeated
    # (table b has 7 rows), some bags empty; weighted.
    monkeypatch.setattr(sys.modules["sparsecore.preprocess"], "LOOKUP_IN_PASS_MAX_IDS_PER_BAG", float("inf"))
    configs = tables(dim, data_type)
    stacks = plan_stacks(configs, num_sparsecores)
    dtype = {DataType.FP32: torch.float32, DataType.FP16: torch.float16, DataType.BF16: torch.bfloat16}[data_type]
    weights = {s.name: torch.randn(num_sparsecores * s.rows_per_sparsecore, dim).to(dtype) for s in stacks}
    kjt = random_kjt([c.config for c in configs], batch=300, seed=dim, weighted=True, max_len=40)
    batch, rows = preprocess_and_look_up(kjt, stacks, weights)
    assert set(rows) == {s.name for s in stacks}
    for s in stacks:
        expected = buffers_lookup(weights[s.name], batch.stacks[s.name])
        assert rows[s.name].dtype == torch.float32
        assert torch.equal(rows[s.name], expected)


@pytest.mark.parametrize("max_len, looked_up_in_pass", [(3, True), (8, False)])
def test_only_stacks_of_short_bags_are_looked_up_in_the_pass(max_len, looked_up_in_pass):
    stacks = plan_stacks(tables(8), 4)
    weights = {s.name: torch.randn(4 * s.rows_per_sparsecore, 8) for s in stacks}
    # random_kjt draws lengths in [0, max_len): means 1 and 3.5.
    kjt = random_kjt([c.config for c in tables(8)], batch=200, seed=2, max_len=max_len)
    batch, rows = preprocess_and_look_up(kjt, stacks, weights)
    assert set(rows) == ({s.name for s in stacks} if looked_up_in_pass else set())
    for name, stack_rows in rows.items():
        assert torch.equal(stack_rows, buffers_lookup(weights[name], batch.stacks[name]))


def test_a_stack_that_dropped_ids_has_no_rows_and_forward_looks_up_what_was_kept():
    tight = [dataclasses.replace(c, max_ids_per_partition=3, max_unique_ids_per_partition=2) for c in tables(8)]
    engine = SparseCoreEmbeddingBagCollection(tight, device="tpu", num_sparsecores=2, allow_id_dropping=True)
    kjt = random_kjt([c.config for c in tight], batch=20, seed=1, max_len=3)
    weights = {s.name: engine._weights[s.name].detach() for s in engine.stacks}
    batch, rows = preprocess_and_look_up(kjt, engine.stacks, weights, allow_id_dropping=True, device="tpu")
    assert all(batch.stats[s.name].dropped_ids > 0 for s in engine.stacks)
    assert rows == {}
    with torch.no_grad():
        assert torch.equal(engine(kjt).values().cpu(), engine(engine.preprocess(kjt)).values().cpu())


@pytest.mark.parametrize("device", ["cpu", "tpu"])
def test_training_from_a_kjt_equals_training_from_its_preprocessed_batch(device):
    configs = tables(64)
    engines = [SparseCoreEmbeddingBagCollection(configs, optim.RowWiseAdagrad(lr=0.1), device=device)
               for _ in range(2)]
    engines[1].load_state_dict(engines[0].state_dict())
    for step in range(3):
        kjt = random_kjt([c.config for c in configs], batch=64, seed=10 + step, max_len=3)
        grads = torch.randn(64, 4 * 64, generator=torch.Generator().manual_seed(step)).to(device)
        outputs = [engines[0](kjt).values(), engines[1](engines[1].preprocess(kjt)).values()]
        assert torch.equal(outputs[0].cpu(), outputs[1].cpu())
        for out in outputs:
            out.backward(grads)
    for key, value in engines[0].state_dict().items():
        assert torch.equal(value.cpu(), engines[1].state_dict()[key].cpu()), key


def test_the_module_counts_and_reports_the_ids_it_drops(caplog):
    tight = [dataclasses.replace(c, max_ids_per_partition=3, max_unique_ids_per_partition=2) for c in tables(8)]
    engine = SparseCoreEmbeddingBagCollection(tight, device="tpu", num_sparsecores=2, allow_id_dropping=True)
    kjt = random_kjt([c.config for c in tight], batch=20, seed=1, max_len=3)
    dropped = engine.preprocess(kjt).stats  # what one batch drops, per stack
    assert engine.dropped_ids() == {c.name: dropped[engine._stack_of(c.name).name].dropped_ids for c in tight}
    with caplog.at_level("WARNING", logger="sparsecore.collection"):
        with torch.no_grad():
            engine(kjt)
            engine(kjt)
    assert engine.dropped_ids() == {c.name: 3 * dropped[engine._stack_of(c.name).name].dropped_ids for c in tight}
    assert all(n > 0 for n in engine.dropped_ids().values())
    warned = [r for r in caplog.records if "ids dropped at its partition limits" in r.getMessage()]
    assert len(warned) == len(engine.stacks)  # once per stack, when it first drops
