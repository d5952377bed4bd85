"""sparsecore.config: wrapping TorchRec configs, validation with named fields."""

import dataclasses

import pytest
import torch
from torchrec import EmbeddingBagConfig, EmbeddingConfig
from torchrec.modules.embedding_configs import DataType, PoolingType

from sparsecore.config import SparseCoreEmbeddingConfig, as_sparsecore_config
from sparsecore.errors import ConfigError


def bag(**kw):
    """A TorchRec config with fields set after construction (TorchRec itself fails on some bad values)."""
    cfg = EmbeddingBagConfig(name="t", num_embeddings=100, embedding_dim=8, feature_names=["f"])
    for field, value in kw.items():
        setattr(cfg, field, value)
    return cfg


def test_wraps_torchrec_config_and_exposes_its_fields():
    cfg = SparseCoreEmbeddingConfig(config=bag(pooling=PoolingType.MEAN, data_type=DataType.BF16))
    assert (cfg.name, cfg.num_embeddings, cfg.embedding_dim, cfg.feature_names) == ("t", 100, 8, ["f"])
    assert cfg.combiner_name == "mean" and cfg.dtype == torch.bfloat16 and cfg.is_pooled
    assert SparseCoreEmbeddingConfig(config=bag(), combiner="sqrtn").combiner_name == "sqrtn"
    seq = SparseCoreEmbeddingConfig(config=EmbeddingConfig(name="s", num_embeddings=5, embedding_dim=4, feature_names=["q"]), max_seq_len=3)
    assert not seq.is_pooled and seq.combiner_name == "none" and seq.pooling == PoolingType.NONE


def test_frozen_and_isolated_from_the_original():
    original = bag()
    cfg = SparseCoreEmbeddingConfig(config=original)
    original.num_embeddings = 5
    assert cfg.num_embeddings == 100
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.max_ids_per_partition = 3
    assert dataclasses.replace(cfg, max_ids_per_partition=512).max_ids_per_partition == 512


def test_a_table_without_feature_names_serves_its_namesake_as_in_torchrec():
    from torchrec import EmbeddingBagCollection

    reference = EmbeddingBagCollection(tables=[bag(feature_names=[])])
    assert SparseCoreEmbeddingConfig(config=bag(feature_names=[])).feature_names == ["t"]
    assert reference.embedding_bag_configs()[0].feature_names == ["t"]


def test_plain_torchrec_configs_get_defaults():
    cfg = as_sparsecore_config(bag())
    assert cfg.max_ids_per_partition == 256 and cfg.max_unique_ids_per_partition == 256
    assert as_sparsecore_config(cfg) is cfg


@pytest.mark.parametrize(
    "kwargs, field, allowed",
    [
        (dict(config=bag(num_embeddings=0)), "num_embeddings", "a positive integer"),
        (dict(config=bag(embedding_dim=-1)), "embedding_dim", "a positive integer"),
        (dict(config=bag(), max_ids_per_partition=0), "max_ids_per_partition", "a positive integer"),
        (dict(config=bag(), max_ids_per_partition=8, max_unique_ids_per_partition=16), "max_unique_ids_per_partition", "at most max_ids_per_partition (8)"),
        (dict(config=bag(), suggested_coo_buffer_size_per_device=-4), "suggested_coo_buffer_size_per_device", "a positive integer"),
        (dict(config=bag(data_type=DataType.INT8)), "data_type", "one of ['FP32', 'FP16', 'BF16']"),
        (dict(config=bag(), combiner="max"), "combiner", 'None or "sqrtn"'),
        (dict(config=bag(), max_seq_len=4), "max_seq_len", "None for a pooled"),
        (dict(config=EmbeddingConfig(name="s", num_embeddings=5, embedding_dim=4, feature_names=["q"]), combiner="sqrtn"), "combiner", "None for a sequence"),
    ],
)
def test_invalid_values_name_field_value_and_range(kwargs, field, allowed):
    with pytest.raises(ConfigError) as info:
        SparseCoreEmbeddingConfig(**kwargs)
    assert info.value.field == field
    assert allowed in str(info.value)
    assert f"{field}=" in str(info.value)
