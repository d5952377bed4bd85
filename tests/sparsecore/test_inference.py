"""Lookups under torch.inference_mode: straight from the KJT (sparsecore.inference), no COO buffers."""

import dataclasses

import pytest
import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.modules.embedding_configs import DataType, PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import sparsecore
import sparsecore.modules
from sparsecore.config import SparseCoreEmbeddingConfig
from sparsecore.errors import InputError, PartitionLimitError
from sparsecore.modules import SparseCoreEmbeddingBagCollection
from tests.sparsecore.test_modules import random_kjt

# Dims that take each kernel width (32, 64, 128 unrolled; 12 any width), two tables stacked.
TABLES = [
    EmbeddingBagConfig(name="a", num_embeddings=1000, embedding_dim=64, feature_names=["f0", "f1"]),
    EmbeddingBagConfig(name="b", num_embeddings=37, embedding_dim=64, feature_names=["f2"], pooling=PoolingType.MEAN),
    EmbeddingBagConfig(name="c", num_embeddings=50, embedding_dim=128, feature_names=["f3"]),
    EmbeddingBagConfig(name="d", num_embeddings=9, embedding_dim=32, feature_names=["f4"]),
    EmbeddingBagConfig(name="e", num_embeddings=23, embedding_dim=12, feature_names=["f5"]),
]


def roomy(tables, limit=10**6, **kw):
    return [SparseCoreEmbeddingConfig(config=t, max_ids_per_partition=limit, max_unique_ids_per_partition=limit, **kw)
            for t in tables]


def engine_like(reference, tables, num_sparsecores=4, **kw):
    engine = SparseCoreEmbeddingBagCollection(tables, device="tpu", num_sparsecores=num_sparsecores, **kw)
    engine.load_state_dict(reference.state_dict())
    return engine


def look_up(engine, kjt, how):
    """engine(kjt), or through forward_async: its lookups on the SparseCore executor's thread."""
    return engine(kjt) if how == "forward" else engine.forward_async(kjt).result()


def no_preprocessing(monkeypatch):
    """Makes any full preprocessing of a KJT fail, to show a lookup did without it."""
    def fail(*args, **kwargs):
        raise AssertionError("the inference lookup preprocessed the batch")
    monkeypatch.setattr(sparsecore.collection, "preprocess_and_look_up", fail)


