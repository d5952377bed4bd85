"""Converters, memory breakdown and meta-device construction."""

import dataclasses
import gc

import pytest
import torch
from torchrec import EmbeddingBagCollection, EmbeddingCollection, EmbeddingConfig

from sparsecore import optim
from sparsecore.config import as_sparsecore_config
from sparsecore.convert import from_torchrec, to_torchrec
from sparsecore.errors import ConfigError
from sparsecore.modules import SparseCoreEmbeddingBagCollection
from tests.sparsecore.test_modules import TABLES, random_kjt


def test_bag_collection_round_trip_keeps_outputs():
    reference = EmbeddingBagCollection(tables=TABLES)
    engine = from_torchrec(reference, device="tpu")
    kjt = random_kjt(TABLES, batch=6)
    torch.testing.assert_close(engine(kjt).values().cpu(), reference(kjt).values().detach())
    back = engine.to_torchrec()
    torch.testing.assert_close(back(kjt).values(), reference(kjt).values())


def test_sequence_collection_round_trip():
    tables = [EmbeddingConfig(name="s", num_embeddings=13, embedding_dim=4, feature_names=["q"])]
    reference = EmbeddingCollection(tables=tables)
    back = to_torchrec(from_torchrec(reference, device="tpu"))
    kjt = random_kjt(tables, batch=3)
    torch.testing.assert_close(back(kjt)["q"].values(), reference(kjt)["q"].values())


def test_sqrtn_is_refused_by_to_torchrec():
    cfg = dataclasses.replace(as_sparsecore_config(TABLES[0]), combiner="sqrtn")
    with pytest.raises(ConfigError, match="TorchRec has no sqrtn pooling"):
        to_torchrec(SparseCoreEmbeddingBagCollection([cfg], device="cpu"))


def test_memory_breakdown_counts_tables_and_state():
    engine = SparseCoreEmbeddingBagCollection(TABLES, optim.Adam(), device="tpu")
    sizes = engine.memory_breakdown()
    rows = sum(s.num_sparsecores * s.rows_per_sparsecore * s.embedding_dim for s in engine.stacks)
    assert sizes["tables"] == rows * 4
    assert sizes["optimizer_state"] == 2 * rows * 4  # two fp32 moments
    assert sizes["total"] == sizes["tables"] + sizes["optimizer_state"] + sizes["buffers"] > 0


def test_meta_construction_then_materialization():
    meta = SparseCoreEmbeddingBagCollection(TABLES, optim.SGD(lr=0.1), device="meta")
    assert all(w.device.type == "meta" for w in meta.parameters())
    # Earlier tests' garbage and queued work freed now, not in the middle of the measurement.
    torch.tpu.synchronize()
    gc.collect()
    before = torch.tpu.memory_allocated()
    meta.to_empty(device="tpu")
    assert torch.tpu.memory_allocated() - before >= meta.memory_breakdown()["tables"]
    reference = EmbeddingBagCollection(tables=TABLES)
    meta.load_state_dict(reference.state_dict())
    kjt = random_kjt(TABLES, batch=4)
    torch.testing.assert_close(meta(kjt).values().detach().cpu(), reference(kjt).values().detach())
    meta(kjt).values().sum().backward()  # trains after materialization
