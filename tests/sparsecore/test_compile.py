"""torch.compile(fullgraph=True) of a module calling the engine, with
backend="aot_eager" and with torch_tpu's "tpu" backend (whose graphs holding
SparseCore ops run op by op: their in-place state and executor are not the
CPU compile's to take)."""

import pytest
import torch
from torchrec import EmbeddingBagConfig, PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from sparsecore import InputError, SparseCoreEmbeddingConfig, optim
from sparsecore.modules import SparseCoreEmbeddingBagCollection
from tests.sparsecore.test_modules import TABLES, random_kjt
from tests.test_inductor import has_compiled_segment, record_splits


@pytest.mark.parametrize("backend", ["aot_eager", "tpu"])
def test_compiled_training_step_matches_eager(backend):
    eager = SparseCoreEmbeddingBagCollection(TABLES, optim.Adam(lr=0.05), device="tpu")
    compiled_module = SparseCoreEmbeddingBagCollection(TABLES, optim.Adam(lr=0.05), device="tpu")
    compiled_module.load_state_dict(eager.state_dict())

    def loss_fn(module, batch):
        return module(batch).values().pow(2).sum()

    compiled = torch.compile(loss_fn, backend=backend, fullgraph=True)
    for seed in range(3):
        kjt = random_kjt(TABLES, batch=5, seed=seed)  # host preprocessing stays outside the graph
        loss = compiled(compiled_module, compiled_module.preprocess(kjt))
        loss.backward()
        expected = loss_fn(eager, eager.preprocess(kjt))
        expected.backward()
        torch.testing.assert_close(loss.detach().cpu(), expected.detach().cpu())
    for key, value in eager.state_dict().items():
        torch.testing.assert_close(compiled_module.state_dict()[key], value)


class EmbeddingAndMLP(torch.nn.Module):
    """Pooled embeddings from the engine, then a small dense MLP."""

    def __init__(self):
        super().__init__()
        self.ebc = SparseCoreEmbeddingBagCollection(TABLES, optim.Adam(lr=0.05), device="tpu")
        width = sum(t.embedding_dim * len(t.feature_names) for t in TABLES) + 4
        self.mlp = torch.nn.Sequential(torch.nn.Linear(width, 16), torch.nn.LayerNorm(16), torch.nn.GELU(),
                                       torch.nn.Linear(16, 1)).to("tpu")

    def forward(self, dense, batch):
        pooled = self.ebc(batch).values()
        return self.mlp(torch.cat([pooled, dense], 1)).square().mean()


def test_the_tpu_backend_compiles_the_dense_part_around_the_engine(monkeypatch):
    """fullgraph=True: the SparseCore ops stay in the graph and run as they are;
    the dense ops on either side of them are compiled (in both the forward and
    the backward graph), and training equals eager."""
    splits = record_splits(monkeypatch.setattr)
    torch.manual_seed(0)
    eager = EmbeddingAndMLP()
    compiled_module = EmbeddingAndMLP()
    compiled_module.load_state_dict(eager.state_dict())
    compiled = torch.compile(compiled_module, backend="tpu", fullgraph=True)
    for seed in range(3):
        kjt = random_kjt(TABLES, batch=5, seed=seed)
        dense = torch.randn(5, 4).to("tpu")
        loss = compiled(dense, compiled_module.ebc.preprocess(kjt))
        loss.backward()
        expected = eager(dense, eager.ebc.preprocess(kjt))
        expected.backward()
        torch.testing.assert_close(loss.detach().cpu(), expected.detach().cpu(), rtol=1e-5, atol=1e-6)
    for key, value in eager.state_dict().items():
        torch.testing.assert_close(compiled_module.state_dict()[key], value, rtol=1e-4, atol=1e-5)
    assert len(splits) >= 2, splits  # the forward and the backward graph, each split around the engine
    assert all(has_compiled_segment(split) for split in splits), splits


