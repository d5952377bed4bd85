"""SparseCoreEmbeddingCollection against torchrec.EmbeddingCollection (sequence features)."""

import pytest
import torch
from torchrec import EmbeddingCollection, EmbeddingConfig

from sparsecore import optim
from sparsecore.config import SparseCoreEmbeddingConfig
from sparsecore.modules import SparseCoreEmbeddingCollection
from tests.sparsecore.test_modules import random_kjt

TABLES = [
    EmbeddingConfig(name="item", num_embeddings=41, embedding_dim=8, feature_names=["clicked", "bought"]),
    EmbeddingConfig(name="shops", num_embeddings=9, embedding_dim=8, feature_names=["shop"]),
]


def pair(**kw):
    reference = EmbeddingCollection(tables=TABLES)
    engine = SparseCoreEmbeddingCollection(TABLES, device="tpu", **kw)
    engine.load_state_dict(reference.state_dict())
    return reference, engine


@pytest.mark.parametrize("batch", [5, 400])  # 400: many bags, split across threads
def test_forward_matches_torchrec(batch):
    reference, engine = pair()
    assert list(engine.state_dict()) == list(reference.state_dict())
    for seed in range(3):
        kjt = random_kjt(TABLES, batch=batch, seed=seed)
        expected, actual = reference(kjt), engine(kjt)
        assert list(actual) == list(expected)
        for key in expected:
            torch.testing.assert_close(actual[key].values().cpu(), expected[key].values().detach())
            assert actual[key].lengths().tolist() == expected[key].lengths().tolist()


def test_max_seq_len_keeps_the_first_ids():
    cfg = [SparseCoreEmbeddingConfig(config=TABLES[1], max_seq_len=2)]
    engine = SparseCoreEmbeddingCollection(cfg, device="tpu")
    kjt = random_kjt(TABLES[1:], batch=4, seed=3, max_len=5)
    out = engine(kjt)["shop"]
    table = engine.state_dict()["embeddings.shops.weight"].cpu()
    ids = kjt["shop"].to_dense()
    expected = torch.cat([table[row[:2]] for row in ids])
    torch.testing.assert_close(out.values().cpu(), expected)
    assert out.lengths().tolist() == [min(len(row), 2) for row in ids]


def test_sequence_training_matches_dense_sgd():
    reference, engine = pair()
    engine = SparseCoreEmbeddingCollection(TABLES, optim.SGD(lr=0.1), device="tpu")
    engine.load_state_dict(reference.state_dict())
    train = torch.optim.SGD(reference.parameters(), lr=0.1)
    for seed in range(3):
        kjt = random_kjt(TABLES, batch=4, seed=seed)
        loss = sum((jt.values() ** 2).sum() for jt in engine(kjt).values())
        loss.backward()
        train.zero_grad()
        sum((jt.values() ** 2).sum() for jt in reference(kjt).values()).backward()
        train.step()
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(engine.state_dict()[key].cpu(), value, atol=1e-6, rtol=1e-5)
