"""Gradients of a KJT's weights (sparsecore.weight_gradient): TorchRec's position-weighted
features trained on the engine, against TorchRec's own modules and a hand computation."""

from __future__ import annotations

import copy

import pytest
import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, PoolingType
from torchrec.modules.feature_processor_ import PositionWeightedModuleCollection
from torchrec.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from sparsecore import SparseCoreEmbeddingBagCollection, optim
from sparsecore.errors import InputError

TABLES = [
    EmbeddingBagConfig(name="t", num_embeddings=20, embedding_dim=8, feature_names=["f", "g"]),
    EmbeddingBagConfig(name="u", num_embeddings=7, embedding_dim=4, feature_names=["h"]),
]


def _batch(step: int) -> KeyedJaggedTensor:
    """Batch 3 with repeated ids within and across bags, an empty bag, and every feature."""
    gen = torch.Generator().manual_seed(step)
    lengths = torch.tensor([2, 0, 3, 1, 2, 1, 3, 1, 2])
    limits = [20] * 6 + [7] * 3
    values = torch.cat([torch.randint(0, limit, (int(n),), generator=gen) for n, limit in zip(lengths, limits)])
    return KeyedJaggedTensor.from_lengths_sync(keys=["f", "g", "h"], values=values, lengths=lengths)


def _engine_like(reference: EmbeddingBagCollection, tables=TABLES, lr: float = 0.1, **kwargs):
    engine = SparseCoreEmbeddingBagCollection(tables, optim.SGD(lr=lr), device="tpu", is_weighted=True, **kwargs)
    for t in tables:
        engine.set_table_weight(t.name, reference.embedding_bags[t.name].weight.detach().to("tpu"))
    return engine


def test_position_weighted_features_train_as_in_torchrec():
    # The weight gradient reads the rows the lookup read: the fused SGD steps them in the
    # same backward, with repeated ids, so reading them after the step would drift from
    # TorchRec's dense-gradient reference within one step.
    torch.manual_seed(0)
    reference_ebc = EmbeddingBagCollection(TABLES, is_weighted=True)
    engine = _engine_like(reference_ebc)
    positions = PositionWeightedModuleCollection({"f": 3, "g": 3, "h": 3})
    with torch.no_grad():
        for p in positions.parameters():
            p.uniform_(0.5, 1.5)
    start = {n: p.detach().clone() for n, p in positions.named_parameters()}
    reference = FeatureProcessedEmbeddingBagCollection(reference_ebc, positions)
    model = FeatureProcessedEmbeddingBagCollection(engine, copy.deepcopy(positions).to("tpu"))
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    positions_optimizer = torch.optim.SGD(model._feature_processors.parameters(), lr=0.1)
    for step in range(3):
        kjt = _batch(step)
        upstream = torch.randn(3, 20, generator=torch.Generator().manual_seed(100 + step))
        want = reference(kjt)
        reference_optimizer.zero_grad()
        (want.values() * upstream).sum().backward()
        reference_optimizer.step()
        got = model(kjt.to("tpu"))
        positions_optimizer.zero_grad()
        (got.values() * upstream.to("tpu")).sum().backward()
        positions_optimizer.step()
        assert got.keys() == want.keys()
        torch.testing.assert_close(got.values().detach().cpu(), want.values().detach(), rtol=0, atol=1e-6)
    for name, p in model._feature_processors.named_parameters():
        want = dict(positions.named_parameters())[name].detach()
        assert not torch.equal(want, start[name])  # they trained
        torch.testing.assert_close(p.detach().cpu(), want, rtol=0, atol=1e-6)
    for t in TABLES:
        torch.testing.assert_close(engine.table_weight(t.name).cpu(), reference_ebc.embedding_bags[t.name].weight.detach(),
                                   rtol=0, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_weight_gradient_matches_a_hand_computation_with_mean_pooling(dtype):
    # TorchRec refuses weights with mean pooling; the engine pools w_i * row_i / len.
    data_type = {torch.float32: "FP32", torch.float16: "FP16"}[dtype]
    from torchrec.types import DataType

    tables = [EmbeddingBagConfig(name="m", num_embeddings=9, embedding_dim=4, feature_names=["a"],
                                 pooling=PoolingType.MEAN, data_type=DataType[data_type]),
              EmbeddingBagConfig(name="s", num_embeddings=5, embedding_dim=2, feature_names=["b"])]
    engine = SparseCoreEmbeddingBagCollection(tables, optim.SGD(lr=0.5), device="tpu", is_weighted=True)
    rows = {t.name: engine.table_weight(t.name).cpu().float() for t in tables}
    values = torch.tensor([3, 3, 8, 1, 0, 4, 4, 2])
    lengths = torch.tensor([3, 1, 2, 2])  # a: [3, 3, 8], [1]; b: [0, 4], [4, 2]
    weights = torch.tensor([0.5, 2.0, -1.0, 3.0, 1.5, 0.25, -2.0, 1.0], requires_grad=True)
    upstream = torch.randn(2, 6)
    out = engine(KeyedJaggedTensor.from_lengths_sync(keys=["a", "b"], values=values, lengths=lengths, weights=weights))
    (out.values() * upstream.to("tpu")).sum().backward()
    by_hand = torch.stack([
        rows["m"][3] @ upstream[0, :4] / 3, rows["m"][3] @ upstream[0, :4] / 3, rows["m"][8] @ upstream[0, :4] / 3,
        rows["m"][1] @ upstream[1, :4],
        rows["s"][0] @ upstream[0, 4:], rows["s"][4] @ upstream[0, 4:],
        rows["s"][4] @ upstream[1, 4:], rows["s"][2] @ upstream[1, 4:],
    ])
    assert weights.grad.device.type == "cpu"  # where the weights are
    torch.testing.assert_close(weights.grad, by_hand, rtol=1e-6, atol=1e-6)


def test_unweighted_collections_ignore_the_weights_as_torchrec_does():
    engine = SparseCoreEmbeddingBagCollection(TABLES, optim.SGD(lr=0.1), device="tpu")  # is_weighted False
    kjt = _batch(0)
    weights = torch.rand(kjt.values().numel(), requires_grad=True)
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=kjt.keys(), values=kjt.values(), lengths=kjt.lengths(),
                                              weights=weights)
    engine(kjt).values().sum().backward()
    assert weights.grad is None


