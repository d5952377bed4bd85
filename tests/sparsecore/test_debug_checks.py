"""The SparseCore kernels under torch_tpu's Debug mode: malformed COO buffers are caught before a
kernel reads past a table; well-formed ones (padding included) pass."""

import dataclasses

import pytest
import torch
from torchrec import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import sparsecore
import torch_tpu


@pytest.fixture(autouse=True)
def strict_after():
    yield
    torch_tpu.set_eager_mode("strict")


def collection():
    configs = [sparsecore.SparseCoreEmbeddingConfig(
        config=EmbeddingBagConfig(name=f"t{i}", num_embeddings=rows, embedding_dim=8, feature_names=[f"f{i}"]),
        max_ids_per_partition=64, max_unique_ids_per_partition=64) for i, rows in enumerate([40, 9])]
    return sparsecore.SparseCoreEmbeddingBagCollection(configs, sparsecore.optim.SGD(lr=0.1), "tpu")


def batch(ebc):
    kjt = KeyedJaggedTensor(keys=["f0", "f1"], values=torch.tensor([1, 39, 5, 0, 8, 3, 2]),
                            lengths=torch.tensor([2, 1, 1, 1, 1, 1]))
    return ebc.preprocess(kjt)


def with_entry(prepared, field: str, value: int):
    """The batch with its first real COO entry's ``field`` set to ``value``."""
    name, stack = next(iter(prepared.stacks.items()))
    receiver = int((stack.row_pointers[:, -1] > 0).nonzero()[0, 0])
    owner = int((stack.row_pointers[receiver] > 0).nonzero()[0, 0])
    column = stack.group_start(receiver, owner)
    tensor = getattr(stack, field).clone()
    tensor[receiver, column] = value
    stacks = dict(prepared.stacks, **{name: dataclasses.replace(stack, **{field: tensor})})
    return dataclasses.replace(prepared, stacks=stacks)


def test_a_well_formed_batch_trains_under_debug_as_under_strict():
    strict, debug = collection(), collection()
    debug.load_state_dict(strict.state_dict())
    strict(batch(strict)).values().sum().backward()
    with torch_tpu.eager_mode("debug"):
        debug(batch(debug)).values().sum().backward()
    for name in ("t0", "t1"):
        torch.testing.assert_close(debug.table_weight(name).cpu(), strict.table_weight(name).cpu(), rtol=0, atol=0)


@pytest.mark.parametrize("field, value, message", [
    ("embedding_ids", 10_000, r"^sparsecore\.(fused_)?lookup\.default: embedding_ids\[\d+, \d+\] = 10000 is out of range for the "
                              r"rows of a SparseCore's partition of size \d+"),
    ("sample_ids", 500, r"^sparsecore\.(fused_)?lookup\.default: sample_ids\[\d+, \d+\] = 500 is out of range for the bags of the "
                        r"batch of size 6"),
])
def test_debug_catches_a_corrupt_coo_entry(field, value, message):
    ebc = collection()
    corrupt = with_entry(batch(ebc), field, value)
    torch_tpu.set_eager_mode("debug")
    with pytest.raises(IndexError, match=message) as raised:
        ebc(corrupt)
    assert "test_debug_checks.py" in str(raised.value) and "ebc(corrupt)" in str(raised.value)
