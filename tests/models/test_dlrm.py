"""models.dlrm (DLRM, DLRM_DCN over the SparseCore engine) against TorchRec's own models.

The references are ``torchrec.models.dlrm.DLRM`` / ``DLRM_DCN`` over a
``torchrec.EmbeddingBagCollection`` of the same ``EmbeddingBagConfig``s, on the
CPU, with the weights copied over through ``state_dict``. Gradients are
checked against torch autograd through the reference, and the embedding rows
against a hand-computed SGD step from the reference tables' dense ``.grad``.
"""

import pytest
import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.models import dlrm as torchrec_dlrm
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import sparsecore
from data import schema
from data.synthetic import SyntheticConfig, SyntheticCriteo
from models.dlrm import DLRM, DLRM_DCN

DIM = 8
DENSE_ARCH = [16, DIM]
OVER_ARCH = [16, 1]
BATCH = 64


def make_data(multi_hot=False):
    return SyntheticCriteo(SyntheticConfig(scale=1e-5, num_samples=4 * BATCH, multi_hot=multi_hot, seed=3))


def table_configs(source):
    return [EmbeddingBagConfig(name=f"t_{name}", num_embeddings=rows, embedding_dim=DIM, feature_names=[name])
            for name, rows in zip(schema.SPARSE_NAMES, source.table_sizes)]


def engine_tables(configs, batch_ids):
    # Partition limits high enough for any batch used here (they only check).
    return [sparsecore.SparseCoreEmbeddingConfig(config=c, max_ids_per_partition=batch_ids,
                                                 max_unique_ids_per_partition=batch_ids) for c in configs]


def build_pair(kind, source, *, optimizer=None, weighted=False, seed=0):
    """(reference on cpu, ours on tpu) with the reference's weights loaded into ours."""
    configs = table_configs(source)
    torch.manual_seed(seed)
    ref_ebc = EmbeddingBagCollection(tables=configs, is_weighted=weighted)
    ebc = sparsecore.SparseCoreEmbeddingBagCollection(
        engine_tables(configs, BATCH * sum(source.pooling)), optimizer, device="tpu", is_weighted=weighted)
    args = (schema.NUM_DENSE, DENSE_ARCH, OVER_ARCH)
    if kind == "dlrm":
        ref, ours = torchrec_dlrm.DLRM(ref_ebc, *args), DLRM(ebc, *args)
    else:
        ref = torchrec_dlrm.DLRM_DCN(ref_ebc, *args, dcn_num_layers=2, dcn_low_rank_dim=4)
        ours = DLRM_DCN(ebc, *args, dcn_num_layers=2, dcn_low_rank_dim=4)
    ours = ours.to("tpu")
    assert list(ours.state_dict().keys()) == list(ref.state_dict().keys())
    ours.load_state_dict(ref.state_dict())
    # Loading really copied: every tensor (tables included) equals the reference's.
    for key, value in ours.state_dict().items():
        torch.testing.assert_close(value.cpu(), ref.state_dict()[key], atol=0, rtol=0, msg=key)
    return ref, ours


def drop_bags(kjt, seed):
    """The KJT with about a third of its bags emptied (their ids removed)."""
    g = torch.Generator().manual_seed(seed)
    lengths = kjt.lengths()
    keep_bag = torch.rand(lengths.numel(), generator=g) > 0.33
    keep_id = torch.repeat_interleave(keep_bag, lengths)
    weights = kjt.weights_or_none()
    return KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values()[keep_id], lengths=lengths * keep_bag,
                             weights=None if weights is None else weights[keep_id])


def batch(source, start=0, weighted=False, empty_bags=False):
    samples = source.rows(start, start + BATCH)
    kjt = samples.kjt()
    if weighted:
        g = torch.Generator().manual_seed(start + 11)
        kjt = KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values(), lengths=kjt.lengths(),
                                weights=torch.rand(kjt.values().numel(), generator=g) + 0.25)
    if empty_bags:
        kjt = drop_bags(kjt, start)
    return torch.from_numpy(samples.dense), kjt, torch.from_numpy(samples.labels)


def forward_both(ref, ours, dense, sparse):
    expected = ref(dense, sparse).detach()
    with torch.tpu.precision("highest"):
        actual = ours(dense.to("tpu"), sparse)
    return expected, actual


def forward_matching(ref, ours, dense, sparse):
    """forward_both, checking that our output matches the reference's."""
    expected, actual = forward_both(ref, ours, dense, sparse)
    torch.testing.assert_close(actual.cpu(), expected, atol=1e-5, rtol=1e-5)
    return expected, actual


@pytest.mark.parametrize("kind", ["dlrm", "dcn"])
@pytest.mark.parametrize("multi_hot, empty_bags", [(False, False), (True, False), (True, True)],
                         ids=["one_hot", "multi_hot_weighted", "multi_hot_weighted_empty_bags"])
