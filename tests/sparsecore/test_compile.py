"""torch.compile(fullgraph=True) of a module calling the engine, with
backend="aot_eager" and with torch_tpu's "tpu" backend (whose graphs holding
SparseCore ops run op by op: their in-place state and executor are not the
CPU compile's to take)."""

import pytest
import torch

from sparsecore import optim
from sparsecore.modules import SparseCoreEmbeddingBagCollection
from tests.sparsecore.test_modules import TABLES, random_kjt


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
