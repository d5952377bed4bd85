"""SparseCoreEmbeddingBagCollection against torchrec.EmbeddingBagCollection with the same weights."""

import pytest
import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.modules.embedding_configs import DataType, PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from sparsecore.config import SparseCoreEmbeddingConfig
from sparsecore.errors import InputError
from sparsecore import optim
from sparsecore.modules import SparseCoreEmbeddingBagCollection


def random_kjt(tables, batch, seed=0, weighted=False, max_len=5):
    g = torch.Generator().manual_seed(seed)
    keys, values, lengths = [], [], []
    for t in tables:
        for f in t.feature_names:
            keys.append(f)
            ls = torch.randint(0, max_len, (batch,), generator=g)
            lengths.append(ls)
            values.append(torch.randint(0, t.num_embeddings, (int(ls.sum()),), generator=g))
    values, lengths = torch.cat(values), torch.cat(lengths)
    weights = torch.rand(values.numel(), generator=g) if weighted else None
    return KeyedJaggedTensor.from_lengths_sync(keys=keys, values=values, lengths=lengths, weights=weights)


def pair(tables, device="tpu", **kw):
    reference = EmbeddingBagCollection(tables=tables, is_weighted=kw.get("is_weighted", False))
    engine = SparseCoreEmbeddingBagCollection(tables, device=device, **kw)
    engine.load_state_dict(reference.state_dict())
    return reference, engine


def assert_same(reference, engine, kjt, atol=1e-6):
    expected, actual = reference(kjt), engine(kjt)
    assert actual.keys() == expected.keys()
    assert actual.length_per_key() == expected.length_per_key()
    assert actual.values().device.type == engine._device.type
    torch.testing.assert_close(actual.values().cpu(), expected.values().detach(), atol=atol, rtol=1e-5)


TABLES = [
    EmbeddingBagConfig(name="shared", num_embeddings=97, embedding_dim=8, feature_names=["f0", "f1"]),
    EmbeddingBagConfig(name="mean", num_embeddings=31, embedding_dim=8, feature_names=["f2"], pooling=PoolingType.MEAN),
    EmbeddingBagConfig(name="small", num_embeddings=5, embedding_dim=4, feature_names=["f3"]),
]


@pytest.mark.parametrize("num_sparsecores", [1, 2, 4])
def test_sum_mean_shared_and_stacked_tables(num_sparsecores):
    reference, engine = pair(TABLES, num_sparsecores=num_sparsecores)
    assert len(engine.stacks) == 2  # the two dim-8 tables share one physical table
    for seed in range(3):
        assert_same(reference, engine, random_kjt(TABLES, batch=7, seed=seed))


@pytest.mark.parametrize("num_sparsecores", [1, 4])
def test_many_bags_split_across_threads(num_sparsecores):
    # 700 samples x 4 features: the lookup splits the bags into ranges that threads take, across receivers.
    roomy = [SparseCoreEmbeddingConfig(config=t, max_ids_per_partition=10**5, max_unique_ids_per_partition=10**5)
             for t in TABLES]
    reference = EmbeddingBagCollection(tables=TABLES)
    engine = SparseCoreEmbeddingBagCollection(roomy, device="tpu", num_sparsecores=num_sparsecores)
    engine.load_state_dict(reference.state_dict())
    assert_same(reference, engine, random_kjt(TABLES, batch=700, seed=5, max_len=12))


def test_weighted_features():
    tables = [EmbeddingBagConfig(name="w", num_embeddings=40, embedding_dim=8, feature_names=["f"])]
    reference, engine = pair(tables, is_weighted=True)
    assert_same(reference, engine, random_kjt(tables, batch=9, weighted=True))


@pytest.mark.parametrize("data_type", [DataType.FP16, DataType.BF16])
def test_low_precision_tables(data_type):
    tables = [EmbeddingBagConfig(name="h", num_embeddings=40, embedding_dim=8, feature_names=["f"], data_type=data_type)]
    reference, engine = pair(tables)
    kjt = random_kjt(tables, batch=8)
    expected, actual = reference(kjt), engine(kjt)
    assert actual.values().dtype == expected.values().dtype == torch.float32
    # Same stored rows; the engine accumulates in fp32.
    torch.testing.assert_close(actual.values().cpu(), expected.values().detach(), atol=2e-3, rtol=1e-2)
    # The table is stored as its config says (TorchRec 1.8's EmbeddingBagCollection keeps BF16 tables as fp16).
    expected_dtype = {DataType.FP16: torch.float16, DataType.BF16: torch.bfloat16}[data_type]
    assert engine.state_dict()["embedding_bags.h.weight"].dtype == expected_dtype


def test_empty_bags_and_empty_batch():
    reference, engine = pair(TABLES)
    assert_same(reference, engine, random_kjt(TABLES, batch=5, max_len=1))  # all bags empty
    empty = random_kjt(TABLES, batch=0)
    assert tuple(engine(empty).values().shape) == (0, 28)


def test_preprocessed_batch_is_accepted():
    reference, engine = pair(TABLES)
    kjt = random_kjt(TABLES, batch=6, seed=4)
    torch.testing.assert_close(engine(engine.preprocess(kjt)).values().cpu(), reference(kjt).values().detach())


