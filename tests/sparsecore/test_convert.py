"""Converters, memory breakdown and meta-device construction."""

import dataclasses
import gc

import pytest
import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig
from torchrec.modules.embedding_configs import DataType

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


def test_max_seq_len_is_refused_by_to_torchrec():
    from sparsecore import SparseCoreEmbeddingConfig
    from sparsecore.modules import SparseCoreEmbeddingCollection

    table = EmbeddingConfig(name="s", num_embeddings=10, embedding_dim=4, feature_names=["q"])
    engine = SparseCoreEmbeddingCollection([SparseCoreEmbeddingConfig(config=table, max_seq_len=1)], device="cpu")
    with pytest.raises(ConfigError, match="max_seq_len=1 is invalid; expected None: TorchRec's EmbeddingCollection"):
        to_torchrec(engine)


@pytest.mark.parametrize("move", ["to_empty", "to"])
def test_materializing_or_moving_the_enclosing_model_moves_the_optimizer_state(move):
    # nn.Module.to_empty / .to on a parent reach the engine only through _apply.
    reference = EmbeddingBagCollection(tables=TABLES)
    # Adagrad: its dense form leaves untouched rows as the fused one does (dense Adam would not).
    engine = SparseCoreEmbeddingBagCollection(TABLES, optim.Adagrad(lr=0.01), device="meta" if move == "to_empty" else "cpu")
    model = torch.nn.ModuleDict({"ebc": engine})
    if move == "to_empty":
        model.to_empty(device="tpu")
        engine.load_state_dict(reference.state_dict())
    else:
        engine.load_state_dict(reference.state_dict())
        engine.fused_optimizer.param_groups[0]["lr"] = 0.02
        engine(random_kjt(TABLES, batch=4, seed=3)).values().sum().backward()  # a step on cpu first
        reference_optimizer = torch.optim.Adagrad(reference.parameters(), lr=0.02)
        reference(random_kjt(TABLES, batch=4, seed=3)).values().sum().backward()
        reference_optimizer.step()
        model.to("tpu")
    assert all(t.device.type == "tpu" for group in engine._optimizer_state.values() for t in group.values())
    kjt = random_kjt(TABLES, batch=4, seed=4)
    out = engine(kjt).values()  # the training forward (the path that reads the placeholder)
    torch.testing.assert_close(out.detach().cpu(), reference(kjt).values().detach())
    out.sum().backward()
    if move == "to":  # the accumulators and the lr came along: a second step matches
        reference_optimizer.zero_grad()
        reference(kjt).values().sum().backward()
        reference_optimizer.step()
        for key, expected in reference.state_dict().items():
            torch.testing.assert_close(engine.state_dict()[key].cpu(), expected, atol=1e-6, rtol=1e-5)


def test_strict_load_reports_a_missing_table_with_torchrec_s_key():
    engine = SparseCoreEmbeddingBagCollection(TABLES, device="cpu")
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "embedding_bags\.'):
        engine.load_state_dict({}, strict=True)
    result = engine.load_state_dict({}, strict=False)
    assert sorted(result.missing_keys) == sorted(EmbeddingBagCollection(tables=TABLES).state_dict())


def test_the_whole_module_pickles_with_its_learning_rate():
    import io

    engine = SparseCoreEmbeddingBagCollection(TABLES, optim.SGD(lr=0.1), device="cpu")
    engine.fused_optimizer.param_groups[0]["lr"] = 0.3
    buffer = io.BytesIO()
    torch.save(engine, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert loaded.fused_optimizer.param_groups[0]["lr"] == 0.3 and float(loaded._hyper[0]) == 0.3
    kjt = random_kjt(TABLES, batch=4, seed=1)
    torch.testing.assert_close(loaded(kjt).values(), engine(kjt).values())


def test_a_suggested_buffer_size_pads_small_batches_to_one_shape():
    from sparsecore import SparseCoreEmbeddingConfig

    sized = [SparseCoreEmbeddingConfig(config=t, suggested_coo_buffer_size_per_device=250) for t in TABLES]
    reference = EmbeddingBagCollection(tables=TABLES)
    engine = SparseCoreEmbeddingBagCollection(sized, optim.SGD(lr=0.1), device="tpu", num_sparsecores=4)
    engine.load_state_dict(reference.state_dict())
    shapes = {tuple(b.embedding_ids.shape) for seed in range(3)
              for b in engine.preprocess(random_kjt(TABLES, batch=3 + seed, seed=seed)).stacks.values()}
    assert shapes == {(4, 64)}  # 250 entries over 4 receivers, in steps of 8
    kjt = random_kjt(TABLES, batch=5, seed=7)
    out = engine(kjt).values()
    torch.testing.assert_close(out.detach().cpu(), reference(kjt).values().detach())
    out.sum().backward()  # the padding trains nothing
    train = torch.optim.SGD(reference.parameters(), lr=0.1)
    reference(kjt).values().sum().backward()
    train.step()
    for key, expected in reference.state_dict().items():
        torch.testing.assert_close(engine.state_dict()[key].cpu(), expected, atol=1e-6, rtol=1e-5)
    unsized = SparseCoreEmbeddingBagCollection(TABLES, device="tpu", num_sparsecores=4).memory_breakdown()["buffers"]
    assert engine.memory_breakdown()["buffers"] == sum(
        max(s.num_sparsecores ** 2 * (s.max_ids_per_partition * 12 + 4), 250 * 12) for s in engine.stacks)
    assert engine.memory_breakdown()["buffers"] >= unsized


def bf16_table(rows: int = 40) -> EmbeddingBagConfig:
    return EmbeddingBagConfig(name="b", num_embeddings=rows, embedding_dim=8, feature_names=["fb"],
                              data_type=DataType.BF16)


def test_a_bf16_table_is_rounded_as_torchrec_s_sharding_rounds_it():
    # TorchRec's unsharded module holds the BF16 table in float16; its sharded module's bfloat16
    # table loads that state dict by rounding to nearest even, which is torch's cast.
    reference = EmbeddingBagCollection(tables=[bf16_table()])
    held = reference.embedding_bags["b"].weight.detach()
    assert held.dtype == torch.float16
    engine = from_torchrec(reference, device="tpu")
    assert torch.equal(engine.table_weight("b").cpu(), held.to(torch.bfloat16))
    back = engine.to_torchrec().embedding_bags["b"].weight.detach()
    assert torch.equal(back, held.to(torch.bfloat16).to(torch.float16))


def test_to_torchrec_refuses_bf16_values_past_float16_s_range():
    engine = SparseCoreEmbeddingBagCollection([bf16_table(rows=3)], device="tpu")
    weight = torch.zeros(3, 8)
    weight[1, 2] = 1e5  # a bfloat16 holds it; TorchRec's float16 table would hold inf
    engine.set_table_weight("b", weight)
    with pytest.raises(ValueError, match="cannot hold its 1 values past 65504"):
        to_torchrec(engine)