def test_forward_matches_torchrec(kind, multi_hot, empty_bags):
    source = make_data(multi_hot)
    if multi_hot:
        assert max(source.pooling) > 1
    ref, ours = build_pair(kind, source, weighted=multi_hot)
    for start in (0, BATCH):
        dense, kjt, _ = batch(source, start, weighted=multi_hot, empty_bags=empty_bags)
        if multi_hot:
            assert int(kjt.lengths().max()) > 1
            assert bool((kjt.lengths() == 0).any()) == empty_bags
        expected, actual = forward_matching(ref, ours, dense, kjt)
        assert actual.device.type == "tpu" and actual.shape == (BATCH, 1)
        assert float(expected.std()) > 1e-3  # the samples differ: a meaningful comparison


@pytest.mark.parametrize("kind", ["dlrm", "dcn"])
def test_forward_depends_on_the_embeddings(kind):
    # A changed table row changes our output exactly as it changes TorchRec's.
    source = make_data()
    ref, ours = build_pair(kind, source)
    dense, kjt, _ = batch(source)
    key = "sparse_arch.embedding_bag_collection.embedding_bags.t_cat_0.weight"
    state = ref.state_dict()
    with torch.no_grad():
        state[key].add_(1.0)  # a view of the reference's parameter
    ours.load_state_dict(state)
    expected, _ = forward_matching(ref, ours, dense, kjt)
    before, _ = forward_both(*build_pair(kind, source), dense, kjt)
    assert not torch.allclose(expected, before, atol=1e-3)


@pytest.mark.parametrize("kind", ["dlrm", "dcn"])
def test_forward_accepts_a_preprocessed_batch(kind):
    source = make_data()
    ref, ours = build_pair(kind, source)
    dense, kjt, _ = batch(source)
    ebc = ours.sparse_arch.embedding_bag_collection
    pre = ebc.preprocess(kjt)
    assert isinstance(pre, sparsecore.PreprocessedBatch)
    expected, from_kjt = forward_both(ref, ours, dense, kjt)
    with torch.tpu.precision("highest"):
        from_pre = ours(dense.to("tpu"), pre)
    torch.testing.assert_close(from_pre.cpu(), from_kjt.cpu(), atol=0, rtol=0)
    torch.testing.assert_close(from_pre.cpu(), expected.detach(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cls", [DLRM, DLRM_DCN])
def test_a_torchrec_embedding_bag_collection_is_refused(cls):
    configs = table_configs(make_data())
    extra = {"dcn_num_layers": 2, "dcn_low_rank_dim": 4} if cls is DLRM_DCN else {}
    with pytest.raises(TypeError, match="SparseCoreEmbeddingBagCollection"):
        cls(EmbeddingBagCollection(tables=configs), schema.NUM_DENSE, DENSE_ARCH, OVER_ARCH, **extra)


@pytest.mark.parametrize("kind", ["dlrm", "dcn"])
@pytest.mark.parametrize("multi_hot", [False, True], ids=["one_hot", "multi_hot"])
def test_one_backward_matches_torchrec(kind, multi_hot):
    lr = 0.1
    source = make_data(multi_hot)
    ref, ours = build_pair(kind, source, optimizer=sparsecore.optim.SGD(lr=lr))
    dense, kjt, labels = batch(source)
    ref_ebc = ref.sparse_arch.embedding_bag_collection
    ebc = ours.sparse_arch.embedding_bag_collection
    tables = [c.name for c in ref_ebc.embedding_bag_configs()]
    before = {t: ref_ebc.embedding_bags[t].weight.detach().clone() for t in tables}

    ref_loss = torch.nn.functional.binary_cross_entropy_with_logits(ref(dense, kjt).squeeze(-1), labels)
    ref_loss.backward()
    with torch.tpu.precision("highest"):
        loss = torch.nn.functional.binary_cross_entropy_with_logits(
            ours(dense.to("tpu"), kjt).squeeze(-1), labels.to("tpu"))
        loss.backward()
    torch.testing.assert_close(loss.detach().cpu(), ref_loss.detach(), atol=1e-6, rtol=1e-6)

    # Dense parameters: the same gradients as TorchRec's model under torch autograd.
    ref_params = dict(ref.named_parameters())
    dense_names = [n for n in ref_params if not n.startswith("sparse_arch.")]
    assert dense_names
    for name, param in ours.named_parameters():
        if name.startswith("sparse_arch."):
            continue
        assert param.grad is not None, name
        torch.testing.assert_close(param.grad.cpu(), ref_params[name].grad, atol=1e-5, rtol=1e-5, msg=name)

    # Tables: updated in the backward by the fused SGD, exactly as weight - lr * grad.
    touched = 0
    for t in tables:
        grad = ref_ebc.embedding_bags[t].weight.grad
        assert grad is not None, t
        touched += int((grad.abs().sum(1) > 0).sum())
        expected = before[t] - lr * grad
        torch.testing.assert_close(ebc.table_weight(t).cpu(), expected, atol=1e-5, rtol=1e-5, msg=t)
    assert touched >= len(tables)  # every table had at least one row move
    # No dense gradient of a table exists on our side.
    assert all(p.grad is None for n, p in ours.named_parameters() if n.startswith("sparse_arch."))