def test_a_compiled_step_updates_tables_in_place_without_copying_them():
    """The fused update reaches the compiled backward functionalized (clone the table and its
    state, update the clones, copy them back); the tpu backend runs it in place again
    (inductor.reinplace_mutating_ops), so a step's peak memory holds no copy of a table."""

    rows, dim = 100_000, 16
    table_bytes = rows * dim * 4
    tables = [EmbeddingBagConfig(name="big", num_embeddings=rows, embedding_dim=dim, feature_names=["f"])]
    module = SparseCoreEmbeddingBagCollection(tables, optim.Adagrad(lr=0.05), device="tpu")

    def loss_fn(batch):
        return module(batch).values().pow(2).sum()

    compiled = torch.compile(loss_fn, backend="tpu", fullgraph=True)
    before = module.table_weight("big").clone()
    for seed in range(3):
        batch = module.preprocess(random_kjt(tables, batch=64, seed=seed))
        torch.tpu.synchronize()
        resident = torch.tpu.memory_allocated()
        torch.tpu.reset_peak_memory_stats()
        loss = compiled(batch)
        assert isinstance(loss, torch.Tensor)  # a compiled last segment with one output returns it bare
        loss.backward()
        torch.tpu.synchronize()
        assert torch.tpu.max_memory_allocated() - resident < table_bytes / 4
    assert not torch.equal(module.table_weight("big"), before)  # the steps did train the table


# ---- raw KJTs inside a compiled step (sparsecore.traced_preprocess) ----


def train_on_kjts(step, batches) -> list[float]:
    losses = []
    for dense, kjt in batches:
        loss = step(dense, kjt).square().mean()
        loss.backward()
        losses.append(float(loss.detach()))
    return losses


def kjt_batches(tables, count: int, batch: int = 6, **kw) -> list:
    """(dense on tpu, KJT on cpu) pairs whose id counts differ from batch to batch."""
    out = []
    for seed in range(count):
        dense = torch.randn(batch, 4, generator=torch.Generator().manual_seed(seed)).to("tpu")
        out.append((dense, random_kjt(tables, batch=batch, seed=seed, **kw)))
    return out


def torchrec_dlrm(tables, optimizer, **kw):
    """TorchRec's own DLRM over a SparseCore collection, its dense parts on tpu."""
    from torchrec.models.dlrm import DLRM

    torch.manual_seed(0)
    ebc = SparseCoreEmbeddingBagCollection(tables, optimizer, device="tpu", **kw)
    return DLRM(embedding_bag_collection=ebc, dense_in_features=4, dense_arch_layer_sizes=[16, 8],
                over_arch_layer_sizes=[16, 1], dense_device=torch.device("tpu"))


DLRM_TABLES = [EmbeddingBagConfig(name=f"t{i}", num_embeddings=40 + 20 * i, embedding_dim=8, feature_names=[f"f{i}"])
               for i in range(3)]


def test_torchrecs_dlrm_trains_on_raw_kjts_under_fullgraph_compile_as_eager(monkeypatch):
    """Ordinary TorchRec code - DLRM(dense, KJT) - under torch.compile(backend="tpu",
    fullgraph=True): the KJT's preprocessing is one op of the graph, so nothing breaks
    it; losses, dense weights, tables and the observed limits match eager's, and the
    dense parts are compiled (the graph is split only around the engine)."""
    import warnings

    splits = record_splits(monkeypatch.setattr)
    eager = torchrec_dlrm(DLRM_TABLES, optim.RowWiseAdagrad(lr=0.1))
    compiled = torchrec_dlrm(DLRM_TABLES, optim.RowWiseAdagrad(lr=0.1))
    compiled.load_state_dict(eager.state_dict())
    batches = kjt_batches(DLRM_TABLES, 10, max_len=6)
    assert len({kjt.values().numel() for _, kjt in batches}) > 5  # the ids per batch vary
    expected = train_on_kjts(eager, batches)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no "shape specializations" fallback
        losses = train_on_kjts(torch.compile(compiled, backend="tpu", fullgraph=True), batches)
    torch.testing.assert_close(losses, expected, rtol=1e-5, atol=1e-6)
    for key, value in eager.state_dict().items():
        torch.testing.assert_close(compiled.state_dict()[key], value, rtol=1e-4, atol=1e-5, msg=key)
    ebc = compiled.sparse_arch.embedding_bag_collection
    assert ebc.observed_limits() == eager.sparse_arch.embedding_bag_collection.observed_limits()
    # One static graph, then one for every id count (Dynamo's automatic dynamic): forward
    # and backward of each, not a compile per batch.
    assert 2 <= len(splits) <= 4, len(splits)
    assert all(has_compiled_segment(split) for split in splits), splits


