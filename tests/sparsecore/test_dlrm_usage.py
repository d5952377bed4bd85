"""The engine where TorchRec takes an EmbeddingBagCollection: inside torchrec.models.dlrm.DLRM."""

import copy

import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.models.dlrm import DLRM

from sparsecore import optim
from sparsecore.modules import SparseCoreEmbeddingBagCollection
from tests.sparsecore.test_modules import random_kjt

TABLES = [EmbeddingBagConfig(name=f"t{i}", num_embeddings=50 + i, embedding_dim=8, feature_names=[f"f{i}"]) for i in range(3)]


def test_dlrm_with_the_engine_trains_like_dlrm_with_torchrec():
    torch.manual_seed(0)
    reference = DLRM(embedding_bag_collection=EmbeddingBagCollection(tables=TABLES), dense_in_features=4,
                     dense_arch_layer_sizes=[16, 8], over_arch_layer_sizes=[16, 1])
    engine_ebc = SparseCoreEmbeddingBagCollection(TABLES, optim.SGD(lr=0.05), device="tpu")
    engine_ebc.load_state_dict(reference.sparse_arch.embedding_bag_collection.state_dict())
    model = DLRM(embedding_bag_collection=engine_ebc, dense_in_features=4,
                 dense_arch_layer_sizes=[16, 8], over_arch_layer_sizes=[16, 1])
    model.dense_arch.load_state_dict(copy.deepcopy(reference.dense_arch.state_dict()))
    model.over_arch.load_state_dict(copy.deepcopy(reference.over_arch.state_dict()))
    model.dense_arch.to("tpu"), model.over_arch.to("tpu")
    dense_opt = torch.optim.SGD(list(model.dense_arch.parameters()) + list(model.over_arch.parameters()), lr=0.05)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05)
    with torch.tpu.precision("highest"):
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            dense, labels = torch.randn(6, 4, generator=g), torch.randint(0, 2, (6,), generator=g).float()
            kjt = random_kjt(TABLES, batch=6, seed=step)
            loss = torch.nn.functional.binary_cross_entropy_with_logits(
                model(dense.to("tpu"), kjt).squeeze(1), labels.to("tpu"))
            dense_opt.zero_grad()
            loss.backward()
            dense_opt.step()
            ref_loss = torch.nn.functional.binary_cross_entropy_with_logits(reference(dense, kjt).squeeze(1), labels)
            ref_opt.zero_grad()
            ref_loss.backward()
            ref_opt.step()
            torch.testing.assert_close(loss.cpu(), ref_loss.detach(), atol=1e-5, rtol=1e-5)
    for key, value in reference.sparse_arch.embedding_bag_collection.state_dict().items():
        torch.testing.assert_close(engine_ebc.state_dict()[key].cpu(), value, atol=1e-5, rtol=1e-5)