def test_state_dict_has_torchrec_keys_and_round_trips():
    reference, engine = pair(TABLES)
    assert list(engine.state_dict()) == list(reference.state_dict())
    fresh = SparseCoreEmbeddingBagCollection(TABLES, device="tpu")
    fresh.load_state_dict(engine.state_dict())
    for key, value in reference.state_dict().items():
        assert torch.equal(fresh.state_dict()[key].cpu(), value)
    assert [c.name for c in engine.embedding_bag_configs()] == ["shared", "mean", "small"]


def test_init_fn_is_honoured():
    tables = [EmbeddingBagConfig(name="c", num_embeddings=10, embedding_dim=4, feature_names=["f"],
                                 init_fn=lambda w: torch.nn.init.constant_(w, 0.5))]
    engine = SparseCoreEmbeddingBagCollection(tables, device="tpu")
    assert torch.equal(engine.state_dict()["embedding_bags.c.weight"].cpu(), torch.full((10, 4), 0.5))


def test_bad_tables_and_inputs_are_named():
    with pytest.raises(InputError, match="feature 'f0' is served by both"):
        SparseCoreEmbeddingBagCollection(TABLES + [EmbeddingBagConfig(name="x", num_embeddings=3, embedding_dim=4, feature_names=["f0"])], device="cpu")
    _, engine = pair(TABLES, is_weighted=True)
    bad = KeyedJaggedTensor.from_lengths_sync(keys=["f0", "f1", "f2", "f3"], values=torch.tensor([97]), lengths=torch.tensor([1, 0, 0, 0]))
    before = engine.state_dict()["embedding_bags.shared.weight"].clone()
    with pytest.raises(InputError, match=r"feature 'f0' \(table 'shared'\): id 97 is out of range"):
        engine(bad)
    assert torch.equal(engine.state_dict()["embedding_bags.shared.weight"], before)
    # Weights that do not match the ids one for one (the C++ passes would read past them).
    short = KeyedJaggedTensor(keys=["f0", "f1", "f2", "f3"], values=torch.tensor([1, 2, 3]),
                              lengths=torch.tensor([3, 0, 0, 0]), weights=torch.ones(2))
    for mode in (torch.no_grad, torch.inference_mode):
        with mode(), pytest.raises(InputError, match="2 weights for 3 ids; expected one weight per id"):
            engine(short)


def test_weights_count_only_in_a_weighted_collection_as_in_torchrec():
    tables = [EmbeddingBagConfig(name="t", num_embeddings=20, embedding_dim=4, feature_names=["f"])]
    kjt = random_kjt(tables, batch=9, weighted=True)
    for weighted in (False, True):
        reference, engine = pair(tables, is_weighted=weighted)
        assert engine.is_weighted() is weighted
        assert_same(reference, engine, kjt)  # unweighted: the weights are ignored, as TorchRec ignores them
        with torch.inference_mode():
            torch.testing.assert_close(engine(kjt).values().cpu(), reference(kjt).values(), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("weighted", [False, True])
def test_conversions_keep_is_weighted(weighted):
    from sparsecore.convert import from_torchrec

    tables = [EmbeddingBagConfig(name="t", num_embeddings=20, embedding_dim=4, feature_names=["f"])]
    reference = EmbeddingBagCollection(tables=tables, is_weighted=weighted)
    engine = from_torchrec(reference, device="tpu")
    back = engine.to_torchrec()
    assert engine.is_weighted() is weighted and back.is_weighted() is weighted
    kjt = random_kjt(tables, batch=6, weighted=True)
    torch.testing.assert_close(back(kjt).values(), reference(kjt).values())
    torch.testing.assert_close(engine(kjt).values().detach().cpu(), reference(kjt).values().detach(), atol=1e-6, rtol=1e-5)


def test_a_sequence_collection_refuses_is_weighted():
    from sparsecore.modules import SparseCoreEmbeddingCollection
    from torchrec import EmbeddingConfig

    with pytest.raises(ValueError, match="a sequence collection has no pooling"):
        SparseCoreEmbeddingCollection([EmbeddingConfig(name="s", num_embeddings=5, embedding_dim=4, feature_names=["q"])],
                                      device="cpu", is_weighted=True)


def test_a_module_built_on_meta_lands_on_the_tpus_sparsecores():
    # The meta device has one SparseCore; materialized on a tpu, the stacks are laid out over
    # the chip's, as a module built there (partition limits count per SparseCore).
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    tables = [EmbeddingBagConfig(name="t", num_embeddings=1000, embedding_dim=4, feature_names=["f"])]
    built = SparseCoreEmbeddingBagCollection(tables, optim.SGD(lr=0.1), device="tpu")
    landed = SparseCoreEmbeddingBagCollection(tables, optim.SGD(lr=0.1), device="meta").to_empty(device="tpu")
    landed.load_state_dict(built.state_dict())
    chip = torch.tpu.get_device_properties().sparsecores_per_chip
    assert [s.num_sparsecores for s in landed.stacks] == [chip] == [s.num_sparsecores for s in built.stacks]
    assert landed.memory_breakdown() == built.memory_breakdown()
    kjt = KeyedJaggedTensor(keys=["f"], values=torch.arange(64 * 5) % 1000, lengths=torch.full((64,), 5))
    assert torch.equal(landed(kjt).values().cpu(), built(kjt).values().cpu())  # 320 ids: over one core's 256