@pytest.mark.parametrize("backend", ["aot_eager", "tpu"])
def test_weighted_kjts_and_dropped_ids_under_fullgraph_compile_match_eager(backend):
    """KJT weights scale the rows, and with allow_id_dropping the ids past a partition's
    limit are dropped and counted once per batch, in a compiled step as in eager."""
    tables = [EmbeddingBagConfig(name="t", num_embeddings=50, embedding_dim=8, feature_names=["a", "b"])]
    config = [SparseCoreEmbeddingConfig(config=tables[0], max_ids_per_partition=3, max_unique_ids_per_partition=3)]
    kw = dict(is_weighted=True, allow_id_dropping=True, num_sparsecores=2)
    eager = SparseCoreEmbeddingBagCollection(config, optim.Adagrad(lr=0.1), device="tpu", **kw)
    compiled_module = SparseCoreEmbeddingBagCollection(config, optim.Adagrad(lr=0.1), device="tpu", **kw)
    compiled_module.load_state_dict(eager.state_dict())

    def loss_fn(module, kjt):
        return module(kjt).values().square().sum()

    compiled = torch.compile(loss_fn, backend=backend, fullgraph=True)
    for seed in range(4):
        kjt = random_kjt(tables, batch=6, seed=seed, weighted=True, max_len=6)
        loss = compiled(compiled_module, kjt)
        loss.backward()
        expected = loss_fn(eager, kjt)
        expected.backward()
        torch.testing.assert_close(loss.detach().cpu(), expected.detach().cpu())
    assert eager.dropped_ids()["t"] > 0
    assert compiled_module.dropped_ids() == eager.dropped_ids()
    torch.testing.assert_close(compiled_module.table_weight("t"), eager.table_weight("t"))


def test_bad_kjts_in_a_compiled_step_raise_the_eager_errors_before_any_table_changes():
    module = SparseCoreEmbeddingBagCollection(DLRM_TABLES, optim.SGD(lr=0.5), device="tpu")
    step = torch.compile(lambda kjt: module(kjt).values().sum(), backend="tpu", fullgraph=True)
    step(random_kjt(DLRM_TABLES, batch=3)).backward()
    before = module.state_dict()
    keys = [f"f{i}" for i in range(3)]
    out_of_range = KeyedJaggedTensor.from_lengths_sync(keys=keys, values=torch.tensor([1, 75, 3]),
                                                       lengths=torch.tensor([1, 0, 0, 0, 1, 0, 0, 0, 1]))
    with pytest.raises(InputError, match=r"feature 'f1' \(table 't1'\): id 75 is out of range; expected 0 <= id < 60"):
        step(out_of_range)
    negative = KeyedJaggedTensor(keys=keys, values=torch.tensor([1, 2, 3]),
                                 lengths=torch.tensor([2, -1, 0, 0, 1, 0, 0, 0, 1]))
    with pytest.raises(InputError, match="lengths must be non-negative"):
        step(negative)
    for key, value in module.state_dict().items():
        assert torch.equal(value, before[key]), key


def test_a_copied_module_compiled_on_kjts_trains_itself_not_the_original():
    """The op finds its module by a key; a deepcopy gets its own."""
    import copy

    original = SparseCoreEmbeddingBagCollection(DLRM_TABLES, optim.SGD(lr=0.5), device="tpu")
    copied = copy.deepcopy(original)
    before = {k: v.clone() for k, v in original.state_dict().items()}
    step = torch.compile(lambda kjt: copied(kjt).values().sum(), backend="tpu", fullgraph=True)
    step(random_kjt(DLRM_TABLES, batch=3)).backward()
    assert all(torch.equal(v, before[k]) for k, v in original.state_dict().items())
    assert any(not torch.equal(v, before[k]) for k, v in copied.state_dict().items())