@pytest.mark.parametrize("how", ["forward", "forward_async"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("batch,max_len", [(7, 5), (700, 30), (1, 1)])
def test_inference_equals_torchrec_without_preprocessing(how, weighted, batch, max_len, monkeypatch):
    # (TorchRec weights sum pooling only.)
    tables = [dataclasses.replace(t, pooling=PoolingType.SUM) for t in TABLES] if weighted else TABLES
    reference = EmbeddingBagCollection(tables=tables, is_weighted=weighted)
    engine = engine_like(reference, roomy(tables), is_weighted=weighted)
    no_preprocessing(monkeypatch)
    for seed in range(3):
        kjt = random_kjt(tables, batch=batch, seed=seed, weighted=weighted, max_len=max_len)
        with torch.inference_mode():
            actual = look_up(engine, kjt, how)
        expected = reference(kjt)
        assert actual.keys() == expected.keys() and actual.length_per_key() == expected.length_per_key()
        assert actual.values().device.type == "tpu"
        torch.testing.assert_close(actual.values().cpu(), expected.values().detach(), atol=1e-6, rtol=1e-5)
    assert all(v["max_ids_per_partition"] == 0 for v in engine.observed_limits().values())  # not observed


@pytest.mark.parametrize("data_type", [DataType.FP16, DataType.BF16])
def test_low_precision_tables_and_int32_ids(data_type, monkeypatch):
    tables = [EmbeddingBagConfig(name="h", num_embeddings=300, embedding_dim=64, feature_names=["f"],
                                 data_type=data_type)]
    engine = SparseCoreEmbeddingBagCollection(roomy(tables), device="tpu", num_sparsecores=4)
    stored = engine.table_weight("h").cpu()
    assert stored.dtype == {DataType.FP16: torch.float16, DataType.BF16: torch.bfloat16}[data_type]
    kjt = random_kjt(tables, batch=50, seed=1, max_len=9)
    kjt32 = KeyedJaggedTensor.from_lengths_sync(keys=kjt.keys(), values=kjt.values().int(), lengths=kjt.lengths())
    # The stored rows summed in fp32.
    expected = torch.nn.functional.embedding_bag(kjt.values(), stored.float(), kjt.offsets()[:-1], mode="sum")
    no_preprocessing(monkeypatch)
    with torch.inference_mode():
        for features in (kjt, kjt32):
            torch.testing.assert_close(engine(features).values().cpu(), expected, atol=1e-6, rtol=1e-5)


def test_sqrtn_combiner_and_empty_batch_match_the_preprocessed_lookup():
    tables = roomy(TABLES[:3], combiner="sqrtn")
    engine = SparseCoreEmbeddingBagCollection(tables, device="tpu", num_sparsecores=4, is_weighted=True)
    kjt = random_kjt(TABLES[:3], batch=40, seed=2, weighted=True, max_len=6)
    with torch.no_grad():
        expected = engine(kjt).values().cpu()  # the COO path (preprocessing, then the lookup)
    with torch.inference_mode():
        actual = engine(kjt).values().cpu()
        empty = engine(random_kjt(TABLES[:3], batch=5, seed=0, weighted=True, max_len=1))  # lengths all 0
    torch.testing.assert_close(actual, expected, atol=1e-6, rtol=1e-5)
    assert empty.values().shape == (5, 64 * 3 + 128) and not empty.values().cpu().any()


@pytest.mark.parametrize("how", ["forward", "forward_async"])
def test_limits_are_bounded_by_raw_counts_and_decided_exactly_past_them(how):
    # Every bag repeats one id, so the raw counts are far above the merged and distinct ones.
    table = EmbeddingBagConfig(name="r", num_embeddings=64, embedding_dim=64, feature_names=["f"])
    batch, repeats = 8, 10
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=["f"], values=torch.tensor([4 * s for s in range(batch) for _ in range(repeats)]),
        lengths=torch.full((batch,), repeats))
    reference = EmbeddingBagCollection(tables=[table])
    [exact] = SparseCoreEmbeddingBagCollection([table], device="tpu", num_sparsecores=4).preprocess(kjt).stats.values()
    assert exact.max_ids_per_partition < repeats * 2 <= batch * repeats // 4  # 2 samples a receiver
    fits = engine_like(reference, roomy([table], limit=max(exact.max_ids_per_partition,
                                                           exact.max_unique_ids_per_partition)))
    with torch.inference_mode():
        out = look_up(fits, kjt, how).values().cpu()  # raw counts pass the limits: the full preprocessing decides
    torch.testing.assert_close(out, reference(kjt).values().detach(), atol=1e-6, rtol=1e-5)
    assert fits.observed_limits()["r"]["max_ids_per_partition"] == exact.max_ids_per_partition
    too_small = engine_like(reference, roomy([table], limit=exact.max_ids_per_partition - 1))
    with torch.inference_mode(), pytest.raises(PartitionLimitError, match="max_ids_per_partition"):
        look_up(too_small, kjt, how)


@pytest.mark.parametrize("num_sparsecores", [1, 2, 3, 4])
def test_raw_counts_decide_at_the_limit_exactly(num_sparsecores, monkeypatch):
    # One stack of two tables (two rotations), bags longer than the prefetch distance, a batch
    # that the SparseCores do not divide evenly.
    tables = [EmbeddingBagConfig(name="p", num_embeddings=5000, embedding_dim=64, feature_names=["f0", "f1"]),
              EmbeddingBagConfig(name="q", num_embeddings=777, embedding_dim=64, feature_names=["f2"])]
    n, batch = num_sparsecores, 37
    kjt = random_kjt(tables, batch=batch, seed=6, max_len=150)
    [stack] = SparseCoreEmbeddingBagCollection(tables, device="tpu", num_sparsecores=n).stacks
    # Raw ids per (receiving SparseCore: the sample's batch slice, owning SparseCore), by hand.
    raw = torch.zeros(n, n, dtype=torch.long)
    values, lengths = kjt.values(), kjt.lengths().view(3, batch)
    start = 0
    for f, table in enumerate(["p", "p", "q"]):
        for b in range(batch):
            ids = values[start:start + int(lengths[f, b])]
            start += ids.numel()
            owner, _ = stack.locate(table, ids)
            raw[b // -(-batch // n)] += torch.bincount(owner, minlength=n)
    most = int(raw.max())
    reference = EmbeddingBagCollection(tables=tables)
    preprocessed = []
    real = sparsecore.collection.preprocess_and_look_up
    monkeypatch.setattr(sparsecore.collection, "preprocess_and_look_up",
                        lambda *args, **kwargs: preprocessed.append(True) or real(*args, **kwargs))
    for limit, falls_back in ((most, False), (most - 1, True)):
        engine = engine_like(reference, roomy(tables, limit=limit), num_sparsecores=n)
        preprocessed.clear()
        with torch.inference_mode():
            out = engine(kjt).values().cpu()
        assert bool(preprocessed) == falls_back
        torch.testing.assert_close(out, reference(kjt).values().detach(), atol=1e-5, rtol=1e-5)


def test_a_fallen_back_batch_is_not_trainable_outside_inference_mode():
    # forward_async under inference_mode, result() outside it: rows without autograd, as when served.
    tables = roomy(TABLES[:1], limit=1)  # the batch falls back to the full preprocessing (which drops ids)
    engine = SparseCoreEmbeddingBagCollection(tables, sparsecore.optim.SGD(lr=0.5), device="tpu", num_sparsecores=4,
                                              allow_id_dropping=True)
    kjt = random_kjt(TABLES[:1], batch=16, seed=4, max_len=8)
    with torch.inference_mode():
        pending = engine.forward_async(kjt)
    assert not pending.result().values().requires_grad


@pytest.mark.parametrize("bad", [1000, -1])
def test_out_of_range_ids_are_named(bad):
    engine = SparseCoreEmbeddingBagCollection(roomy(TABLES), device="tpu", num_sparsecores=4)
    kjt = random_kjt(TABLES, batch=6, seed=3, max_len=4)
    values = kjt.values().clone()
    first_of_f1 = int(kjt.lengths()[:6].sum())  # f1 is the second feature: table "a", 1000 rows
    values[first_of_f1] = bad
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=kjt.keys(), values=values, lengths=kjt.lengths())
    with torch.inference_mode(), pytest.raises(InputError, match=rf"feature 'f1' \(table 'a'\): id {bad} is out of range"):
        engine(kjt)


@pytest.mark.parametrize("where", ["deep in a long bag", "the last id"])
def test_an_out_of_range_id_is_named_wherever_it_sits(where, monkeypatch):
    # The pass checks each id when it asks for the id's row, ahead of the sum: an id that is
    # never summed must still be checked, and a bad one never read.
    no_preprocessing(monkeypatch)
    tables = TABLES[:1]
    engine = SparseCoreEmbeddingBagCollection(roomy(tables), device="tpu", num_sparsecores=4)
    kjt = random_kjt(tables, batch=6, seed=3, max_len=300)
    values, lengths = kjt.values().clone(), kjt.lengths()
    if where == "the last id":
        position, feature = values.numel() - 1, "f1"
    else:  # 150 ids into f0's longest bag, past the rows asked for at its start
        longest = int(lengths[:6].argmax())
        assert lengths[longest] > 150
        position, feature = int(lengths[:longest].sum()) + 150, "f0"
    values[position] = 10**9
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=kjt.keys(), values=values, lengths=lengths)
    with torch.inference_mode(), pytest.raises(InputError, match=rf"feature '{feature}' \(table 'a'\): id 1000000000 is"):
        engine(kjt)


def test_inference_sees_deferred_updates():
    tables = roomy(TABLES[:1])
    engine = SparseCoreEmbeddingBagCollection(tables, sparsecore.optim.SGD(lr=0.5), device="tpu", num_sparsecores=4)
    engine.set_deferred_updates(True)
    kjt = random_kjt(TABLES[:1], batch=16, seed=4, max_len=8)
    before = engine.table_weight("a")
    for how in ("forward", "forward_async"):
        engine(kjt).values().sum().backward()  # queued on the SparseCore executor
        with torch.inference_mode():
            actual = look_up(engine, kjt, how).values().cpu()
        reference = EmbeddingBagCollection(tables=TABLES[:1])
        reference.load_state_dict(engine.state_dict())  # the updated weights
        torch.testing.assert_close(actual, reference(kjt).values().detach(), atol=1e-6, rtol=1e-5)
    assert not torch.equal(engine.table_weight("a"), before)
