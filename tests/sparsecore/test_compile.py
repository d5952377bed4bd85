"""torch.compile(fullgraph=True) of a module calling the engine, with
backend="aot_eager" and with torch_tpu's "tpu" backend (whose graphs holding
SparseCore ops run op by op: their in-place state and executor are not the
CPU compile's to take)."""

import pytest
import torch

from sparsecore import optim
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
    from torchrec import EmbeddingBagConfig

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