def test_position_weighted_features_train_under_fullgraph_compile_as_eager(monkeypatch):
    """TorchRec's position-weighted features (weights made from a parameter, so they need
    a gradient) over the engine, under torch.compile(backend="tpu", fullgraph=True): the
    weights' gradient is two ops of the graph, so nothing breaks it; losses, position
    weights and tables match eager's as the ids per batch vary, with no compile per batch."""
    import copy

    from torchrec.modules.feature_processor_ import PositionWeightedModuleCollection
    from torchrec.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection

    tables = [EmbeddingBagConfig(name="t", num_embeddings=30, embedding_dim=8, feature_names=["a", "b"]),
              EmbeddingBagConfig(name="u", num_embeddings=20, embedding_dim=4, feature_names=["c"],
                                 pooling=PoolingType.MEAN)]
    torch.manual_seed(0)
    positions = PositionWeightedModuleCollection({"a": 6, "b": 6, "c": 6})
    with torch.no_grad():
        for p in positions.parameters():
            p.uniform_(0.5, 1.5)
    engine = SparseCoreEmbeddingBagCollection(tables, optim.Adagrad(lr=0.1), device="tpu", is_weighted=True)
    models = [FeatureProcessedEmbeddingBagCollection(copy.deepcopy(engine), copy.deepcopy(positions).to("tpu"))
              for _ in range(2)]
    optimizers = [torch.optim.SGD(m._feature_processors.parameters(), lr=0.5) for m in models]
    splits = record_splits(monkeypatch.setattr)

    def step(model, kjt):
        return model(kjt).values().square().sum()

    steps = [step, torch.compile(step, backend="tpu", fullgraph=True)]
    batches = [random_kjt(tables, batch=5, seed=seed, max_len=6).to("tpu") for seed in range(6)]
    assert len({kjt.values().numel() for kjt in batches}) > 3  # the ids per batch vary
    losses = [[], []]
    for kjt in batches:
        for i in range(2):
            loss = steps[i](models[i], kjt)
            optimizers[i].zero_grad()
            loss.backward()
            optimizers[i].step()
            losses[i].append(float(loss.detach()))
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    eager, compiled = (dict(m._feature_processors.named_parameters()) for m in models)
    for name, p in eager.items():
        assert not torch.equal(p.detach().cpu(), dict(positions.named_parameters())[name])  # they trained
        torch.testing.assert_close(compiled[name].detach().cpu(), p.detach().cpu(), rtol=1e-5, atol=1e-6)
    for t in tables:
        torch.testing.assert_close(models[1]._embedding_bag_collection.table_weight(t.name).cpu(),
                                   models[0]._embedding_bag_collection.table_weight(t.name).cpu(),
                                   rtol=1e-5, atol=1e-6)
    assert 2 <= len(splits) <= 4, len(splits)  # static, then dynamic: forward and backward of each
    assert all(has_compiled_segment(split) for split in splits), splits  # the static ops compiled


@pytest.mark.parametrize("backend", ["aot_eager", "tpu"])
def test_sequence_collections_train_on_raw_kjts_under_fullgraph_compile_as_eager(backend, monkeypatch):
    """A SparseCoreEmbeddingCollection called with a raw KJT inside torch.compile(fullgraph=True),
    as TorchRec's EmbeddingCollection compiles: the preprocessing is the graph's op, the
    output's rows per feature are the KJT's id counts (symbolic sizes once they vary), and
    outputs, tables and observed limits match eager's with no compile per batch."""
    import copy

    from torchrec import EmbeddingConfig

    from sparsecore.modules import SparseCoreEmbeddingCollection

    tables = [EmbeddingConfig(name="t", num_embeddings=40, embedding_dim=8, feature_names=["a", "b"]),
              EmbeddingConfig(name="u", num_embeddings=25, embedding_dim=4, feature_names=["c"])]
    torch.manual_seed(0)
    eager = SparseCoreEmbeddingCollection(tables, optim.Adam(lr=0.05), device="tpu")
    compiled_module = copy.deepcopy(eager)
    splits = record_splits(monkeypatch.setattr)

    def loss_fn(module, kjt):
        out = module(kjt)
        return sum((out[f].values() * (i + 1)).square().sum() + out[f].lengths().sum() for i, f in enumerate("abc"))

    compiled = torch.compile(loss_fn, backend=backend, fullgraph=True)
    batches = [random_kjt(tables, batch=5, seed=seed, max_len=5) for seed in range(6)]
    assert len({tuple(kjt.length_per_key()) for kjt in batches}) > 3  # the ids per feature vary
    for kjt in batches:
        loss = compiled(compiled_module, kjt)
        loss.backward()
        expected = loss_fn(eager, kjt)
        expected.backward()
        torch.testing.assert_close(loss.detach().cpu(), expected.detach().cpu(), rtol=1e-5, atol=1e-5)
    for t in tables:
        torch.testing.assert_close(compiled_module.table_weight(t.name).cpu(), eager.table_weight(t.name).cpu(),
                                   rtol=1e-5, atol=1e-6)
    assert compiled_module.observed_limits() == eager.observed_limits()
    if backend == "tpu":
        assert 2 <= len(splits) <= 4, len(splits)  # static, then dynamic: forward and backward of each
