"""Edge cases of compiled steps on raw KJTs (sparsecore.traced_preprocess) and of
TorchRec's position-weighted features under torch.compile (sparsecore.weight_gradient),
each against the same module run eagerly."""

import copy

import pytest
import torch
from torchrec import EmbeddingBagConfig, PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from sparsecore import optim
from sparsecore.modules import SparseCoreEmbeddingBagCollection
from tests.sparsecore.test_modules import random_kjt

PW_TABLES = [EmbeddingBagConfig(name="t", num_embeddings=20, embedding_dim=8, feature_names=["a", "b"]),
             EmbeddingBagConfig(name="u", num_embeddings=15, embedding_dim=4, feature_names=["c"],
                                pooling=PoolingType.MEAN)]


def position_weighted_pair(tables: list[EmbeddingBagConfig]) -> list[torch.nn.Module]:
    """Two equal FeatureProcessedEmbeddingBagCollections over the engine (Adagrad tables,
    position weights on tpu): one to run eagerly, one compiled."""
    from torchrec.modules.feature_processor_ import PositionWeightedModuleCollection
    from torchrec.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection

    torch.manual_seed(0)
    positions = PositionWeightedModuleCollection({f: 6 for t in tables for f in t.feature_names})
    with torch.no_grad():
        for p in positions.parameters():
            p.uniform_(0.5, 1.5)
    engine = SparseCoreEmbeddingBagCollection(tables, optim.Adagrad(lr=0.1), device="tpu", is_weighted=True)
    return [FeatureProcessedEmbeddingBagCollection(copy.deepcopy(engine), copy.deepcopy(positions).to("tpu"))
            for _ in range(2)]


def position_gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().cpu().clone() for name, p in model._feature_processors.named_parameters()}


def test_position_weights_called_twice_before_one_backward_get_eagers_gradient():
    """Two forwards, one backward: the later call's backward steps the tables first, so the
    earlier call's weight gradient must use the rows its forward read (as eager does), not
    rows read again in the compiled backward (where AOTAutograd's partitioner had moved the
    read, as only the backward used it)."""
    models = position_weighted_pair(PW_TABLES)

    def step(model: torch.nn.Module, kjt: KeyedJaggedTensor) -> torch.Tensor:
        return model(kjt).values().square().sum()

    steps = [step, torch.compile(step, backend="tpu", fullgraph=True)]
    for seed in range(2):
        kjt = random_kjt(PW_TABLES, batch=3, seed=seed).to("tpu")
        gradients = []
        for model, run in zip(models, steps):
            model.zero_grad()
            (run(model, kjt) + run(model, kjt)).backward()
            gradients.append(position_gradients(model))
        for name, expected in gradients[0].items():
            torch.testing.assert_close(gradients[1][name], expected, rtol=1e-5, atol=1e-6, msg=name)
    for t in PW_TABLES:
        torch.testing.assert_close(models[1]._embedding_bag_collection.table_weight(t.name).cpu(),
                                   models[0]._embedding_bag_collection.table_weight(t.name).cpu(),
                                   rtol=1e-5, atol=1e-6)


def test_a_kjt_lacking_a_sequence_feature_raises_eagers_error_under_fullgraph_compile():
    """A SparseCoreEmbeddingCollection given a KJT without one of its features refuses it with
    eager's InputError in a compiled step too (the trace had stopped at a KeyError, which
    Dynamo reports as an unexplained "Observed exception"), and no table changes."""
    from torchrec import EmbeddingConfig

    from sparsecore import InputError
    from sparsecore.modules import SparseCoreEmbeddingCollection

    tables = [EmbeddingConfig(name="t", num_embeddings=20, embedding_dim=8, feature_names=["a", "b"]),
              EmbeddingConfig(name="u", num_embeddings=15, embedding_dim=4, feature_names=["c"])]
    module = SparseCoreEmbeddingCollection(tables, optim.SGD(lr=0.1), device="tpu")
    before = {k: v.clone() for k, v in module.state_dict().items()}

    def step(kjt: KeyedJaggedTensor) -> torch.Tensor:
        return sum(jagged.values().sum() for jagged in module(kjt).values())

    lacking = KeyedJaggedTensor.from_lengths_sync(keys=["a", "c"], values=torch.tensor([1, 2, 3]),
                                                  lengths=torch.tensor([1, 1, 0, 1]))
    for run in (step, torch.compile(step, backend="tpu", fullgraph=True)):
        with pytest.raises(InputError, match=r"the batch lacks feature\(s\) \['b'\] that the tables expect"):
            run(lacking).backward()
    for key, value in module.state_dict().items():
        assert torch.equal(value, before[key]), key


@pytest.mark.parametrize("case", ["sqrtn", "dropping"])
def test_weights_whose_gradient_cannot_be_given_are_refused_with_eagers_error_under_fullgraph_compile(case):
    """sqrtn tables and allow_id_dropping refuse weights that require grad with an InputError
    saying why, in a compiled step too (it was raised while tracing, which Dynamo reports as
    an unexplained "Observed exception"), and no table changes."""
    from sparsecore import InputError, SparseCoreEmbeddingConfig

    table = EmbeddingBagConfig(name="t", num_embeddings=20, embedding_dim=8, feature_names=["a"])
    config = SparseCoreEmbeddingConfig(config=table, combiner="sqrtn" if case == "sqrtn" else None)
    module = SparseCoreEmbeddingBagCollection([config], optim.SGD(lr=0.1), device="tpu", is_weighted=True,
                                              allow_id_dropping=case == "dropping")
    before = module.table_weight("t").clone()
    weights = torch.ones(3, requires_grad=True)

    def step(weights: torch.Tensor) -> torch.Tensor:
        kjt = KeyedJaggedTensor(keys=["a"], values=torch.tensor([1, 2, 3]), lengths=torch.tensor([2, 1]),
                                weights=weights * 2)
        return module(kjt).values().sum()

    match = "sqrtn" if case == "sqrtn" else "allow_id_dropping"
    for run in (step, torch.compile(step, backend="tpu", fullgraph=True)):
        with pytest.raises(InputError, match=match):
            run(weights).backward()
    assert torch.equal(module.table_weight("t"), before)