@pytest.mark.parametrize("case", ["sqrtn", "dropping"])
def test_weights_whose_gradient_cannot_be_given_are_refused(case):
    from sparsecore import SparseCoreEmbeddingConfig

    table = EmbeddingBagConfig(name="t", num_embeddings=10, embedding_dim=4, feature_names=["f"])
    if case == "sqrtn":
        engine = SparseCoreEmbeddingBagCollection([SparseCoreEmbeddingConfig(config=table, combiner="sqrtn")],
                                                  optim.SGD(lr=0.1), device="tpu", is_weighted=True)
        match = "sqrtn"
    else:
        engine = SparseCoreEmbeddingBagCollection([table], optim.SGD(lr=0.1), device="tpu", is_weighted=True,
                                                  allow_id_dropping=True)
        match = "allow_id_dropping"
    w = torch.rand(3, requires_grad=True)
    kjt = KeyedJaggedTensor(keys=["f"], values=torch.tensor([1, 2, 3]), lengths=torch.tensor([2, 1]), weights=w)
    with pytest.raises(InputError, match=match):
        engine(kjt)
    with torch.no_grad():
        engine(kjt)  # no gradient asked for: fine
    engine(KeyedJaggedTensor(keys=["f"], values=torch.tensor([1, 2, 3]), lengths=torch.tensor([2, 1]),
                             weights=w.detach()))


def test_compiled_steps_train_the_weights_with_the_same_numbers():
    torch.manual_seed(0)
    eager = SparseCoreEmbeddingBagCollection(TABLES, optim.SGD(lr=0.1), device="tpu", is_weighted=True)
    traced = copy.deepcopy(eager)
    kjt = _batch(1).to("tpu")
    weights = {name: torch.rand(kjt.values().numel(), device="tpu", requires_grad=True) for name in ("eager", "traced")}
    with torch.no_grad():
        weights["traced"].copy_(weights["eager"])

    def step(engine, w):
        features = KeyedJaggedTensor.from_lengths_sync(keys=kjt.keys(), values=kjt.values(), lengths=kjt.lengths(),
                                                       weights=w * 2)
        return (engine(features).values() ** 2).sum()

    step(eager, weights["eager"]).backward()
    torch.compile(step, backend="aot_eager")(traced, weights["traced"]).backward()
    torch.testing.assert_close(weights["traced"].grad.cpu(), weights["eager"].grad.cpu(), rtol=0, atol=0)
    for t in TABLES:
        assert torch.equal(traced.table_weight(t.name).cpu(), eager.table_weight(t.name).cpu())


def test_forward_async_trains_the_weights_and_prefetch_refuses_them():
    torch.manual_seed(0)
    sync = SparseCoreEmbeddingBagCollection(TABLES, optim.SGD(lr=0.1), device="tpu", is_weighted=True)
    asynchronous = copy.deepcopy(sync)
    kjt = _batch(2)
    weights = {name: torch.rand(kjt.values().numel(), requires_grad=True) for name in ("sync", "async")}
    with torch.no_grad():
        weights["async"].copy_(weights["sync"])

    def features(w):
        return KeyedJaggedTensor.from_lengths_sync(keys=kjt.keys(), values=kjt.values(), lengths=kjt.lengths(), weights=w)

    (sync(features(weights["sync"])).values() ** 2).sum().backward()
    (asynchronous.forward_async(features(weights["async"])).result().values() ** 2).sum().backward()
    assert weights["async"].grad is not None
    torch.testing.assert_close(weights["async"].grad, weights["sync"].grad, rtol=0, atol=0)
    with pytest.raises(InputError, match="prefetch"):
        asynchronous.prefetch(features(weights["async"]))


def test_two_calls_before_one_backward_read_the_rows_each_call_looked_up():
    # The later call's fused update runs first in the backward; the earlier call's weights
    # must still get their gradient over the rows it looked up (as TorchRec's dense gradient).
    torch.manual_seed(0)
    reference_ebc = EmbeddingBagCollection(TABLES, is_weighted=True)
    engine = _engine_like(reference_ebc, lr=1.0)
    positions = PositionWeightedModuleCollection({"f": 3, "g": 3, "h": 3})
    with torch.no_grad():
        for p in positions.parameters():
            p.uniform_(0.5, 1.5)
    reference = FeatureProcessedEmbeddingBagCollection(reference_ebc, positions)
    model = FeatureProcessedEmbeddingBagCollection(engine, copy.deepcopy(positions).to("tpu"))
    first, second = _batch(0), _batch(1)
    (reference(first).values().sum() + reference(second).values().pow(2).sum()).backward()
    (model(first.to("tpu")).values().sum() + model(second.to("tpu")).values().pow(2).sum()).backward()
    for name, p in model._feature_processors.named_parameters():
        torch.testing.assert_close(p.grad.cpu(), dict(positions.named_parameters())[name].grad, rtol=1e-5, atol=1e-6)
